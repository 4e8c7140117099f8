"""The seed document's flows, through the published client (comfy-sdk 0.5.0), unchanged.

The client is pointed at gunicorn with ``COMFY_ROUTER_BASE_URL`` and authenticated
with ``COMFY_API_KEY`` (the ``comfy_env`` fixture); it sends
``Authorization: Bearer`` and paces its polls by the server's ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import uuid

import pytest
import requests
from comfy_sdk import AsyncComfy, BinaryResult, Comfy, QueueUpdate
from comfy_sdk.router_exceptions import (
    AlreadyCompleted,
    Cancelled,
    ContentPolicyViolation,
    InvalidInput,
    ModelNotFound,
    NotEnabled,
    ProviderError,
    RequestNotFound,
    Unauthorized,
)

from .harness import FLUX, GEMINI, TTS, ApiClient, saturated_worker, unique_prompt, wait_for

#: Client-side bound (s) on any one wait for a result; generations here take 0-2 s.
GET_TIMEOUT_S = 30.0
STATUS_ORDER = {"IN_QUEUE": 0, "IN_PROGRESS": 1, "COMPLETED": 2}


@pytest.fixture
def client(comfy_env: ApiClient):
    with Comfy() as made:
        yield made


def _assert_forward(updates: list[QueueUpdate]) -> None:
    """Statuses are known ones and never go backwards; the last is COMPLETED."""
    ranks = [STATUS_ORDER[u.status] for u in updates]
    assert ranks == sorted(ranks), [u.status for u in updates]
    assert updates[-1].status == "COMPLETED"


def _wait_completed(handle, timeout_s: float = 20.0) -> QueueUpdate:
    return wait_for(lambda: (u := handle.status()).is_completed and u, timeout_s=timeout_s,
                    interval_s=0.2, what=f"{handle!r} COMPLETED")


# -- the happy paths -----------------------------------------------------------------


def test_submit_iter_events_then_get(client: Comfy) -> None:
    handle = client.models.submit(FLUX, {"prompt": unique_prompt("iter events", "[stub:latency=1]")})
    assert handle.model == FLUX

    updates = list(handle.iter_events(timeout=GET_TIMEOUT_S))

    assert updates, "iter_events yielded nothing"
    assert all(u.request_id == handle.request_id for u in updates)
    _assert_forward(updates)
    assert updates[-1].error_type is None
    result = handle.get(timeout=GET_TIMEOUT_S)
    assert isinstance(result, dict)
    assert result["status"] == "Ready"
    assert result["result"]["sample"].startswith("http")


def test_subscribe_reports_updates_and_returns_the_result(client: Comfy) -> None:
    prompt = unique_prompt("subscribe")
    seen: list[QueueUpdate] = []

    result = client.models.subscribe(FLUX, {"prompt": prompt}, on_queue_update=seen.append,
                                     timeout=GET_TIMEOUT_S)

    assert result["result"]["prompt"] == prompt
    assert result["result"]["sample"]
    assert len(seen) >= 1
    _assert_forward(seen)


def test_subscribe_timeout_cancels_the_request(client: Comfy) -> None:
    seen: list[QueueUpdate] = []

    with pytest.raises(TimeoutError):
        client.models.subscribe(FLUX, {"prompt": unique_prompt("subscribe timeout", "[stub:latency=20]")},
                                on_queue_update=seen.append, timeout=1.5)

    assert seen, "on_queue_update was never called before the timeout"
    handle = client.models.handle(FLUX, seen[0].request_id)
    final = _wait_completed(handle)
    assert final.error_type == "cancelled"
    with pytest.raises(Cancelled):
        handle.get(timeout=GET_TIMEOUT_S)


def test_handle_rebuilt_in_another_process_gets_the_same_result(client: Comfy) -> None:
    handle = client.models.submit(FLUX, {"prompt": unique_prompt("second process")})
    script = (
        "import json, sys\n"
        "from comfy_sdk import Comfy\n"
        "with Comfy() as client:\n"
        "    print(json.dumps(client.models.handle(sys.argv[1], sys.argv[2]).get(timeout=30)))\n"
    )
    # os.environ carries COMFY_ROUTER_BASE_URL and COMFY_API_KEY (monkeypatched).
    other = subprocess.run([sys.executable, "-c", script, FLUX, handle.request_id],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr

    assert json.loads(other.stdout) == handle.get(timeout=GET_TIMEOUT_S)


def test_status_and_cancel_of_a_running_request(client: Comfy) -> None:
    handle = client.models.submit(FLUX, {"prompt": unique_prompt("cancel running", "[stub:latency=30]")})
    running = wait_for(lambda: (u := handle.status()).status == "IN_PROGRESS" and u, interval_s=0.1,
                       what="IN_PROGRESS")
    assert running.queue_position == 0
    assert running.retry_after is not None and running.retry_after >= 1

    asked = handle.cancel()

    assert asked.status == "CANCELLATION_REQUESTED"
    final = _wait_completed(handle)
    assert final.error_type == "cancelled"
    with pytest.raises(Cancelled):
        handle.get(timeout=GET_TIMEOUT_S)
    with pytest.raises(AlreadyCompleted):
        handle.cancel()


def test_status_and_cancel_of_a_queued_request(client: Comfy, comfy_env: ApiClient) -> None:
    with saturated_worker(comfy_env):
        handle = client.models.submit(FLUX, {"prompt": unique_prompt("cancel queued")})
        queued = handle.status()
        assert queued.status == "IN_QUEUE"
        assert queued.queue_position == 0

        asked = handle.cancel()

        assert asked.status == "CANCELLATION_REQUESTED"
        final = handle.status()  # a queued request is cancelled at once
        assert final.status == "COMPLETED"
        assert final.error_type == "cancelled"
    with pytest.raises(Cancelled):
        handle.get(timeout=GET_TIMEOUT_S)


def test_cancel_of_a_completed_request_is_already_completed(client: Comfy) -> None:
    handle = client.models.submit(FLUX, {"prompt": unique_prompt("cancel completed")})
    result = handle.get(timeout=GET_TIMEOUT_S)

    with pytest.raises(AlreadyCompleted) as refused:
        handle.cancel()

    assert refused.value.http_status == 409
    assert handle.get(timeout=GET_TIMEOUT_S) == result  # still collectable


def test_submit_with_the_same_idempotency_key_returns_the_same_request(client: Comfy) -> None:
    key = str(uuid.uuid4())
    body = {"prompt": unique_prompt("sdk idempotency")}

    first = client.models.submit(FLUX, body, idempotency_key=key)
    again = client.models.submit(FLUX, body, idempotency_key=key)

    assert again.request_id == first.request_id
    assert again.get(timeout=GET_TIMEOUT_S) == first.get(timeout=GET_TIMEOUT_S)
    with pytest.raises(InvalidInput) as conflict:
        client.models.submit(FLUX, {"prompt": unique_prompt("another body")}, idempotency_key=key)
    assert conflict.value.http_status == 409


def test_async_client_submit_iterate_get(comfy_env: ApiClient) -> None:
    prompt = unique_prompt("async", "[stub:latency=1]")

    async def flow():
        async with AsyncComfy() as client:
            handle = await client.models.submit(FLUX, {"prompt": prompt})
            updates = [update async for update in handle.iter_events(timeout=GET_TIMEOUT_S)]
            return updates, await handle.get(timeout=GET_TIMEOUT_S)

    updates, result = asyncio.run(flow())

    _assert_forward(updates)
    assert result["result"]["prompt"] == prompt


# -- typed errors --------------------------------------------------------------------


@pytest.mark.parametrize(("directive", "error"), [
    ("[stub:refuse]", ContentPolicyViolation),
    ("[stub:reject]", InvalidInput),
    ("[stub:status=500]", ProviderError),
])
def test_a_failed_generation_raises_its_typed_error(client: Comfy, directive: str, error: type) -> None:
    handle = client.models.submit(FLUX, {"prompt": unique_prompt("typed error", directive)})

    with pytest.raises(error) as raised:
        handle.get(timeout=GET_TIMEOUT_S)

    assert raised.value.error_type == error.error_type
    assert handle.status().error_type == error.error_type


def test_submit_when_queue_is_off_raises_not_enabled(monkeypatch: pytest.MonkeyPatch, comfy_env: ApiClient,
                                                     disabled_caller: ApiClient) -> None:
    monkeypatch.setenv("COMFY_API_KEY", disabled_caller.api_key)
    with Comfy() as client, pytest.raises(NotEnabled) as raised:
        client.models.submit(FLUX, {"prompt": unique_prompt("not enabled")})
    assert raised.value.http_status == 403


def test_wrong_key_raises_unauthorized(comfy_env: ApiClient) -> None:
    with Comfy(api_key="rq_not-a-key-we-minted") as client, pytest.raises(Unauthorized):
        client.models.submit(FLUX, {"prompt": unique_prompt("wrong key")})


def test_unknown_model_raises_model_not_found(client: Comfy) -> None:
    with pytest.raises(ModelNotFound) as raised:
        client.models.submit("bfl/flux-2-pr0", {"prompt": unique_prompt("unknown model")})
    assert raised.value.http_status == 404


@pytest.mark.parametrize("request_id", ["random-uuid4", "minted-for-another-workspace"])
def test_unknown_request_id_raises_request_not_found(client: Comfy, services, request_id: str) -> None:
    if request_id == "random-uuid4":
        request_id = str(uuid.uuid4())
    else:
        request_id = services.ids.mint("ws_somebody_else", FLUX)
    handle = client.models.handle(FLUX, request_id)

    with pytest.raises(RequestNotFound):
        handle.status()
    with pytest.raises(RequestNotFound):
        handle.get(timeout=GET_TIMEOUT_S)


@pytest.mark.parametrize(("body", "loc", "kind"), [
    ({"prompt": 5}, ("body", "prompt"), "string_type"),
    ({"width": 512}, ("body", "prompt"), "missing"),
])
def test_schema_violation_raises_invalid_input_with_field_errors(client: Comfy, body, loc, kind) -> None:
    with pytest.raises(InvalidInput) as raised:
        client.models.submit(FLUX, body)

    assert raised.value.http_status == 422
    assert [(e.loc, e.type) for e in raised.value.errors] == [(loc, kind)]


# -- other output kinds ----------------------------------------------------------------


def test_raw_bytes_model_returns_the_providers_bytes(client: Comfy, stub) -> None:
    body = {"input": unique_prompt("speak this"), "voice": "alloy"}
    # What the adapter sends upstream (workers/providers/openai_speech.py): the
    # model id's upstream model first, then the caller's body.
    upstream = {"model": "gpt-4o-mini-tts", **body}

    result = client.models.submit(TTS, body).get(timeout=GET_TIMEOUT_S)

    assert isinstance(result, BinaryResult)
    assert result.content_type == "audio/mpeg"
    assert stub.submits("openai_speech", upstream) == 1
    direct = requests.post(f"{stub.base_url}/v1/audio/speech", data=json.dumps(upstream),
                           headers={"Authorization": "Bearer stub", "Content-Type": "application/json"}, timeout=10)
    assert direct.status_code == 200
    assert result.content == direct.content
    assert result.content.startswith(b"ID3")


def test_gemini_generate_content_returns_inline_image(client: Comfy) -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": unique_prompt("a watercolour fox")}]}],
        "generationConfig": {"responseModalities": ["IMAGE"]},
    }

    result = client.models.submit(GEMINI, body).get(timeout=GET_TIMEOUT_S)

    inline = result["candidates"][0]["content"]["parts"][0]["inlineData"]
    assert inline["mimeType"] == "image/png"
    assert base64.b64decode(inline["data"]).startswith(b"\x89PNG\r\n\x1a\n")
