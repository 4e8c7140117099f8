"""The event stream, in process: frames, their ids, resuming, the end."""

from __future__ import annotations

import threading
import time

import pytest

from router_queue.store.requests_values import Lease
from router_queue.web import stream
from tests.unit.support import frames, record_of

FLUX = "/v2/models/bfl/flux-2-pro"
LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)


def submit(http, auth) -> str:
    response = http.post(f"{FLUX}/requests", json={"prompt": "stream me"}, headers=auth)
    assert response.status_code == 201, response.json
    return response.json["request_id"]


def test_a_finished_request_streams_one_completed_event_and_ends(http, auth, services):
    request_id = submit(http, auth)
    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    response = http.get(f"{FLUX}/requests/{request_id}/events", headers=auth)
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    got = frames(response)
    assert [(f["event"], f["id"]) for f in got] == [("completed", "COMPLETED:success")]
    assert got[0]["data"]["status"] == "COMPLETED" and "error_type" not in got[0]["data"]


def test_a_resumed_stream_sends_only_what_the_client_has_not_seen(http, auth, services):
    request_id = submit(http, auth)
    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    services.store.complete(record_of(services, request_id, "bfl"), error_type="provider_error",
                            detail="it broke")
    url = f"{FLUX}/requests/{request_id}/events"
    seen = frames(http.get(url, headers={**auth, "Last-Event-ID": "COMPLETED:provider_error"}))
    assert seen == []
    fresh = frames(http.get(url, headers={**auth, "Last-Event-ID": "IN_PROGRESS:0.5"}))
    assert [(f["event"], f["data"]["error_type"]) for f in fresh] == [("completed", "provider_error")]


@pytest.mark.parametrize("headers,status", [({}, 401), ({"X-API-Key": "rq_nope"}, 401)])
def test_a_stream_is_authorized_like_a_status_read(http, auth, headers, status):
    request_id = submit(http, auth)
    assert http.get(f"{FLUX}/requests/{request_id}/events", headers=headers).status_code == status


def test_an_unknown_request_is_404_before_any_stream(http, auth):
    response = http.get(f"{FLUX}/requests/00000000-0000-9000-8000-000000000001/events", headers=auth)
    assert response.status_code == 404
    assert response.json["error_type"] == "request_not_found"


def test_each_change_is_one_event_in_order_until_completed(http, auth, services, monkeypatch):
    if type(services.redis).__module__.startswith("fakeredis"):
        pytest.skip("fakeredis blocks every thread while one waits on pub/sub; this needs a real Redis")
    monkeypatch.setattr(stream, "POSITION_REFRESH_S", 0.0)
    ahead = submit(http, auth)
    services.store.max_in_flight = lambda provider: 1  # ahead holds the one slot
    request_id = submit(http, auth)
    response = http.get(f"{FLUX}/requests/{request_id}/events", headers=auth)
    got: list[dict] = []
    reader = threading.Thread(target=frames, args=(response,), kwargs={"out": got}, daemon=True)
    reader.start()

    def until(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(got) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(got) >= count, got

    until(1)
    services.store.claim(record_of(services, ahead, "bfl"), LEASE)
    services.store.complete(record_of(services, ahead, "bfl"), output=b"{}", content_type="application/json")
    until(2)
    services.store.claim(record_of(services, request_id, "bfl"), Lease("u", 30, 3600, 3))
    until(3)
    services.store.record_progress(request_id, "u", 0.5)
    until(4)
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    reader.join(10)
    assert not reader.is_alive(), "the stream did not end after COMPLETED"
    names = [f["event"] for f in got]
    assert names[0] == "in_queue" and got[0]["data"]["queue_position"] == 1
    assert names[-3:] == ["in_progress", "progress", "completed"], names
    assert "queue_position" in names[1:-3] or got[1]["data"]["queue_position"] == 0, got
    assert got[-2]["data"]["progress"] == 0.5 and got[-1]["data"]["progress"] == 1.0
    assert len({f["id"] for f in got}) == len(got)


class _ScriptedStore:
    """Answers each status read with the next view, and remembers where it was asked to read."""

    def __init__(self, views):
        self.views, self.asked = list(views), []

    def status_view(self, request_id, provider, rate=None, *, replica=False):
        self.asked.append(replica)
        return self.views.pop(0)


class _Waking:
    """A hub whose follower wakes at once, with its own change or a queue move, as scripted."""

    def __init__(self, changes):
        self.changes = list(changes)

    def follow(self, request_id, provider, key=None):
        hub = self

        class Follower:
            changed = False

            def wait(self, timeout):
                self.changed = hub.changes.pop(0)
                return True
        return Follower()

    def unfollow(self, follower):
        pass


def test_a_stream_reads_positions_on_the_replica_and_its_own_changes_on_the_primary():
    """Its queue's moves are read on the read replica (REDIS_READ_URL); its own
    changes on the primary that announced them, so a lagging replica never
    shows it a status earlier than one it has shown."""
    from router_queue.store.record import RequestRecord
    from router_queue.store.requests_values import Pace, StatusView

    def view(status: str, position: int | None = None) -> StatusView:
        record = RequestRecord("r", "ws", "bfl/flux-2-pro", "bfl", status, created_at=1.0)
        return StatusView(record, position, Pace(None, None))

    store = _ScriptedStore([view("IN_QUEUE", 1), view("IN_PROGRESS"), view("COMPLETED")])
    frames_ = list(stream.stream(store, _Waking([False, True, True]), view("IN_QUEUE", 2), base="http://x",
                                 retention_s=60, last_event_id=None))
    events = [f.split("\n")[1] for f in frames_ if f.startswith("id:")]
    assert events == ["event: in_queue", "event: queue_position", "event: in_progress", "event: completed"]
    assert store.asked == [True, False, False]  # its queue moved (replica), then its own changes (primary)
