"""An object store that is slow or away loses no paid output (issue 33, item 5).

The worker tries the put with backoff while it holds its lease; past
OBJECT_STORE_PUT_WINDOW_SECONDS the output is kept in Redis within the
fallback budget, and the sweeper moves it to the store when it returns; with
the budget full too, the request stays IN_PROGRESS, charged nothing, until one
store takes it. Time is a fake clock: a wait advances it and lets the test act.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import pytest

from router_queue import metrics
from router_queue.blobs import pointers
from router_queue.blobs.store import BlobUnavailable, open_blob_store
from router_queue.states import COMPLETED, IN_PROGRESS
from router_queue.store import keys
from router_queue.store.fallback import FallbackResults, share
from router_queue.web.app import create_app
from tests.unit import delivery_support
from tests.unit.delivery_support import admitted, deliver_until_done
from tests.unit.support import context_of
from workers import outputs
from workers.result_moves import move_fallback_results

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

GEMINI = "vertexai/gemini-3.1-flash-image"
TWO_MB = 2_000_000
WINDOW_S = 300.0


class Flaky:
    """A real directory store that can be made to fail every call, as one away does."""

    def __init__(self, real):
        self.real = real
        self.away = False
        self.puts = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _check(self, what: str) -> None:
        if self.away:
            raise BlobUnavailable(f"{what}: connection refused")

    def put(self, key, data, content_type):
        self.puts += 1
        self._check(f"put {key}")
        self.real.put(key, data, content_type)

    def read(self, key, start, end):
        self._check(f"get {key}")
        return self.real.read(key, start, end)


class FakeClock(outputs.Clock):
    """Time that moves only when the put loop waits; ``on_wait`` runs at each wait."""

    def __init__(self, on_wait: Callable[["FakeClock"], None] = lambda clock: None):
        self.at = 1000.0
        self.waits: list[float] = []
        self.on_wait = on_wait

    def now(self) -> float:  # type: ignore[override]
        return self.at

    def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.waits.append(seconds)
        self.at += seconds
        self.on_wait(self)


@pytest.fixture
def faulty(worker_services, tmp_path):
    """The worker's services with a directory store that the test can take away."""
    worker_services.blobs = Flaky(open_blob_store(f"file://{tmp_path}/objects"))
    worker_services.settings = dataclasses.replace(worker_services.settings, object_store_put_window_s=WINDOW_S)
    return worker_services


@pytest.fixture
def http(faulty):
    return create_app(faulty.settings, services=faulty).test_client()


def with_clock(monkeypatch, clock: FakeClock) -> FakeClock:
    monkeypatch.setattr(outputs, "CLOCK", clock)
    return clock


def deliver_big(services, workspace, text: str) -> str:
    request_id, _ = admitted(services, workspace, GEMINI, {"contents": [{"parts": [{"text": f"{text} [stub:size={TWO_MB}]"}]}]})
    assert deliver_until_done(context_of(services), request_id) == "completed"
    return request_id


def url_of(request_id: str) -> str:
    return f"/v2/models/{GEMINI}/requests/{request_id}"


def charged(services, request_id: str) -> str | None:
    """The record's cost state: "charged" once settled, None while held."""
    value = services.redis.hget(keys.request(request_id), "cost_state")
    return value.decode() if value else None


def object_count(services) -> int:
    return len(services.blobs.keys_under(pointers.RESULTS))


def counted(event: str) -> float:
    return metrics.REGISTRY.get_sample_value("router_queue_result_objects_total", {"event": event}) or 0.0


def test_a_put_the_store_refuses_is_tried_again_with_backoff_and_lands_there(faulty, workspace, monkeypatch):
    faulty.blobs.away = True

    def back_after_three(clock: FakeClock) -> None:
        faulty.blobs.away = len(clock.waits) < 3

    clock = with_clock(monkeypatch, FakeClock(back_after_three))
    request_id = deliver_big(faulty, workspace, "a store that blinks")
    assert clock.waits == [0.5, 1.0, 2.0]  # capped exponential backoff, never giving up inside the window
    pointer = faulty.store.result(request_id)
    assert isinstance(pointer, pointers.ResultPointer) and faulty.redis.get(keys.result(request_id)) is None
    assert faulty.redis.zcard(keys.fallback_results("vertexai")) == 0


def test_past_the_window_the_output_is_kept_in_redis_and_collects_byte_for_byte(faulty, workspace, monkeypatch,
                                                                              http, auth):
    faulty.blobs.away = True
    clock = with_clock(monkeypatch, FakeClock())
    before = counted("fallback")
    request_id = deliver_big(faulty, workspace, "kept in redis")
    assert clock.at - 1000.0 >= WINDOW_S and clock.at - 1000.0 < WINDOW_S + 10  # the window, then no longer
    assert counted("fallback") == before + 1
    record = faulty.store.status_view(request_id, "vertexai").record
    assert record.status == COMPLETED and charged(faulty, request_id) == "charged"
    inline = faulty.redis.get(keys.result(request_id))
    assert len(inline) > TWO_MB
    assert faulty.redis.zrange(keys.fallback_results("vertexai"), 0, -1, withscores=True) \
        == [(request_id.encode(), float(len(inline)))]
    assert FallbackResults(faulty.redis).held_bytes("vertexai") == len(inline)
    answer = http.get(url_of(request_id), headers=auth)
    assert answer.status_code == 200 and answer.get_data() == inline
    assert answer.headers["ETag"] == f'"sha256:{hashlib.sha256(inline).hexdigest()}"'


def test_with_the_fallback_full_the_request_stays_in_progress_uncharged_until_a_store_takes_it(
        faulty, workspace, monkeypatch):
    providers = len(faulty.catalog.providers())
    faulty.settings = dataclasses.replace(faulty.settings, object_store_fallback_max_bytes=providers * TWO_MB)
    assert share(faulty.settings.object_store_fallback_max_bytes, providers) < TWO_MB + 100  # the output is bigger
    faulty.blobs.away = True
    seen: list[tuple[str, str | None]] = []

    def watch(clock: FakeClock) -> None:
        record = faulty.store.status_view(request_id, "vertexai").record
        seen.append((record.status, charged(faulty, request_id)))
        faulty.blobs.away = clock.at - 1000.0 < 2 * WINDOW_S  # back after twice the window

    clock = with_clock(monkeypatch, FakeClock(watch))
    before = counted("fallback_full")
    request_id, _ = admitted(faulty, workspace, GEMINI,
                             {"contents": [{"parts": [{"text": f"nowhere to go [stub:size={TWO_MB}]"}]}]})
    assert deliver_until_done(context_of(faulty), request_id) == "completed"
    assert clock.at - 1000.0 >= 2 * WINDOW_S
    assert set(seen) == {(IN_PROGRESS, None)}  # never completed without its output, never charged meanwhile
    assert counted("fallback_full") > before
    pointer = faulty.store.result(request_id)
    assert isinstance(pointer, pointers.ResultPointer)  # the store came back and took it
    assert faulty.redis.get(keys.fallback_bytes("vertexai")) is None
    assert charged(faulty, request_id) == "charged"


def test_the_sweeper_moves_a_kept_result_to_the_store_once_it_answers(faulty, workspace, monkeypatch, http, auth):
    faulty.blobs.away = True
    with_clock(monkeypatch, FakeClock())
    request_id = deliver_big(faulty, workspace, "move me later")
    inline = faulty.redis.get(keys.result(request_id))
    context = context_of(faulty)
    assert move_fallback_results(context, now=2000.0) == 0  # still away: nothing moves, the pass pauses
    assert faulty.redis.exists(keys.fallback_pause("vertexai"))
    puts = faulty.blobs.puts
    faulty.blobs.away = False
    assert move_fallback_results(context, now=2001.0) == 0 and faulty.blobs.puts == puts  # paused: not tried
    faulty.redis.delete(keys.fallback_pause("vertexai"))
    before = counted("moved")
    assert move_fallback_results(context, now=2002.0) == 1
    assert counted("moved") == before + 1
    pointer = faulty.store.result(request_id)
    assert isinstance(pointer, pointers.ResultPointer) and pointer.size == len(inline)
    assert faulty.blobs.read_all(pointer.key) == inline
    assert faulty.redis.get(keys.result(request_id)) is None  # the inline copy is gone ...
    assert faulty.redis.zcard(keys.fallback_results("vertexai")) == 0
    assert faulty.redis.get(keys.fallback_bytes("vertexai")) is None  # ... and its budget given back
    assert [m.decode() for m in faulty.redis.zrange(keys.result_objects("vertexai"), 0, -1)] \
        == [f"{request_id} {pointer.key}"]  # deleted with its record
    answer = http.get(url_of(request_id), headers=auth)
    assert answer.status_code == 200 and answer.get_data() == inline
    assert move_fallback_results(context, now=2003.0) == 0 and object_count(faulty) == 1


def test_a_kept_result_that_expired_before_the_store_returned_gives_its_bytes_back(faulty, workspace,
                                                                                   monkeypatch):
    faulty.blobs.away = True
    with_clock(monkeypatch, FakeClock())
    request_id = deliver_big(faulty, workspace, "expires in redis")
    faulty.redis.delete(keys.result(request_id))  # its retention ran out
    faulty.blobs.away = False
    assert move_fallback_results(context_of(faulty), now=2000.0) == 0
    assert faulty.redis.zcard(keys.fallback_results("vertexai")) == 0
    assert faulty.redis.get(keys.fallback_bytes("vertexai")) is None
    assert object_count(faulty) == 0


def test_the_swap_takes_only_a_record_that_still_holds_its_inline_result(faulty, workspace, monkeypatch):
    faulty.blobs.away = True
    with_clock(monkeypatch, FakeClock())
    request_id = deliver_big(faulty, workspace, "swap once")
    inline = faulty.redis.get(keys.result(request_id))
    fallback = FallbackResults(faulty.redis)
    wrong = pointers.ResultPointer.of("results/x/wrong", inline + b"!", "application/json")
    assert fallback.move("vertexai", request_id, wrong, 2000.0) == "CHANGED"
    assert faulty.redis.get(keys.result(request_id)) == inline and fallback.held_bytes("vertexai") == len(inline)
    assert fallback.move("vertexai", request_id, None, 2000.0) == "HELD"  # alive: not forgotten
    right = pointers.ResultPointer.of("results/x/right", inline, "application/json")
    assert fallback.move("vertexai", request_id, right, 2000.0) == "MOVED"
    assert fallback.move("vertexai", request_id, right, 2000.0) == "NOT_WAITING"  # a second sweeper's
    assert faulty.store.result(request_id) == dataclasses.replace(right, content_type="application/json")


def test_a_collect_while_the_store_is_away_answers_503_with_retry_after(faulty, workspace, http, auth):
    request_id = deliver_big(faulty, workspace, "stored, then the store goes")
    faulty.blobs.away = True
    for headers in (auth, {**auth, "Range": "bytes=0-99"}):
        answer = http.get(url_of(request_id), headers=headers)
        assert answer.status_code == 503, answer.get_data()[:200]
        assert answer.headers["Retry-After"] == "5"
        assert answer.headers["X-Comfy-Error-Type"] == "service_unavailable"
    assert http.get(f"{url_of(request_id)}/status", headers=auth).get_json()["status"] == COMPLETED
    faulty.blobs.away = False
    assert http.get(url_of(request_id), headers=auth).status_code == 200
