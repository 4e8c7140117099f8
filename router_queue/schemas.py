"""Input schemas, one marshmallow schema per model, and their per-field errors.

A schema only validates: the body that passes is forwarded to the provider
unchanged, byte for byte as the caller's JSON parsed, never reshaped by
``load``'s output. Unknown fields are refused so a typo is a clear ``422``
rather than a silently ignored option. Every input object is a
``StrictSchema`` and every list a ``BoundedList`` (``validation.py``), so what
a body costs to validate, and its 422, is bounded whatever it holds.
"""

from __future__ import annotations

from typing import Any

from marshmallow import INCLUDE, Schema, ValidationError, fields, pre_load, validate, validates_schema

from .validation import BoundedList, StrictSchema

# -- bfl/flux-2-pro: BFL's own request body ------------------------------------
# No lists: the reference images are the named fields input_image, _2, _3.


class Flux2ProInput(StrictSchema):
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
# Vertex AI documents for Gemini 3.1 Flash Image "Maximum images per prompt: 14"
# and 131,072 input tokens, and no count of contents or parts (only the token
# window bounds them; https://docs.cloud.google.com/vertex-ai/generative-ai/docs/
# models/gemini/3-1-flash-image). The counts below are therefore ours, far
# above what an image prompt uses within our 1 MiB body: they bound what
# validating one body costs.

#: Images a request may carry (inlineData or fileData of an image/* type): Vertex's documented maximum.
MAX_IMAGES = 14
#: Turns in ``contents`` (ours: Vertex documents none).
MAX_CONTENTS = 64
#: Parts in one turn (ours: Vertex documents none).
MAX_PARTS = 64
#: Parts in all turns together, counted before any part is read (ours).
MAX_PARTS_IN_ALL = 256
#: Safety settings: one per harm category, and Vertex's HarmCategory has fewer than this.
MAX_SAFETY_SETTINGS = 16
#: ``fileData.fileUri``: https only. A ``gs://`` URI is read by Vertex with the
#: deployment's own service agent, i.e. with our access to our buckets.
HTTPS_URL = validate.Regexp(r"^https://[^\s/]", error="Must be an https URL (https://host/path): gs:// and other "
                                                       "schemes are not accepted.")


class _Blob(StrictSchema):
    mimeType = fields.String(required=True)
    data = fields.String(required=True)


class _FileData(StrictSchema):
    mimeType = fields.String(required=True)
    fileUri = fields.String(required=True, validate=HTTPS_URL)


class _Part(StrictSchema):
    text = fields.String()
    inlineData = fields.Nested(_Blob)
    fileData = fields.Nested(_FileData)

    @validates_schema
    def _one_kind(self, data: dict[str, Any], **_: Any) -> None:
        if len(data) != 1:
            raise ValidationError("a part holds exactly one of text, inlineData, fileData")


class _Content(StrictSchema):
    role = fields.String(validate=validate.OneOf(["user", "model"]))
    parts = BoundedList(fields.Nested(_Part), required=True, min_length=1, max_length=MAX_PARTS)


class _ImageConfig(StrictSchema):
    aspectRatio = fields.String(
        validate=validate.OneOf(["1:1", "2:3", "3:2", "3:4", "4:3", "4:5", "5:4", "9:16", "16:9", "21:9"])
    )
    imageSize = fields.String(validate=validate.OneOf(["1K", "2K", "4K"]))


class _GenerationConfig(StrictSchema):
    responseModalities = BoundedList(fields.String(validate=validate.OneOf(["TEXT", "IMAGE"])), max_length=2)
    temperature = fields.Float(validate=validate.Range(min=0, max=2))
    topP = fields.Float(validate=validate.Range(min=0, max=1))
    candidateCount = fields.Integer(validate=validate.Range(min=1, max=1))
    seed = fields.Integer()
    imageConfig = fields.Nested(_ImageConfig)


class _SafetySetting(StrictSchema):
    """Vertex's SafetySetting: a harm category and the threshold to block it at."""

    category = fields.String(required=True)
    threshold = fields.String(required=True)
    method = fields.String()


def _image_count(contents: list[dict[str, Any]]) -> int:
    media = (part.get("inlineData") or part.get("fileData") or {} for content in contents
             for part in content["parts"])
    return sum(1 for blob in media if blob.get("mimeType", "").startswith("image/"))


class GeminiGenerateContentInput(StrictSchema):
    contents = BoundedList(fields.Nested(_Content), required=True, min_length=1, max_length=MAX_CONTENTS)
    generationConfig = fields.Nested(_GenerationConfig)
    systemInstruction = fields.Nested(_Content)
    safetySettings = BoundedList(fields.Nested(_SafetySetting), max_length=MAX_SAFETY_SETTINGS)

    @pre_load
    def _parts_in_all(self, data: Any, **_: Any) -> Any:
        """Refuses too many parts in all from the lists' lengths alone, before any part is read."""
        contents = data.get("contents") if isinstance(data, dict) else None
        if isinstance(contents, list) and len(contents) <= MAX_CONTENTS:
            total = sum(len(content["parts"]) for content in contents
                        if isinstance(content, dict) and isinstance(content.get("parts"), list))
            if total > MAX_PARTS_IN_ALL:
                raise ValidationError({"contents": [f"Longer than maximum length: {total} parts in all turns, "
                                                    f"at most {MAX_PARTS_IN_ALL}."]})
        return data

    @validates_schema
    def _images(self, data: dict[str, Any], **_: Any) -> None:
        count = _image_count(data["contents"])
        if count > MAX_IMAGES:
            raise ValidationError(f"Longer than maximum length: {count} images, at most {MAX_IMAGES} per request "
                                  "(Vertex AI's limit for this model).", "contents")


# -- openai/gpt-4o-mini-tts: the audio/speech body -----------------------------
# No lists; OpenAI documents input as at most 4096 characters
# (https://platform.openai.com/docs/api-reference/audio/createSpeech).

VOICES = ["alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"]


class SpeechInput(StrictSchema):
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
