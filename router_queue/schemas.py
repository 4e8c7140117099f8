"""Input schemas, one marshmallow schema per model, and their per-field errors.

A schema only validates: the body that passes is forwarded to the provider
unchanged, byte for byte as the caller's JSON parsed, never reshaped by
``load``'s output. Unknown top-level fields are refused so a typo is a clear
``422`` rather than a silently ignored option.
"""

from __future__ import annotations

from typing import Any

from marshmallow import INCLUDE, RAISE, Schema, ValidationError, fields, validate, validates_schema

# -- bfl/flux-2-pro: BFL's own request body ------------------------------------


class Flux2ProInput(Schema):
    class Meta:
        unknown = RAISE

    prompt = fields.String(required=True, validate=validate.Length(min=1, max=10_000))
    input_image = fields.String()
    input_image_2 = fields.String()
    input_image_3 = fields.String()
    seed = fields.Integer(validate=validate.Range(min=0, max=2**32 - 1))
    width = fields.Integer(validate=validate.Range(min=64, max=2048))
    height = fields.Integer(validate=validate.Range(min=64, max=2048))
    safety_tolerance = fields.Integer(validate=validate.Range(min=0, max=6))
    output_format = fields.String(validate=validate.OneOf(["jpeg", "png"]))
    prompt_upsampling = fields.Boolean()


# -- vertexai/gemini-3.1-flash-image: generateContent ---------------------------


class _Blob(Schema):
    mimeType = fields.String(required=True)
    data = fields.String(required=True)


class _FileData(Schema):
    mimeType = fields.String(required=True)
    fileUri = fields.String(required=True)


class _Part(Schema):
    class Meta:
        unknown = RAISE

    text = fields.String()
    inlineData = fields.Nested(_Blob)
    fileData = fields.Nested(_FileData)

    @validates_schema
    def _one_kind(self, data: dict[str, Any], **_: Any) -> None:
        if len(data) != 1:
            raise ValidationError("a part holds exactly one of text, inlineData, fileData")


class _Content(Schema):
    class Meta:
        unknown = RAISE

    role = fields.String(validate=validate.OneOf(["user", "model"]))
    parts = fields.List(fields.Nested(_Part), required=True, validate=validate.Length(min=1))


class _ImageConfig(Schema):
    aspectRatio = fields.String(
        validate=validate.OneOf(["1:1", "2:3", "3:2", "3:4", "4:3", "4:5", "5:4", "9:16", "16:9", "21:9"])
    )
    imageSize = fields.String(validate=validate.OneOf(["1K", "2K", "4K"]))


class _GenerationConfig(Schema):
    class Meta:
        unknown = RAISE

    responseModalities = fields.List(fields.String(validate=validate.OneOf(["TEXT", "IMAGE"])))
    temperature = fields.Float(validate=validate.Range(min=0, max=2))
    topP = fields.Float(validate=validate.Range(min=0, max=1))
    candidateCount = fields.Integer(validate=validate.Range(min=1, max=1))
    seed = fields.Integer()
    imageConfig = fields.Nested(_ImageConfig)


class GeminiGenerateContentInput(Schema):
    class Meta:
        unknown = RAISE

    contents = fields.List(fields.Nested(_Content), required=True, validate=validate.Length(min=1))
    generationConfig = fields.Nested(_GenerationConfig)
    systemInstruction = fields.Nested(_Content)
    safetySettings = fields.List(fields.Dict(keys=fields.String(), values=fields.String()))


# -- openai/gpt-4o-mini-tts: the audio/speech body -----------------------------

VOICES = ["alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"]


class SpeechInput(Schema):
    class Meta:
        unknown = RAISE

    input = fields.String(required=True, validate=validate.Length(min=1, max=4096))
    voice = fields.String(required=True, validate=validate.OneOf(VOICES))
    model = fields.String(validate=validate.OneOf(["gpt-4o-mini-tts"]))
    instructions = fields.String(validate=validate.Length(max=4096))
    response_format = fields.String(validate=validate.OneOf(["mp3", "wav"]))
    speed = fields.Float(validate=validate.Range(min=0.25, max=4.0))


# -- outputs: documentation of the providers' native answers ---------------------
# The routes never reshape an output (it is served byte for byte); these only
# describe it in the OpenAPI documents, so unknown fields are allowed.


class _FluxSample(Schema):
    class Meta:
        unknown = INCLUDE

    sample = fields.String(required=True, metadata={"description": "signed URL of the image"})
    prompt = fields.String()
    seed = fields.Integer()


class Flux2ProOutput(Schema):
    class Meta:
        unknown = INCLUDE

    id = fields.String(required=True)
    status = fields.String(required=True, metadata={"description": "Ready"})
    result = fields.Nested(_FluxSample, required=True)


class _OutputPart(Schema):
    class Meta:
        unknown = INCLUDE

    text = fields.String()
    inlineData = fields.Nested(_Blob)


class _OutputContent(Schema):
    class Meta:
        unknown = INCLUDE

    role = fields.String()
    parts = fields.List(fields.Nested(_OutputPart))


class _Candidate(Schema):
    class Meta:
        unknown = INCLUDE

    content = fields.Nested(_OutputContent)
    finishReason = fields.String()
    index = fields.Integer()


class GenerateContentOutput(Schema):
    class Meta:
        unknown = INCLUDE

    candidates = fields.List(fields.Nested(_Candidate))
    promptFeedback = fields.Dict()
    usageMetadata = fields.Dict()
    modelVersion = fields.String()
    responseId = fields.String()


#: Schema classes by the name a catalog entry gives in ``input_schema`` or
#: ``output_schema``.
SCHEMAS: dict[str, type[Schema]] = {
    cls.__name__: cls
    for cls in (Flux2ProInput, GeminiGenerateContentInput, SpeechInput, Flux2ProOutput, GenerateContentOutput)
}

# -- per-field errors ------------------------------------------------------------

#: marshmallow's message texts -> the machine-readable ``type`` of a detail entry.
_TYPES = (
    ("Missing data for required field", "missing"),
    ("Unknown field", "extra_forbidden"),
    ("Field may not be null", "null_not_allowed"),
    ("Not a valid string", "string_type"),
    ("Not a valid integer", "int_type"),
    ("Not a valid number", "float_type"),
    ("Not a valid boolean", "bool_type"),
    ("Not a valid list", "list_type"),
    ("Invalid input type", "object_type"),
    ("Not a valid mapping", "object_type"),
    ("Must be one of", "enum"),
    ("Must be greater than", "out_of_range"),
    ("Must be less than", "out_of_range"),
    ("Shorter than minimum length", "too_short"),
    ("Longer than maximum length", "too_long"),
    ("Length must be", "length"),
)


def _type_of(message: str) -> str:
    for prefix, kind in _TYPES:
        if message.startswith(prefix):
            return kind
    return "value_error"


def _walk(errors: Any, loc: list[Any]) -> list[dict[str, Any]]:
    if isinstance(errors, dict):
        out: list[dict[str, Any]] = []
        for key, value in errors.items():
            path = loc if key == "_schema" else loc + [key]
            out.extend(_walk(value, path))
        return out
    if isinstance(errors, list):
        out = []
        for item in errors:
            if isinstance(item, str):
                out.append({"loc": loc, "msg": item, "type": _type_of(item)})
            else:
                out.extend(_walk(item, loc))
        return out
    return [{"loc": loc, "msg": str(errors), "type": _type_of(str(errors))}]


def validation_detail(messages: dict[str, Any]) -> list[dict[str, Any]]:
    """marshmallow's nested error dict as the contract's ``detail`` array."""
    return _walk(messages, ["body"])
