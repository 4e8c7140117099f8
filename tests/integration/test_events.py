"""Progress and the event stream against real processes: gunicorn's gevent
workers hold the stream, a real HTTP client reads text/event-stream, and the
published comfy-sdk keeps working with the new status field."""

from __future__ import annotations

import json
from typing import Iterator

import requests
from comfy_sdk import Comfy

from .harness import FLUX, ApiClient, unique_prompt, wait_for

#: Seconds a stream may take to deliver everything here (generations take 2-3 s).
STREAM_TIMEOUT_S = 30.0


def _events(response: requests.Response) -> Iterator[dict]:
    """Each event of a text/event-stream as {id, event, data}, until the server ends it."""
    current: dict = {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if "event" in current:
                yield current
            current = {}
        elif line.startswith(":"):
            current.setdefault("comments", []).append(line)
        else:
            field, _, value = line.partition(": ")
            current[field] = json.loads(value) if field == "data" else value


def _stream(caller: ApiClient, request_id: str, last_event_id: str | None = None) -> requests.Response:
    headers = caller.headers({"Accept": "text/event-stream", **({"Last-Event-ID": last_event_id}
                                                                 if last_event_id else {})})
    response = requests.get(caller.url(FLUX, request_id, "/events"), headers=headers, stream=True,
                            timeout=STREAM_TIMEOUT_S)
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return response


def test_a_stream_follows_a_generation_to_its_end_one_event_per_change(caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("streamed", "[stub:latency=2.5]")})
    with _stream(caller, request_id) as response:
        got = list(_events(response))  # the server ends the stream after COMPLETED
    names = [e["event"] for e in got]
    assert names[-1] == "completed" and got[-1]["data"]["status"] == "COMPLETED", names
    assert "error_type" not in got[-1]["data"] and got[-1]["data"]["progress"] == 1.0
    assert "in_progress" in names and names.count("completed") == 1
    progress = [e["data"]["progress"] for e in got if e["event"] == "progress"]
    assert len(progress) >= 2 and progress == sorted(progress) and 0 <= progress[0] < progress[-1] < 1, got
    assert len({e["id"] for e in got}) == len(got)  # one event per change, none repeated
    ranks = [{"in_queue": 0, "queue_position": 0, "in_progress": 1, "progress": 1, "completed": 2}[n] for n in names]
    assert ranks == sorted(ranks), names


def test_a_client_that_reconnects_with_last_event_id_gets_only_what_it_missed(caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("resumed", "[stub:latency=2.5]")})
    with _stream(caller, request_id) as response:
        first = []
        for event in _events(response):
            first.append(event)
            if event["event"] == "progress":
                break  # the client goes away mid-generation
    last = first[-1]["id"]
    with _stream(caller, request_id, last_event_id=last) as response:
        rest = list(_events(response))
    assert rest and last not in {e["id"] for e in rest}, (first, rest)
    assert rest[-1]["event"] == "completed"
    seen = [e["id"] for e in first + rest]
    assert len(set(seen)) == len(seen)
    # once it ended, resuming from its last event sends nothing and ends at once
    with _stream(caller, request_id, last_event_id=rest[-1]["id"]) as response:
        assert list(_events(response)) == []


def test_a_stream_is_found_and_refused_like_a_status_read(caller: ApiClient, other_caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("not yours")})
    theirs = requests.get(other_caller.url(FLUX, request_id, "/events"), headers=other_caller.headers(), timeout=10)
    assert theirs.status_code == 404 and theirs.headers["X-Comfy-Error-Type"] == "request_not_found"
    anonymous = requests.get(caller.url(FLUX, request_id, "/events"), timeout=10)
    assert anonymous.status_code == 401


def test_comfy_sdk_ignores_the_progress_field(comfy_env: ApiClient) -> None:
    caller = comfy_env
    with Comfy() as client:
        handle = client.models.submit(FLUX, {"prompt": unique_prompt("sdk progress", "[stub:latency=2]")})
        body = wait_for(lambda: (b := caller.status_body(FLUX, handle.request_id)).get("progress") is not None
                        and b, timeout_s=STREAM_TIMEOUT_S, what="a status with progress")
        update = handle.status()  # the SDK parses a status body carrying progress
        assert update.status in ("IN_PROGRESS", "COMPLETED") and body["progress"] >= 0
        statuses = [u.status for u in handle.iter_events()]
        result = handle.get()
    assert statuses[-1] == "COMPLETED"
    assert result["status"] == "Ready"


def test_streams_refused_for_their_host_leave_the_workspaces_held_slots_free(caller: ApiClient) -> None:
    """More refused streams than the workspace's cap on held connections (100):
    each is 400 and gives its slot back, so a good stream still opens."""
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("refused hosts")})
    url = caller.url(FLUX, request_id, "/events")
    with requests.Session() as session:
        for _ in range(120):
            refused = session.get(url, headers=caller.headers({"Host": "evil.example"}), timeout=10)
            assert refused.status_code == 400, (refused.status_code, refused.text)
            assert refused.headers["X-Comfy-Error-Type"] == "invalid_input"
    with _stream(caller, request_id) as response:  # 200, not 429 held_calls_full
        assert next(_events(response))["event"] in ("in_queue", "in_progress", "completed")
