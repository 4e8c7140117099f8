"""The synchronous route and the discovery routes, against the session stack.

* ``POST /v2/models/{provider}/{model}`` through the published client
  (comfy-sdk 0.5.0 ``models.run``) and with plain ``requests``: the synchronous
  output is the very bytes the queued result serves, under the same
  Content-Type.
* The deadline: a second front door (gunicorn, gevent workers, sharing the
  session's Redis, worker and stub) with ``SYNC_DEADLINE_SECONDS=3`` answers
  ``504 deadline_exceeded`` + ``Retry-After`` before that mark; the same
  ``Idempotency-Key`` re-attaches to the one generation, which is submitted to
  the provider once and charged once; comfy-sdk collects a long generation
  through that 504 with its own same-key retry.
* Discovery: ``models.list()`` paging and clamping, ``models.schema()`` with
  its ETag, ``/v2/openapi.json`` (a valid OpenAPI 3 document), ``/v2/docs``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Iterator

import pytest
import requests
from comfy_sdk import BinaryResult, Comfy
from comfy_sdk.router_exceptions import ModelNotFound

from .harness import FLUX, GEMINI, TTS, ApiClient, RunningStack, Stub, ledger_by_request, unique_prompt, wait_for
from .sync_support import SYNC_READ_TIMEOUT_S, documented_media_types, request_body_schema, resolve

JSON = "application/json"
#: The short deadline of the second front door, and how long it really holds (settings.sync_hold_s).
DEADLINE_S = 3.0
HOLD_S = DEADLINE_S - min(5.0, DEADLINE_S / 10)
#: Slack (s) over the hold for the 504 to reach the client on a busy 2-core machine.
DEADLINE_SLACK_S = 0.8
#: Upstream model ids the adapters put in front of the caller's body (workers/providers).
TTS_UPSTREAM = {"model": "gpt-4o-mini-tts"}


def _body_for(model: str, text: str, **extra: Any) -> dict[str, Any]:
    if model == GEMINI:
        return {"contents": [{"role": "user", "parts": [{"text": text}]}],
                "generationConfig": {"responseModalities": ["IMAGE"]}, **extra}
    if model == TTS:
        return {"input": text, "voice": "alloy", **extra}
    return {"prompt": text, **extra}


def _sync_post(caller: ApiClient, base_url: str, model: str, body: Any, *, key: str | None = None,
               timeout: float | tuple[float, float] = SYNC_READ_TIMEOUT_S, bearer: bool = False) -> requests.Response:
    headers = {"Content-Type": JSON}
    if key is not None:
        headers["Idempotency-Key"] = key
    return caller.session.post(f"{base_url}/v2/models/{model}", data=json.dumps(body),
                               headers=caller.headers(headers, bearer=bearer), timeout=timeout)


def _retry_after(response: requests.Response) -> int:
    raw = response.headers.get("Retry-After")
    assert raw is not None and raw.isdigit(), f"Retry-After is not whole seconds: {raw!r}"
    assert int(raw) >= 1, raw
    return int(raw)


@pytest.fixture
def client(comfy_env: ApiClient) -> Iterator[Comfy]:
    with Comfy() as made:
        yield made


@pytest.fixture(scope="module")
def deadline_door(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A second gunicorn with SYNC_DEADLINE_SECONDS=3 on the session stack's Redis, worker and stub."""
    with stack.second_door(tmp_path_factory.mktemp("deadline-door"), SYNC_DEADLINE_SECONDS=f"{DEADLINE_S:g}") as door:
        yield door


@pytest.fixture(scope="module")
def api_document(stack) -> dict[str, Any]:
    response = requests.get(f"{stack.base_url}/v2/openapi.json", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


# -- comfy-sdk models.run on the synchronous route ----------------------------------------


def test_sdk_run_flux_returns_the_native_json(client: Comfy, stub: Stub) -> None:
    body = _body_for(FLUX, unique_prompt("sdk run flux"))

    result = client.models.run(FLUX, body)

    assert isinstance(result, dict)
    assert result["status"] == "Ready"
    assert result["result"]["prompt"] == body["prompt"]
    assert result["result"]["sample"].startswith("http")
    assert stub.submits("bfl_submit", body) == 1


def test_sdk_run_gemini_returns_the_native_json(client: Comfy, stub: Stub) -> None:
    body = _body_for(GEMINI, unique_prompt("sdk run gemini"))

    result = client.models.run(GEMINI, body)

    assert isinstance(result, dict)
    inline = result["candidates"][0]["content"]["parts"][0]["inlineData"]
    assert inline["mimeType"] == "image/png"
    assert stub.calls()["total"].get("vertex_generate", 0) >= 1


def test_sdk_run_tts_returns_binary_audio(client: Comfy, stub: Stub) -> None:
    body = _body_for(TTS, unique_prompt("sdk run speech"))
    upstream = {**TTS_UPSTREAM, **body}

    result = client.models.run(TTS, body)

    assert isinstance(result, BinaryResult)
    assert result.content_type == "audio/mpeg"
    assert result.content.startswith(b"ID3")
    assert stub.submits("openai_speech", upstream) == 1
    direct = requests.post(f"{stub.base_url}/v1/audio/speech", data=json.dumps(upstream),
                           headers={"Authorization": "Bearer stub", "Content-Type": JSON}, timeout=10)
    assert result.content == direct.content


# -- the synchronous output is the queued result, byte for byte -------------------------------


@pytest.mark.parametrize(("model", "extra", "media_type"), [
    (FLUX, {}, JSON),
    (GEMINI, {}, JSON),
    (TTS, {}, "audio/mpeg"),
    (TTS, {"response_format": "wav"}, "audio/wav"),
], ids=["flux-json", "gemini-json", "tts-mp3", "tts-wav"])
def test_sync_output_is_the_queued_result_byte_for_byte(caller: ApiClient, stack, model: str, extra: dict,
                                                        media_type: str) -> None:
    body = _body_for(model, unique_prompt("bytes sync vs queued"), **extra)

    sync = _sync_post(caller, stack.base_url, model, body, key=f"sync-{uuid.uuid4().hex}")
    assert sync.status_code == 200, (sync.status_code, sync.text)
    request_id = caller.submit_ok(model, body, headers={"Idempotency-Key": f"queued-{uuid.uuid4().hex}"})
    caller.wait_status(model, request_id)
    queued = caller.result(model, request_id)

    assert queued.status_code == 200, (queued.status_code, queued.text)
    assert sync.headers["Content-Type"] == queued.headers["Content-Type"]
    assert sync.headers["Content-Type"].split(";")[0] == media_type
    assert sync.content == queued.content
    assert len(sync.content) > 0
    # two generations, not a replay of one another
    assert sync.headers["X-Comfy-Request-Id"] != request_id
    if media_type == JSON:
        json.loads(sync.content)


@pytest.mark.parametrize(("model", "directive", "status", "bucket"), [
    (FLUX, "[stub:refuse]", 400, "content_policy_violation"),
    (FLUX, "[stub:status=500]", 502, "provider_error"),
    (GEMINI, "[stub:reject]", 422, "invalid_input"),
    (TTS, "[stub:refuse]", 400, "content_policy_violation"),
])
def test_sync_failure_is_the_queued_failure(caller: ApiClient, stack, model: str, directive: str, status: int,
                                            bucket: str) -> None:
    body = _body_for(model, unique_prompt("failure sync vs queued", directive))

    request_id = caller.submit_ok(model, body)  # first, so the two run side by side (retries take seconds)
    sync = _sync_post(caller, stack.base_url, model, body)
    caller.wait_status(model, request_id)
    queued = caller.result(model, request_id)

    for answer in (sync, queued):
        assert answer.status_code == status, (answer.status_code, answer.text)
        assert answer.headers.get("X-Comfy-Error-Type") == bucket
        assert answer.json()["error_type"] == bucket
        assert answer.headers.get("X-Comfy-Request-Id")


def test_sync_route_serves_a_workspace_without_queued_delivery(disabled_caller: ApiClient, stack) -> None:
    body = _body_for(FLUX, unique_prompt("sync without queue"))

    refused = disabled_caller.submit(FLUX, body)
    answer = _sync_post(disabled_caller, stack.base_url, FLUX, body, bearer=True)

    assert refused.status_code == 403 and refused.headers.get("X-Comfy-Error-Type") == "not_enabled"
    assert answer.status_code == 200, (answer.status_code, answer.text)
    assert answer.json()["status"] == "Ready"


def test_sync_route_refusals(caller: ApiClient, stack) -> None:
    base = stack.base_url
    body = _body_for(FLUX, unique_prompt("sync refusals"))
    cases = [
        (requests.post(f"{base}/v2/models/{FLUX}", json=body, timeout=10), 401, "unauthorized"),
        (_sync_post(caller, base, "bfl/no-such-model", body), 404, "model_not_found"),
        (_sync_post(caller, base, FLUX, {"prompt": ""}), 422, "invalid_input"),
        (caller.session.post(f"{base}/v2/models/{FLUX}", data=b"[1, 2]", timeout=10,
                             headers=caller.headers({"Content-Type": JSON})), 400, "invalid_input"),
    ]
    for answer, status, bucket in cases:
        assert answer.status_code == status, (answer.request.url, answer.status_code, answer.text)
        assert answer.headers.get("X-Comfy-Error-Type") == bucket, answer.text
        assert answer.json()["error_type"] == bucket
    assert isinstance(cases[2][0].json()["detail"], list)
    # one key, two bodies: the second is refused
    key = f"sync-conflict-{uuid.uuid4().hex}"
    assert _sync_post(caller, base, FLUX, body, key=key).status_code == 200
    other = _sync_post(caller, base, FLUX, {"prompt": body["prompt"] + " again"}, key=key)
    assert other.status_code == 409 and other.headers.get("X-Comfy-Error-Type") == "invalid_input", other.text


# -- the deadline: 504, the same key re-attaches, one submit, one charge -------------------------


def test_deadline_504_then_the_same_key_reattaches(deadline_door: RunningStack, caller: ApiClient, stub: Stub,
                                                   services) -> None:
    body = _body_for(FLUX, unique_prompt("sync deadline", "[stub:latency=6]"))
    key = f"deadline-{uuid.uuid4().hex}"

    began = time.monotonic()
    first = _sync_post(caller, deadline_door.base_url, FLUX, body, key=key,
                       timeout=(5, DEADLINE_S + DEADLINE_SLACK_S + 1))
    elapsed = time.monotonic() - began

    assert first.status_code == 504, (first.status_code, first.text)
    assert first.headers.get("X-Comfy-Error-Type") == "deadline_exceeded"
    assert first.json()["error_type"] == "deadline_exceeded"
    pause = _retry_after(first)
    assert HOLD_S - 0.3 <= elapsed <= HOLD_S + DEADLINE_SLACK_S, \
        f"the 504 came after {elapsed:.2f} s; the front door holds {HOLD_S:.2f} s of a {DEADLINE_S:g} s deadline"
    request_id = first.headers["X-Comfy-Request-Id"]

    answers = [first.status_code]
    final = first
    give_up = time.monotonic() + 30
    while final.status_code == 504:
        assert time.monotonic() < give_up, f"no 200 within 30 s; answers {answers}"
        time.sleep(pause)
        final = _sync_post(caller, deadline_door.base_url, FLUX, body, key=key)
        answers.append(final.status_code)
        assert final.headers["X-Comfy-Request-Id"] == request_id, "the same key attached to another request"
        if final.status_code == 504:
            assert final.headers.get("X-Comfy-Error-Type") == "deadline_exceeded", final.text
            pause = _retry_after(final)

    assert final.status_code == 200, (answers, final.text)
    assert final.headers["Content-Type"] == JSON
    output = final.json()
    assert output["status"] == "Ready" and output["result"]["prompt"] == body["prompt"]
    assert stub.submits("bfl_submit", body) == 1, "the re-attach submitted the generation again"
    ledger = wait_for(lambda: (found := ledger_by_request(services, caller.workspace)).get(request_id)
                      == ["hold", "charge"] and found, timeout_s=10, what="one hold and one charge")
    assert ledger == {request_id: ["hold", "charge"]}, ledger
    # once finished, the same key still answers the same output, at once
    again = _sync_post(caller, deadline_door.base_url, FLUX, body, key=key, timeout=(5, 5))
    assert again.status_code == 200 and again.content == final.content
    assert stub.submits("bfl_submit", body) == 1
    assert ledger_by_request(services, caller.workspace) == {request_id: ["hold", "charge"]}


def test_sdk_run_collects_a_long_generation_through_the_deadline(deadline_door: RunningStack, caller: ApiClient,
                                                                stub: Stub, services,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFY_ROUTER_BASE_URL", deadline_door.base_url)
    monkeypatch.setenv("COMFY_API_KEY", caller.api_key)
    monkeypatch.delenv("COMFY_BASE_URL", raising=False)
    route = f"/v2/models/{FLUX}"
    timeouts_before = deadline_door.access_lines("POST", route, 504)
    body = _body_for(FLUX, unique_prompt("sdk through the deadline", "[stub:latency=8]"))

    began = time.monotonic()
    with Comfy() as client:
        result = client.models.run(FLUX, body)
    elapsed = time.monotonic() - began

    assert isinstance(result, dict)
    assert result["status"] == "Ready" and result["result"]["prompt"] == body["prompt"]
    assert elapsed >= 8 - 0.5, f"a generation of 8 s answered after {elapsed:.2f} s"
    # the SDK met at least one 504 deadline_exceeded and retried it with the same key
    assert wait_for(lambda: deadline_door.access_lines("POST", route, 504) > timeouts_before,
                    timeout_s=5, what="a 504 in the deadline door's access log")
    assert stub.submits("bfl_submit", body) == 1, "the SDK's same-key retry submitted the generation again"
    ledger = wait_for(lambda: (found := ledger_by_request(services, caller.workspace)) and
                      all(types == ["hold", "charge"] for types in found.values()) and found,
                      timeout_s=10, what="one hold and one charge")
    assert len(ledger) == 1, f"the SDK's retries made more than one request: {ledger}"


# -- discovery through the SDK --------------------------------------------------------------


def test_models_list_walks_every_page(client: Comfy, services) -> None:
    catalog_ids = services.catalog.ids()

    walked = [entry.id for entry in client.models.list(limit=1)]

    assert walked == sorted(catalog_ids)
    first = client.models.list(limit=1).page()
    assert first.limit == 1 and len(first.data) == 1
    assert first.has_more is True and isinstance(first.next_cursor, str) and first.next_cursor
    # by hand, page after page, to the last one
    pages, cursor = [first], first.next_cursor
    while cursor is not None:
        page = client.models.list(limit=1, cursor=cursor).page()
        pages.append(page)
        cursor = page.next_cursor
    assert [p.data[0].id for p in pages] == walked
    assert pages[-1].has_more is False and pages[-1].next_cursor is None
    for entry in client.models.list():
        assert entry.id == f"{entry.provider}/{entry.model}"
        assert "charges_on_policy_rejection" in entry.billing


def test_models_list_clamps_a_large_limit_to_100(client: Comfy, services) -> None:
    page = client.models.list(limit=500).page()

    assert page.limit == 100
    assert [entry.id for entry in page.data] == sorted(services.catalog.ids())
    assert page.has_more is False and page.next_cursor is None


@pytest.mark.parametrize(("model", "required"), [
    (FLUX, {"prompt"}), (GEMINI, {"contents"}), (TTS, {"input", "voice"}),
])
def test_models_schema_and_its_etag(client: Comfy, api_document: dict, model: str, required: set) -> None:
    first = client.models.schema(model)

    assert first.unchanged is False
    document = first.document
    assert isinstance(document, dict) and document["openapi"].startswith("3.")
    path = f"/v2/models/{model}"
    schema = request_body_schema(document, path)
    assert required <= set(schema.get("required", [])), schema
    assert schema == request_body_schema(api_document, path), "the model's document and the API's disagree"
    assert first.etag and first.etag.startswith('"')

    second = client.models.schema(model, etag=first.etag)

    assert second.unchanged is True and second.document is None
    assert second.etag == first.etag


def test_models_schema_of_an_unknown_model_is_model_not_found(client: Comfy) -> None:
    with pytest.raises(ModelNotFound):
        client.models.schema("bfl/no-such-model")


# -- the API's own document and the docs page ----------------------------------------------------


def test_openapi_document_is_valid_openapi_3(stack, api_document: dict, services) -> None:
    from openapi_spec_validator import validate

    validate(api_document)
    assert api_document["openapi"].startswith("3.")
    for model_id in services.catalog.ids():
        operation = api_document["paths"][f"/v2/models/{model_id}"]["post"]
        assert "200" in operation["responses"] and "504" in operation["responses"]
        assert request_body_schema(api_document, f"/v2/models/{model_id}")
    assert "/v2/models" in api_document["paths"]
    assert "/v2/models/{provider}/{model}/openapi.json" in api_document["paths"]
    # ETag and a conditional read
    response = requests.get(f"{stack.base_url}/v2/openapi.json", timeout=10)
    assert response.headers["Content-Type"].startswith(JSON) and response.headers.get("ETag")
    again = requests.get(f"{stack.base_url}/v2/openapi.json", headers={"If-None-Match": response.headers["ETag"]},
                         timeout=10)
    assert again.status_code == 304 and again.content == b""


def test_docs_page_renders_every_model_and_reaches_nothing_outside(stack, services) -> None:
    response = requests.get(f"{stack.base_url}/v2/docs", timeout=10)

    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/html")
    page = response.text
    assert "<html" in page.lower()
    for model_id in services.catalog.ids():
        assert model_id in page, f"{model_id} is not on the docs page"
    host = stack.base_url
    # a URL names a host; a schema pattern such as fileUri's ^https://[^\s/] does not
    outside = [url for url in re.findall(r"https?://[A-Za-z0-9][^\s\"'<>)]*", page) if not url.startswith(host)]
    assert not outside, f"the docs page names outside URLs: {outside[:5]}"
    # nor protocol-relative or attribute references to another host
    refs = re.findall(r"""(?:src|href|action)\s*=\s*["']?([^"'\s>]+)""", page, flags=re.IGNORECASE)
    refs += re.findall(r"""url\(\s*["']?([^"')\s]+)""", page) + re.findall(r"""@import\s+["']([^"']+)""", page)
    foreign = [ref for ref in refs if ref.startswith("//") or (re.match(r"^[a-z][a-z0-9+.-]*:", ref, re.I)
                                                               and not ref.startswith(host)
                                                               and not ref.startswith(("data:", "#")))]
    assert not foreign, f"the docs page references: {foreign[:5]}"


# -- what the document promises the routes keep --------------------------------------------------


def test_tts_wav_output_content_type_is_documented(stack, caller: ApiClient, api_document: dict) -> None:
    body = _body_for(TTS, unique_prompt("documented media type"), response_format="wav")
    response = _sync_post(caller, stack.base_url, TTS, body)
    if response.status_code != 200 or response.headers["Content-Type"] != "audio/wav":
        pytest.fail(f"precondition: expected 200 audio/wav, got {response.status_code} "
                    f"{response.headers.get('Content-Type')}")

    for path, method in ((f"/v2/models/{TTS}", "post"), (f"/v2/models/{TTS}/requests/{{request_id}}", "get")):
        documented = documented_media_types(api_document, path, method, "200")
        assert "audio/wav" in documented, f"{method.upper()} {path} 200 documents {sorted(documented)}"


def test_replayed_submit_answer_matches_the_documented_handle(caller: ApiClient, api_document: dict) -> None:
    body = _body_for(FLUX, unique_prompt("replayed handle"))
    key = f"replay-{uuid.uuid4().hex}"
    request_id = caller.submit_ok(FLUX, body, headers={"Idempotency-Key": key})
    caller.wait_status(FLUX, request_id)
    replay = caller.submit(FLUX, body, headers={"Idempotency-Key": key})
    if replay.status_code != 201 or replay.headers.get("Idempotent-Replayed") != "true":
        pytest.fail(f"precondition: expected a replayed 201, got {replay.status_code} {replay.text}")

    operation = api_document["paths"][f"/v2/models/{FLUX}/requests"]["post"]
    schema = resolve(api_document, operation["responses"]["201"]["content"][JSON]["schema"])
    undocumented = set(replay.json()) - set(schema["properties"])
    assert schema.get("additionalProperties", True) is not False or not undocumented, \
        f"the replayed 201 carries fields its schema forbids: {sorted(undocumented)}"
