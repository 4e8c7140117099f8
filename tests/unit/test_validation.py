"""Bounded validation (``validation.py``, ``schemas.py``) as a caller sees it: a
422 lists at most ten errors and stays under 16 KiB whatever the body, lists
have their maximum lengths, ``fileUri`` is https only, and a body of more
items than any input holds is refused unparsed."""

from __future__ import annotations

import json

import pytest
from werkzeug.test import Client

from router_queue.schemas import MAX_CONTENTS, MAX_IMAGES, MAX_PARTS, MAX_PARTS_IN_ALL, MAX_SAFETY_SETTINGS
from router_queue.validation import MAX_ERRORS, MAX_JSON_ITEMS, too_many_items
from tests.unit.route_support import assert_error, submit

GEMINI = "/v2/models/vertexai/gemini-3.1-flash-image"
#: The error body's ceiling, whatever the input.
MAX_ERROR_BODY = 16 * 1024


def _text(text: str = "a cat") -> dict:
    return {"text": text}


def _image(uri: str = "https://example.com/cat.png") -> dict:
    return {"fileData": {"mimeType": "image/png", "fileUri": uri}}


def _gemini(*parts: dict, turns: int = 1, **extra) -> dict:
    return {"contents": [{"role": "user", "parts": list(parts or [_text()])} for _ in range(turns)], **extra}


def _send(http, auth, body=None, raw=None):
    """A submit of ``body`` as compact JSON (as the report's 1 MB bodies were), or of ``raw``."""
    return submit(http, auth, path=GEMINI, raw=raw if raw is not None else json.dumps(body, separators=(",", ":")))


def _refused(response) -> list[dict]:
    assert_error(response, 422, "invalid_input")
    assert len(response.get_data()) < MAX_ERROR_BODY
    return response.json["detail"]


def test_a_plain_gemini_body_is_admitted(http, auth):
    assert _send(http, auth, _gemini(_text("a red teapot"), _image())).status_code == 201


@pytest.mark.parametrize("uri", ["gs://our-bucket/secret.png", "http://example.com/cat.png", "file:///etc/passwd",
                                 "ftp://example.com/x", "https:/x", "https:///x", " https://example.com/x", ""])
def test_file_uri_other_than_https_is_refused_with_its_location(http, auth, uri):
    detail = _refused(_send(http, auth, _gemini(_image(uri))))
    assert detail == [{"loc": ["body", "contents", 0, "parts", 0, "fileData", "fileUri"], "type": "url_scheme",
                       "msg": "Must be an https URL (https://host/path): gs:// and other schemes are not accepted."}]


@pytest.mark.parametrize("path,make,limit", [
    # Vertex AI documents 14 images per prompt for Gemini 3.1 Flash Image
    (["body", "contents"], lambda n: _gemini(*[_image() for _ in range(n)]), MAX_IMAGES),
    (["body", "contents", 0, "parts"], lambda n: _gemini(*[_text() for _ in range(n)]), MAX_PARTS),
    (["body", "contents"], lambda n: _gemini(turns=n), MAX_CONTENTS),
    (["body", "contents"], lambda n: {"contents": [*_gemini(*[_text()] * 4, turns=MAX_CONTENTS - 1)["contents"],
                                                   {"parts": [_text()] * (n - 4 * (MAX_CONTENTS - 1))}]},
     MAX_PARTS_IN_ALL),
    (["body", "safetySettings"], lambda n: _gemini(safetySettings=[
        {"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}] * n), MAX_SAFETY_SETTINGS),
    (["body", "generationConfig", "responseModalities"],
     lambda n: _gemini(generationConfig={"responseModalities": ["TEXT", "IMAGE", "IMAGE"][:n]}), 2),
])
def test_each_list_is_admitted_at_its_maximum_length_and_refused_past_it(http, auth, path, make, limit):
    assert _send(http, auth, make(limit)).status_code == 201
    detail = _refused(_send(http, auth, make(limit + 1)))
    assert [(entry["loc"], entry["type"]) for entry in detail] == [(path, "too_long")]
    assert str(limit) in detail[0]["msg"]


def test_the_documented_limits_are_the_numbers_we_enforce():
    assert (MAX_IMAGES, MAX_CONTENTS, MAX_PARTS, MAX_PARTS_IN_ALL) == (14, 64, 64, 256)


def test_many_bad_items_list_ten_errors_then_say_the_walk_stopped(http, auth):
    body = {"contents": [{"role": "robot", "parts": [{"text": 1}] * 4}] * 64}
    detail = _refused(_send(http, auth, body))
    assert len(detail) == MAX_ERRORS + 1
    assert {entry["type"] for entry in detail[:-1]} <= {"enum", "string_type"}
    assert detail[-1]["type"] == "too_many_errors" and detail[-1]["ctx"]["stopped"] is True
    assert detail[-1]["ctx"]["limit"] == MAX_ERRORS


def test_many_unknown_keys_name_the_first_ten_and_count_the_rest(http, auth):
    body = _gemini(**{f"colour{i}": "red" for i in range(1000)})
    detail = _refused(_send(http, auth, body))
    assert [entry["loc"] for entry in detail[:-1]] == [["body", f"colour{i}"] for i in range(MAX_ERRORS)]
    assert {entry["type"] for entry in detail[:-1]} == {"extra_forbidden"}
    assert detail[-1]["type"] == "too_many_errors"
    assert detail[-1]["ctx"]["not_listed"] == 1000 - MAX_ERRORS
    assert "990 more errors were not listed" in detail[-1]["msg"]


def test_a_body_of_more_items_than_any_input_holds_is_refused_unparsed(http, auth):
    body = _gemini(**{f"k{i}": 1 for i in range(90_000)})  # the report's 1 MB body
    response = _send(http, auth, body)
    detail = _refused(response)
    assert [(entry["loc"], entry["type"]) for entry in detail] == [(["body"], "too_long")]
    assert str(MAX_JSON_ITEMS) in detail[0]["msg"]
    numbers = {"contents": [1] * (MAX_JSON_ITEMS + 10)}
    assert _refused(_send(http, auth, numbers))[0]["type"] == "too_long"


@pytest.mark.parametrize("key", ["k" * 300_000, "\x00" * 40_000, "\U0001f600" * 25_000, "\\\"" * 60_000],
                         ids=["long", "nul", "astral", "escapes"])
def test_huge_or_escaped_keys_are_cut_in_the_answer(http, auth, key):
    detail = _refused(_send(http, auth, _gemini(**{key + str(i): 1 for i in range(3)})))
    assert all(entry["type"] == "extra_forbidden" for entry in detail)
    assert all(len(entry["loc"][-1]) <= 65 for entry in detail)


def test_many_unknown_keys_of_control_characters_stay_under_16_kib(http, auth):
    """Each cut key is 64 characters that JSON escapes to 12 bytes each."""
    body = _gemini(**{"\U0001f600" * 64 + f"{i:04d}" + "\x01" * 100: 1 for i in range(200)})
    body["contents"] = [{"parts": [{f"\x02{i}" * 200: 1} for i in range(60)]}]
    detail = _refused(_send(http, auth, body))
    assert detail[-1]["type"] == "too_many_errors"


def test_a_prompt_full_of_commas_and_quotes_is_not_counted_as_items(http, auth):
    prompt = 'he said, "yes, \\"no\\", maybe", then: {[,]}, ' * 10_000
    assert too_many_items(json.dumps(_gemini(_text(prompt))).encode()) is None
    assert _send(http, auth, _gemini(_text(prompt))).status_code == 201


def test_item_counts_see_through_escapes():
    assert too_many_items(json.dumps({"a": "\\" * 10_000, "b": '"' * 10_000}).encode(), limit=4) is None
    assert too_many_items(json.dumps({f"k{i}\\": '"' for i in range(5)}).encode(), limit=4)
    assert too_many_items(json.dumps({"a": [1] * 6}).encode(), limit=4)  # 5 separators
    assert too_many_items(json.dumps({"a": "," * 100, "b": [1] * 3}).encode(), limit=4) is None


@pytest.mark.parametrize("raw", [b"[" * 1_000_000, b'{"contents": ' + b"[" * 500_000 + b"]" * 500_000 + b"}",
                                 b'{"a":' * 100_000 + b"1" + b"}" * 100_000])
def test_deep_nesting_is_refused_as_input_not_a_fault(http, auth, raw):
    response = _send(http, auth, raw=raw)
    assert response.status_code in (400, 422), response.get_data(as_text=True)[:300]
    assert response.json["error_type"] == "invalid_input"


def test_nesting_the_schema_does_not_expect_is_one_error(http, auth):
    body = _gemini(_text())
    body["contents"][0]["parts"][0]["text"] = json.loads("[" * 500 + "]" * 500)
    detail = _refused(_send(http, auth, body))
    assert detail == [{"loc": ["body", "contents", 0, "parts", 0, "text"], "msg": "Not a valid string.",
                       "type": "string_type"}]


def test_the_lane_and_flask_refuse_a_hostile_body_alike(app, http, auth):
    flask_only = Client(app.wsgi_app.flask)
    for body in (_gemini(**{f"c{i}": 1 for i in range(500)}), _gemini(**{f"k{i}": 1 for i in range(9000)}),
                 _gemini(_image("gs://b/o"))):
        raw = json.dumps(body)
        answers = [client.post(f"{GEMINI}/requests", data=raw, headers={**auth, "Content-Type": "application/json"})
                   for client in (http, flask_only)]
        assert answers[0].status_code == answers[1].status_code == 422
        assert answers[0].get_data() == answers[1].get_data()
