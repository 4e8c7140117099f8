"""Unit tests for the stub provider: each wire format and each directive.

Time is faked (an injected clock and sleep) so latency and hang cost
nothing; one test uses the real clock with a 0.2 s latency.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import struct
import time
import uuid
import wave
import zlib

import pytest

from stub_provider import create_app, directives as d, outputs
from stub_provider.__main__ import parse_args

BFL_KEY = {"x-key": "test-key"}
BEARER = {"Authorization": "Bearer test-token"}
VERTEX_URL = "/v1/projects/demo/locations/global/publishers/google/models/gemini-2.5-flash-image:generateContent"


class FakeTime:
    """A clock that only moves when the app sleeps or the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0  # seconds
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


@pytest.fixture
def client(fake_time):
    return create_app(clock=fake_time.clock, sleep=fake_time.sleep).test_client()


def digest_of(body) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def submit(client, prompt, model="flux-2-pro", **extra):
    return client.post(f"/v1/{model}", json={"prompt": prompt, **extra}, headers=BFL_KEY)


def poll(client, task_id):
    return client.get(f"/v1/get_result?id={task_id}", headers=BFL_KEY)


def vertex_body(*texts):
    return {"contents": [{"role": "user", "parts": [{"text": t} for t in texts]}]}


def speech(client, text, **extra):
    body = {"model": "gpt-4o-mini-tts", "input": text, "voice": "alloy", **extra}
    return client.post("/v1/audio/speech", json=body, headers=BEARER)


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and raw scanlines of a PNG, checking signature and CRCs."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF
        chunks[kind] = payload
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert b"IEND" in chunks
    return width, height, zlib.decompress(chunks[b"IDAT"])


# --- directives ---------------------------------------------------------------


def test_parse_directives_values_defaults_and_junk():
    text = "a [stub:latency=1.5] b [stub:status=503][stub:fail_times=2] [stub:hang] [stub:refuse] [stub:reject] [stub:nope=1]"
    got = d.parse(text)
    assert (got.latency, got.status, got.fail_times, got.hang, got.refuse, got.reject) == (1.5, 503, 2, 120.0, True, True)
    assert got.retry_after is None
    assert d.parse("[stub:latency=abc] [stub:status=200] [stub:fail_times=-1] [stub:latency=-3]") == d.Directives()
    assert d.parse("[stub:hang=0.5]").hang == 0.5
    assert d.parse("[stub:latency=1][stub:latency=2]").latency == 2.0
    assert d.parse(None) == d.Directives()


def test_rate_limit_directives_and_fault_order():
    assert d.parse("[stub:429=3]").retry_after == 3.0
    assert d.parse("[stub:429=3]").rate_limit_times == 1
    assert d.parse("[stub:429_times=2]").retry_after == 1.0
    both = d.parse("[stub:429=0.5][stub:429_times=2][stub:fail_times=1]")
    faults = [d.decide_fault(both, n) for n in range(1, 5)]
    assert faults == [d.Fault(429, "0.5"), d.Fault(429, "0.5"), d.Fault(500), None]
    assert d.decide_fault(d.parse("[stub:status=502]"), 99) == d.Fault(502)


# --- BFL ----------------------------------------------------------------------


def test_bfl_requires_x_key(client):
    for resp in (
        client.post("/v1/flux-2-pro", json={"prompt": "x"}),
        client.get("/v1/get_result?id=abc"),
        client.post("/v1/cancel?id=abc"),
    ):
        assert resp.status_code == 403
        assert resp.get_json() == {"detail": "Not authenticated - Invalid Authentication"}


def test_bfl_submit_is_deterministic_and_idempotent(client):
    body = {"prompt": "a red fox", "width": 512, "unknown_field": True}
    first = client.post("/v1/flux-2-pro", json=body, headers=BFL_KEY)
    second = client.post("/v1/flux-2-pro", json=body, headers=BFL_KEY)
    assert first.status_code == 200 and first.data == second.data
    task_id = first.get_json()["id"]
    expected = hashlib.sha256(("flux-2-pro" + json.dumps(body, sort_keys=True, separators=(",", ":"))).encode())
    assert task_id == str(uuid.UUID(hex=expected.hexdigest()[:32]))
    assert first.get_json()["polling_url"] == f"http://localhost/v1/get_result?id={task_id}"
    other_model = client.post("/v1/flux-pro-1.1", json=body, headers=BFL_KEY).get_json()["id"]
    assert other_model != task_id
    calls = client.get("/stub/calls").get_json()
    assert calls["submits"][f"bfl_submit:{digest_of(body)}"] == 3
    assert calls["total"]["bfl_submit"] == 3


def test_bfl_poll_unknown_and_missing_id(client):
    assert poll(client, "nope").get_json() == {"id": "nope", "status": "Task not found"}
    assert client.get("/v1/get_result", headers=BFL_KEY).status_code == 422


def test_bfl_latency_pending_then_ready(client, fake_time):
    task_id = submit(client, "slow [stub:latency=10]").get_json()["id"]
    fake_time.now += 2.5
    pending = poll(client, task_id).get_json()
    assert pending == {"id": task_id, "status": "Pending", "result": None, "progress": 0.25}
    # Re-submitting keeps the first submission time.
    submit(client, "slow [stub:latency=10]")
    fake_time.now += 7.5
    ready = poll(client, task_id)
    assert ready.get_json()["status"] == "Ready"
    assert ready.get_json()["result"]["prompt"] == "slow [stub:latency=10]"
    assert poll(client, task_id).data == ready.data


def test_bfl_ready_body_identical_across_restarts(fake_time):
    bodies = []
    for _ in range(2):
        app_client = create_app(clock=fake_time.clock, sleep=fake_time.sleep).test_client()
        task_id = submit(app_client, "stable", seed=42, output_format="png").get_json()["id"]
        bodies.append(poll(app_client, task_id).data)
    assert bodies[0] == bodies[1]
    result = json.loads(bodies[0])["result"]
    assert result["seed"] == 42 and result["sample"].endswith(".png")


def test_bfl_sample_files_are_real_images(client):
    task_id = submit(client, "jpeg please").get_json()["id"]
    result = poll(client, task_id).get_json()["result"]
    assert isinstance(result["seed"], int)
    jpeg = client.get(result["sample"].removeprefix("http://localhost"))
    assert jpeg.status_code == 200 and jpeg.mimetype == "image/jpeg"
    assert jpeg.data[:2] == b"\xff\xd8" and jpeg.data[-2:] == b"\xff\xd9"
    assert b"\xff\xc0" in jpeg.data  # baseline frame header
    png = client.get("/files/" + "ab" * 32 + ".png")
    assert png.mimetype == "image/png"
    width, height, raw = decode_png(png.data)
    assert (width, height) == (8, 8) and raw[1:4] == bytes([0xAB, 0xAB, 0xAB])
    assert client.get("/files/../etc.png").status_code == 404
    assert client.get("/files/" + "ab" * 32 + ".gif").status_code == 404


def test_bfl_refuse_moderated_after_latency(client, fake_time):
    task_id = submit(client, "[stub:refuse][stub:latency=1]").get_json()["id"]
    assert poll(client, task_id).get_json()["status"] == "Pending"
    fake_time.now += 1
    assert poll(client, task_id).get_json() == {
        "id": task_id,
        "status": "Content Moderated",
        "result": None,
        "details": {"Moderation Reasons": ["stub refusal"]},
    }


def test_bfl_reject_is_422(client):
    resp = submit(client, "bad [stub:reject]")
    assert resp.status_code == 422
    assert resp.get_json() == {"detail": [{"loc": ["body", "prompt"], "msg": "stub rejected the input", "type": "value_error"}]}
    assert client.post("/v1/flux-2-pro", json={"width": 1}, headers=BFL_KEY).status_code == 422


def test_bfl_status_and_fail_times_on_submit(client, fake_time):
    for _ in range(2):
        resp = submit(client, "[stub:status=503]")
        assert resp.status_code == 503 and resp.get_json() == {"detail": "Service Unavailable"}
    codes = [submit(client, "flaky [stub:fail_times=2]").status_code for _ in range(3)]
    assert codes == [500, 500, 200]
    assert submit(client, "x [stub:fail_times=1]").get_json() == {"detail": "Internal Server Error"}


def test_bfl_429_then_success(client):
    first = submit(client, "busy [stub:429=3]")
    assert first.status_code == 429 and first.headers["Retry-After"] == "3"
    assert first.get_json() == {"detail": "You have exceeded the rate limit"}
    assert submit(client, "busy [stub:429=3]").status_code == 200
    codes = [submit(client, "[stub:429=1][stub:429_times=2]").status_code for _ in range(3)]
    assert codes == [429, 429, 200]


def test_bfl_hang_applies_to_submit(client, fake_time):
    assert submit(client, "[stub:hang]").status_code == 200
    assert submit(client, "[stub:hang=0.2]").status_code == 200
    assert fake_time.sleeps == [120.0, 0.2]


def test_bfl_cancel(client, fake_time):
    task_id = submit(client, "long [stub:latency=60]").get_json()["id"]
    resp = client.post(f"/v1/cancel?id={task_id}", headers=BFL_KEY)
    assert resp.status_code == 200 and resp.get_json() == {"id": task_id, "status": "Cancelled"}
    fake_time.now += 120
    assert poll(client, task_id).get_json() == {
        "id": task_id,
        "status": "Error",
        "result": None,
        "details": {"reason": "cancelled"},
    }
    assert client.delete(f"/v1/get_result?id={task_id}", headers=BFL_KEY).status_code == 200
    assert client.post("/v1/cancel?id=unknown", headers=BFL_KEY).status_code == 404
    done_id = submit(client, "quick").get_json()["id"]
    assert client.delete(f"/v1/get_result?id={done_id}", headers=BFL_KEY).status_code == 409


def test_bfl_real_clock_latency():
    client = create_app().test_client()
    task_id = submit(client, "real [stub:latency=0.2]").get_json()["id"]
    assert poll(client, task_id).get_json()["status"] == "Pending"
    time.sleep(0.25)
    assert poll(client, task_id).get_json()["status"] == "Ready"


# --- Vertex -------------------------------------------------------------------


def test_vertex_requires_bearer(client):
    resp = client.post(VERTEX_URL, json=vertex_body("hi"))
    assert resp.status_code == 401
    assert resp.get_json() == {
        "error": {"code": 401, "message": "Request is missing required authentication credential.", "status": "UNAUTHENTICATED"}
    }


def test_vertex_success_png_and_determinism(client, fake_time):
    body = vertex_body("a blue whale")
    first = client.post(VERTEX_URL, json=body, headers=BEARER)
    assert first.status_code == 200 and first.mimetype == "application/json"
    assert create_app().test_client().post(VERTEX_URL, json=body, headers=BEARER).data == first.data
    doc = first.get_json()
    candidate = doc["candidates"][0]
    assert candidate["finishReason"] == "STOP" and candidate["index"] == 0
    inline = candidate["content"]["parts"][0]["inlineData"]
    assert candidate["content"]["role"] == "model" and inline["mimeType"] == "image/png"
    width, height, _ = decode_png(base64.b64decode(inline["data"]))
    assert (width, height) == (8, 8)
    usage = doc["usageMetadata"]
    assert usage["candidatesTokenCount"] == 1290
    assert usage["totalTokenCount"] == usage["promptTokenCount"] + 1290
    assert doc["modelVersion"] == "gemini-2.5-flash-image"
    assert len(doc["responseId"]) == 22
    assert fake_time.sleeps == []


def test_vertex_size_directive_pads_the_image_to_that_many_bytes(client):
    body = vertex_body("a 2 MB answer [stub:size=2000000]")
    answer = client.post(VERTEX_URL, json=body, headers=BEARER)
    image = base64.b64decode(answer.get_json()["candidates"][0]["content"]["parts"][0]["inlineData"]["data"])
    assert len(image) == 2_000_000 and len(answer.data) > 2_600_000
    assert decode_png(image)[:2] == (8, 8)  # still a valid PNG: the padding is a chunk decoders skip
    assert create_app().test_client().post(VERTEX_URL, json=body, headers=BEARER).data == answer.data
    tiny = client.post(VERTEX_URL, json=vertex_body("[stub:size=10]"), headers=BEARER).get_json()
    assert decode_png(base64.b64decode(tiny["candidates"][0]["content"]["parts"][0]["inlineData"]["data"]))
    assert d.parse("[stub:size=99999999999]").size is None  # past MAX_SIZE_BYTES: ignored


def test_openai_size_directive_makes_audio_that_many_bytes(client):
    mp3 = speech(client, "long [stub:size=2000000]")
    assert len(mp3.data) == 2_000_000 and mp3.data.startswith(b"ID3")
    assert speech(client, "long [stub:size=2000000]").data == mp3.data
    wav = speech(client, "long [stub:size=2000000]", response_format="wav")
    assert len(wav.data) == 2_000_000
    with wave.open(io.BytesIO(wav.data)) as audio:
        assert audio.getnframes() == (2_000_000 - 44) // 2


def test_vertex_bad_requests(client):
    resp = client.post(VERTEX_URL, json={"generationConfig": {}}, headers=BEARER)
    assert resp.status_code == 400 and resp.get_json()["error"]["status"] == "INVALID_ARGUMENT"
    other = VERTEX_URL.replace(":generateContent", ":streamGenerateContent")
    resp = client.post(other, json=vertex_body("hi"), headers=BEARER)
    assert resp.status_code == 404 and resp.get_json()["error"]["status"] == "NOT_FOUND"


def test_vertex_directives_span_parts(client, fake_time):
    resp = client.post(VERTEX_URL, json=vertex_body("first part ", "[stub:latency=0.2]"), headers=BEARER)
    assert resp.status_code == 200 and fake_time.sleeps == [0.2]


def test_vertex_refuse_and_reject(client):
    refused = client.post(VERTEX_URL, json=vertex_body("[stub:refuse]"), headers=BEARER)
    doc = refused.get_json()
    assert refused.status_code == 200 and "candidates" not in doc
    assert doc["promptFeedback"] == {"blockReason": "SAFETY", "blockReasonMessage": "stub refusal"}
    rejected = client.post(VERTEX_URL, json=vertex_body("[stub:reject]"), headers=BEARER)
    assert rejected.status_code == 400
    assert rejected.get_json() == {"error": {"code": 400, "message": "stub rejected the input", "status": "INVALID_ARGUMENT"}}


def test_vertex_faults(client, fake_time):
    for code, status in ((500, "INTERNAL"), (503, "UNAVAILABLE"), (502, "UNAVAILABLE")):
        resp = client.post(VERTEX_URL, json=vertex_body(f"[stub:status={code}]"), headers=BEARER)
        assert resp.status_code == code and resp.get_json()["error"]["status"] == status
    limited = client.post(VERTEX_URL, json=vertex_body("[stub:429=2]"), headers=BEARER)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert limited.get_json()["error"]["status"] == "RESOURCE_EXHAUSTED"
    codes = [client.post(VERTEX_URL, json=vertex_body("[stub:fail_times=1]"), headers=BEARER).status_code for _ in range(2)]
    assert codes == [500, 200]
    assert client.post(VERTEX_URL, json=vertex_body("[stub:hang=0.2]"), headers=BEARER).status_code == 200
    assert fake_time.sleeps == [0.2]


# --- OpenAI speech ------------------------------------------------------------


def test_openai_requires_bearer_and_fields(client):
    resp = client.post("/v1/audio/speech", json={"model": "m", "input": "x", "voice": "alloy"})
    assert resp.status_code == 401
    error = resp.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None
    resp = client.post("/v1/audio/speech", json={"model": "m", "voice": "alloy"}, headers=BEARER)
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "input"
    assert speech(client, "x", response_format="flac").status_code == 400


def test_openai_mp3_bytes(client):
    resp = speech(client, "hello")
    assert resp.status_code == 200 and resp.mimetype == "audio/mpeg"
    assert resp.data.startswith(b"ID3") and len(resp.data) == 64 + 32 * 5
    assert speech(client, "hello").data == resp.data
    assert create_app().test_client().post(
        "/v1/audio/speech", json={"model": "gpt-4o-mini-tts", "input": "hello", "voice": "alloy"}, headers=BEARER
    ).data == resp.data
    assert speech(client, "hello", voice="nova").data != resp.data
    assert len(speech(client, "x" * 5000).data) == 64 * 1024


def test_openai_wav_is_valid(client):
    resp = speech(client, "a longer sentence to speak", response_format="wav")
    assert resp.status_code == 200 and resp.mimetype == "audio/wav"
    with wave.open(io.BytesIO(resp.data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.getnframes() > 0
    assert speech(client, "a longer sentence to speak", response_format="wav").data == resp.data


def test_openai_refuse_reject_and_faults(client, fake_time):
    refused = speech(client, "[stub:refuse]").get_json()["error"]
    assert refused == {
        "message": "stub refusal: content policy",
        "type": "invalid_request_error",
        "param": None,
        "code": "content_policy_violation",
    }
    rejected = speech(client, "[stub:reject]")
    assert rejected.status_code == 400 and rejected.get_json()["error"]["code"] == "invalid_value"
    failing = speech(client, "[stub:status=502]")
    assert failing.status_code == 502
    assert failing.get_json()["error"]["type"] == "server_error" and failing.get_json()["error"]["code"] is None
    limited = speech(client, "[stub:429=4]")
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "4"
    assert limited.get_json()["error"] == {
        "message": "Rate limit reached",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert speech(client, "[stub:429=4]").status_code == 200
    assert [speech(client, "[stub:fail_times=1]").status_code for _ in range(2)] == [500, 200]
    assert speech(client, "[stub:hang][stub:latency=0.2]").status_code == 200
    assert fake_time.sleeps == [120.0, 0.2]


# --- observability and entry point ----------------------------------------------


def test_healthz_calls_and_reset(client):
    assert client.get("/healthz").data == b"ok"
    task_id = submit(client, "counted").get_json()["id"]
    poll(client, task_id)
    speech(client, "counted")
    calls = client.get("/stub/calls").get_json()
    bfl_digest = digest_of({"prompt": "counted"})
    assert calls["submits"][f"bfl_submit:{bfl_digest}"] == 1
    assert calls["submits"][f"bfl_poll:{bfl_digest}"] == 1
    assert calls["total"] == {"bfl_poll": 1, "bfl_submit": 1, "openai_speech": 1}
    assert calls["by_key"] == {"bfl_submit:test-key": 1, "openai_speech:test-token": 1}
    assert client.post("/stub/reset").status_code == 200
    assert client.get("/stub/calls").get_json() == {"submits": {}, "total": {}, "by_key": {}}
    assert poll(client, task_id).get_json()["status"] == "Task not found"
    # Fault counters reset too: fail_times fails again after a reset.
    assert speech(client, "[stub:fail_times=1]").status_code == 500
    client.post("/stub/reset")
    assert speech(client, "[stub:fail_times=1]").status_code == 500


def test_outputs_are_pure_functions():
    h = hashlib.sha256(b"x").hexdigest()
    assert outputs.jpeg_bytes(h) == outputs.jpeg_bytes(h)
    assert outputs.response_id(h) == outputs.response_id(h)
    assert outputs.task_id(h) == str(uuid.UUID(hex=h[:32]))


def test_main_parse_args():
    args = parse_args(["--host", "127.0.0.1", "--port", "8300"])
    assert (args.host, args.port, args.access_log) == ("127.0.0.1", 8300, False)


def test_a_member_key_fault_answers_that_key_alone(client):
    """``429_key``/``401_key``: a pool member's own answers, whatever the attempt;
    another key is served, and the member's calls count by key."""
    prompt = "pooled [stub:429_key=test-key] [stub:401_key=revoked-key]"
    limited = submit(client, prompt)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "1"
    refused = client.post("/v1/flux-2-pro", json={"prompt": prompt}, headers={"x-key": "revoked-key"})
    assert refused.status_code == 401
    served = client.post("/v1/flux-2-pro", json={"prompt": prompt}, headers={"x-key": "other-key"})
    assert served.status_code == 200, served.get_data(as_text=True)
    assert client.get("/stub/calls").get_json()["by_key"] == {
        "bfl_submit:other-key": 1, "bfl_submit:revoked-key": 1, "bfl_submit:test-key": 1}
