"""Fault injection: workers killed and stopped mid-run, provider storms of 500s,
hangs, 429s, cancels racing completions, queue timeouts and the in-flight cap.

Each fault ends with every request COMPLETED exactly once (one settlement in
the workspace's ledger) and charged at most once (the balance is the start less
the charges, nothing left held). The stacks are our own (``chaos_support``):
lease 3 s, sweeper every second, two workers, a test catalog with quick
retries; the crash tests run once on a Redis broker and once on RabbitMQ.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from router_queue.broker.celery_app import DELIVER_TASK, make_celery, queue_name
from router_queue.store import keys

from .chaos_support import (
    BROKERS,
    STATUS_ORDER,
    ChaosStack,
    StackPool,
    assert_not_running,
    assert_settled_once,
    record,
    submits,
    wait_all_completed,
)
from .harness import (
    FLUX,
    GEMINI,
    LEASE_S,
    REPUBLISH_AFTER_S,
    SWEEP_INTERVAL_S,
    TTS,
    ApiClient,
    stub_digest,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.slow

#: Seconds from a worker's death until the sweeper has handed its requests on:
#: the lease runs out, then the next sweep re-publishes.
TAKEOVER_S = LEASE_S + SWEEP_INTERVAL_S


@pytest.fixture(scope="module", params=BROKERS)
def broker(request: pytest.FixtureRequest) -> str:
    """The Celery broker of a crash test: the crash tests run on both."""
    return request.param


def _price(running: ChaosStack, model: str) -> int:
    entry = running.services.catalog.by_id(model)
    assert entry is not None
    return entry.price_credits


def _body(model: str, text: str) -> dict[str, Any]:
    if model == GEMINI:
        return {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    if model == TTS:
        return {"input": text, "voice": "alloy"}
    return {"prompt": text}


_ROUTE = {FLUX: "bfl_submit", GEMINI: "vertex_generate", TTS: "openai_speech"}


def _upstream_calls(running: ChaosStack, model: str, body: dict[str, Any]) -> int:
    """The stub's count of calls carrying ``body`` as the adapter sends it upstream."""
    if model == TTS and "model" not in body:  # the adapter names the upstream model
        body = {"model": running.services.catalog.by_id(TTS).upstream_model, **body}
    return running.stub.submits(_ROUTE[model], body)


def _upstream_refs(running: ChaosStack, request_ids: list[str]) -> bool:
    pipe = running.services.redis.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hget(keys.request(request_id), "upstream_ref")
    return all(pipe.execute())


def _assert_succeeded(caller: ApiClient, model: str, request_id: str, body: dict[str, Any]) -> None:
    response = caller.result(model, request_id)
    assert response.status_code == 200, (request_id, response.status_code, response.text[:300])
    if model == FLUX:
        assert response.json()["result"]["prompt"] == body["prompt"]


def _assert_failed(caller: ApiClient, model: str, request_id: str, status: int, bucket: str) -> None:
    response = caller.result(model, request_id)
    assert response.status_code == status, (request_id, response.status_code, response.text[:300])
    assert response.headers.get("X-Comfy-Error-Type") == bucket
    assert response.json()["error_type"] == bucket


# -- a storm of 500s ------------------------------------------------------------------------


def test_a_storm_of_500s_retries_then_succeeds_or_ends_provider_error(pool: StackPool) -> None:
    running = pool.get("redis")
    models = [FLUX, GEMINI] * 3
    with running.caller("storm") as caller:
        flaky = [(m, _body(m, unique_prompt("flaky", "[stub:fail_times=2]"))) for m in models]
        broken = [(m, _body(m, unique_prompt("broken", "[stub:status=500]"))) for m in models]
        ids = {caller.submit_ok(m, body): (m, body) for m, body in flaky + broken}
        flaky_ids = list(ids)[:len(flaky)]
        broken_ids = list(ids)[len(flaky):]

        done: dict[str, dict[str, Any]] = {}
        for model in (FLUX, GEMINI):
            mine = [rid for rid in ids if ids[rid][0] == model]
            done.update(wait_all_completed(running, caller, model, mine, timeout_s=30))

        for request_id in flaky_ids:
            model, body = ids[request_id]
            assert "error_type" not in done[request_id], done[request_id]
            _assert_succeeded(caller, model, request_id, body)
            assert _upstream_calls(running, model, body) == 3, "two 500s, then the success"
        for request_id in broken_ids:
            model, body = ids[request_id]
            assert done[request_id]["error_type"] == "provider_error", done[request_id]
            _assert_failed(caller, model, request_id, 502, "provider_error")
            attempts = running.services.catalog.by_id(model).policy.max_attempts
            assert _upstream_calls(running, model, body) == attempts
        assert_not_running(running.services, list(ids))
        assert_settled_once(running.services, caller.workspace, charged=set(flaky_ids), released=set(broken_ids),
                            price={rid: _price(running, ids[rid][0]) for rid in ids})


# -- a hang past the read timeout -------------------------------------------------------------


def test_a_hang_past_the_read_timeout_ends_provider_timeout_while_others_are_served(pool: StackPool) -> None:
    running = pool.get("redis")
    policy = running.services.catalog.by_id(TTS).policy
    assert (policy.read_timeout_s, policy.max_attempts) == (1, 2)
    with running.caller("hang") as caller:
        hung = [_body(TTS, unique_prompt("hang", "[stub:hang=30]")) for _ in range(3)]
        started = time.monotonic()
        hung_ids = [caller.submit_ok(TTS, body) for body in hung]
        quick = [(m, _body(m, unique_prompt("meanwhile"))) for m in (TTS, GEMINI, FLUX) * 2]
        quick_ids = {caller.submit_ok(m, body): (m, body) for m, body in quick}

        quick_done: dict[str, dict[str, Any]] = {}
        for model in (TTS, GEMINI, FLUX):
            mine = [rid for rid in quick_ids if quick_ids[rid][0] == model]
            quick_done.update(wait_all_completed(running, caller, model, mine, timeout_s=10))
        hung_done = wait_all_completed(running, caller, TTS, hung_ids, timeout_s=15)
        took = time.monotonic() - started

        # Two attempts of 1 s each and a short backoff: seconds, not the 30 s hang.
        assert took < 10, took
        for request_id, body in zip(hung_ids, hung):
            assert hung_done[request_id]["error_type"] == "provider_timeout", hung_done[request_id]
            _assert_failed(caller, TTS, request_id, 504, "provider_timeout")
            assert _upstream_calls(running, TTS, body) == 2
        first_timeout = min(float(record(running.services, rid)["completed_at"]) for rid in hung_ids)
        for request_id, (model, body) in quick_ids.items():
            assert "error_type" not in quick_done[request_id], quick_done[request_id]
            _assert_succeeded(caller, model, request_id, body)
            # Served while the hung calls were still waiting on the provider.
            assert float(record(running.services, request_id)["completed_at"]) < first_timeout
        assert_settled_once(running.services, caller.workspace, charged=set(quick_ids), released=set(hung_ids),
                            price={rid: _price(running, TTS) for rid in hung_ids}
                            | {rid: _price(running, m) for rid, (m, _) in quick_ids.items()})


# -- 429 with Retry-After ----------------------------------------------------------------------


class CallTimes:
    """Samples /stub/calls in a thread: for each body, when each of its calls
    happened, as bounds (after the last read that missed it, before the read that saw it)."""

    def __init__(self, stub_url: str, interval_s: float = 0.02):
        self.url = f"{stub_url}/stub/calls"
        self.interval_s = interval_s
        self.seen: dict[str, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-call-times", daemon=True)
        self._lock = threading.Lock()
        self._previous = time.time()  # start of the last read that came back

    def __enter__(self) -> "CallTimes":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                self._read(session)
                self._stop.wait(self.interval_s)

    def _read(self, session: requests.Session) -> None:
        """One read of the stub's counts; a call first seen in it happened between
        the start of the last read that came back and the end of this one."""
        with self._lock:
            before = time.time()
            try:
                counts = session.get(self.url, timeout=5).json()["submits"]
            except (requests.RequestException, ValueError, KeyError):
                return
            after = time.time()
            for key, count in counts.items():
                stamps = self.seen.setdefault(key, [])
                while len(stamps) < count:
                    stamps.append((self._previous, after))
            self._previous = before

    def of(self, route: str, body: Any) -> list[tuple[float, float]]:
        """Read once more first: a loaded machine may not have sampled the last call yet."""
        with requests.Session() as session:
            self._read(session)
        return self.seen.get(f"{route}:{stub_digest(body)}", [])


def test_a_429_is_retried_no_sooner_than_its_retry_after(pool: StackPool) -> None:
    running = pool.get("redis")
    with running.caller("429") as caller, CallTimes(running.stub.base_url) as times:
        cases = [(m, _body(m, unique_prompt("rate limited", "[stub:429=3]"))) for m in (GEMINI, FLUX)]
        ids = {caller.submit_ok(m, body): (m, body) for m, body in cases}
        for request_id, (model, _) in ids.items():
            final = caller.wait_status(model, request_id, timeout_s=15)
            assert "error_type" not in final, final
        for request_id, (model, body) in ids.items():
            _assert_succeeded(caller, model, request_id, body)
            assert _upstream_calls(running, model, body) == 2
            rec = record(running.services, request_id)
            assert float(rec["completed_at"]) - float(rec["started_at"]) >= 3.0, rec
            calls = times.of(_ROUTE[model], body)
            assert len(calls) == 2, calls
            (lo1, hi1), (lo2, hi2) = calls
            # The gap between the two calls lies in [lo2 - hi1, hi2 - lo1]; at least
            # Retry-After, give or take the sampling (two reads, on a busy machine).
            assert hi2 - lo1 >= 3.0, calls
            assert lo2 - hi1 >= 3.0 - 0.3, calls
        assert_settled_once(running.services, caller.workspace, charged=set(ids), released=set(),
                            price={rid: _price(running, m) for rid, (m, _) in ids.items()})


# -- a cancel racing a completion ----------------------------------------------------------------


def test_cancels_racing_completions_settle_each_request_once(pool: StackPool) -> None:
    running = pool.get("redis")
    rng = random.Random(20260501)
    with running.caller("cancel race") as caller:
        # (latency, seconds after submit to cancel): racing ones around the end,
        # plus anchors that must cancel (early) and must complete (late).
        plan = [(lat, max(0.0, lat + rng.uniform(-0.8, 0.8)))
                for lat in (round(rng.uniform(0.5, 2.5), 2) for _ in range(18))]
        plan += [(3.0, 0.8)] * 3 + [(0.3, 3.5)] * 3
        bodies = [_body(FLUX, unique_prompt("race", f"[stub:latency={lat}]")) for lat, _ in plan]

        def run(index: int) -> tuple[str, int]:
            cancel_after, body = plan[index][1], bodies[index]
            with ApiClient(caller.base_url, caller.workspace, caller.api_key) as own:
                request_id = own.submit_ok(FLUX, body)
                time.sleep(cancel_after)
                return request_id, own.cancel(FLUX, request_id).status_code

        with ThreadPoolExecutor(len(plan)) as threads:
            outcomes = list(threads.map(run, range(len(plan))))
        ids = [rid for rid, _ in outcomes]
        done = wait_all_completed(running, caller, FLUX, ids, timeout_s=20)

        charged, released = set(), set()
        for (request_id, cancel_status), body in zip(outcomes, bodies):
            final = done[request_id]
            assert cancel_status in (202, 409), cancel_status
            has_result = bool(running.services.redis.exists(keys.result(request_id)))
            if "error_type" not in final:
                assert has_result
                _assert_succeeded(caller, FLUX, request_id, body)
                charged.add(request_id)
            else:
                assert final["error_type"] == "cancelled", final
                assert cancel_status == 202, "cancelled although the cancel found it already completed"
                assert not has_result, "cancelled and yet a result is stored"
                _assert_failed(caller, FLUX, request_id, 409, "cancelled")
                released.add(request_id)
        assert charged & set(ids[-3:]) == set(ids[-3:]), "a cancel after the end changed the outcome"
        assert released & set(ids[-6:-3]) == set(ids[-6:-3]), "an early cancel of a long generation did not stop it"
        assert_not_running(running.services, ids)
        assert_settled_once(running.services, caller.workspace, charged=charged, released=released,
                            price=_price(running, FLUX))


# -- a redelivery of a message whose delivery is still running ---------------------------------


def test_a_redelivered_message_of_a_live_delivery_does_not_run_the_request_again(pool: StackPool) -> None:
    running = pool.get("redis")
    with running.caller("redelivery") as caller:
        # The stub holds the BFL submit 2 s: a window with the request claimed
        # and no upstream handle stored yet.
        body = _body(FLUX, unique_prompt("redelivered while running", "[stub:hang=2]", "[stub:latency=1]"))
        request_id = caller.submit_ok(FLUX, body)
        holder = wait_for(lambda: record(running.services, request_id).get("holder"), timeout_s=10,
                          what="the request claimed")
        token = holder.rsplit(":", 1)[0]  # the Celery task id of the live delivery
        assert not record(running.services, request_id).get("upstream_ref")
        # What the broker redelivers is the very message the live delivery runs: same task id.
        celery = make_celery(running.settings)
        try:
            celery.send_task(DELIVER_TASK, args=[request_id], queue=queue_name("bfl"), task_id=token)
        finally:
            celery.close()

        final = caller.wait_status(FLUX, request_id, timeout_s=15)
        assert "error_type" not in final, final
        _assert_succeeded(caller, FLUX, request_id, body)
        finished = f"Task workers.tasks.deliver[{token}] succeeded"
        wait_for(lambda: sum(running.current_log(n).count(finished) for n in running.workers()) == 2, timeout_s=10,
                 what="both deliveries of the message finished")
        # Billing holds (complete.lua settles once) ...
        assert_settled_once(running.services, caller.workspace, charged={request_id}, released=set(),
                            price=_price(running, FLUX))
        # ... but the provider was asked for (and bills) the generation twice.
        assert running.stub.submits("bfl_submit", body) == 1, "the redelivery submitted the generation again"


# -- rolling restarts during one long generation ------------------------------------------------


def test_rolling_restarts_during_a_generation_do_not_give_it_up(pool: StackPool) -> None:
    running = pool.get("redis")
    restarts = running.settings.max_takeovers + 1
    extra = tuple("cdefgh"[:restarts - 1])
    running.ensure_workers(("a", "b") + extra)  # one to stop per restart, and a survivor
    with running.caller("rolling restart") as caller:
        body = _body(FLUX, unique_prompt("outlives a rolling restart", "[stub:latency=14]"))
        request_id = caller.submit_ok(FLUX, body)
        wait_for(lambda: _upstream_refs(running, [request_id]), timeout_s=10, what="the generation submitted")
        stopped: list[str] = []

        def live_holder() -> str | None:
            if record(running.services, request_id).get("status") != "IN_PROGRESS":
                return "done"
            name = running.holder(request_id)
            return name if name and name not in stopped else None

        for _ in range(restarts):
            holder = wait_for(live_holder, timeout_s=10, what="a live worker running the generation")
            if holder == "done":
                break
            running.signal_worker(holder, signal.SIGTERM)
            stopped.append(holder)
        final = caller.wait_status(FLUX, request_id, timeout_s=25)
        running.stop_extra_workers()

        assert running.stub.submits("bfl_submit", body) == 1
        assert "error_type" not in final, (final, record(running.services, request_id).get("takeovers"))
        _assert_succeeded(caller, FLUX, request_id, body)


# -- SIGKILL mid-call ----------------------------------------------------------------


def test_sigkill_mid_generation_is_resumed_by_the_survivor_not_resubmitted(pool: StackPool, broker: str) -> None:
    running = pool.get(broker)
    price = _price(running, FLUX)
    with running.caller("sigkill") as caller:
        bodies = [_body(FLUX, unique_prompt("sigkill", "[stub:latency=4]")) for _ in range(10)]
        ids = [caller.submit_ok(FLUX, body) for body in bodies]
        # Past the claim AND past the submit: the upstream handle is in the record.
        # (Between the two a death would rightly cost a second upstream submit.)
        wait_for(lambda: _upstream_refs(running, ids), timeout_s=10, what="every generation submitted upstream")
        on_a = [rid for rid in ids if running.holder(rid) == "a"]
        assert on_a, "worker a runs none of the generations; nothing to kill"
        assert {caller.status_body(FLUX, rid)["status"] for rid in on_a} == {"IN_PROGRESS"}

        running.signal_worker("a", signal.SIGKILL).wait(5)
        done = wait_all_completed(running, caller, FLUX, ids, timeout_s=4 + TAKEOVER_S + 12)

        for request_id, body in zip(ids, bodies):
            assert "error_type" not in done[request_id], done[request_id]
            _assert_succeeded(caller, FLUX, request_id, body)
        assert submits(running.stub, "bfl_submit", bodies) == [1] * len(bodies), "a generation was resubmitted"
        for request_id in on_a:
            assert running.finisher(request_id) == "b", "the dead worker's request did not finish on b"
            # Redis: the sweeper re-publishes once the lease ran out, a new
            # delivery takes over (counted). RabbitMQ: the broker redelivers the
            # dead consumer's unacked message at once, same task id, resumed.
            takeovers = record(running.services, request_id).get("takeovers")
            if broker == "redis":
                assert takeovers == "1", takeovers
            else:
                assert takeovers in (None, "1"), takeovers
        assert_not_running(running.services, ids)
        assert_settled_once(running.services, caller.workspace, charged=set(ids), released=set(), price=price)


# -- warm shutdown during a long generation ----------------------------------------------


def test_warm_shutdown_hands_a_long_generation_to_the_other_worker(pool: StackPool, broker: str) -> None:
    running = pool.get(broker)
    with running.caller("sigterm") as caller:
        body = _body(FLUX, unique_prompt("warm shutdown", "[stub:latency=8]"))
        request_id = caller.submit_ok(FLUX, body)
        wait_for(lambda: _upstream_refs(running, [request_id]), timeout_s=10, what="the generation submitted")
        holder = wait_for(lambda: running.holder(request_id), timeout_s=5, what="the worker holding the request")
        survivor = "b" if holder == "a" else "a"

        signalled = time.monotonic()
        proc = running.signal_worker(holder, signal.SIGTERM)
        try:
            # The BFL poll loop checks for a shutdown between polls (at most 2 s apart).
            proc.wait(5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {holder} still running 5 s after SIGTERM") from None
        # Well before the generation ends (8 s after its submit): it did not wait for it.
        assert caller.status_body(FLUX, request_id)["status"] == "IN_PROGRESS", time.monotonic() - signalled
        assert "handed back" in running.current_log(holder)

        final = caller.wait_status(FLUX, request_id, timeout_s=20)
        assert "error_type" not in final, final
        _assert_succeeded(caller, FLUX, request_id, body)
        assert running.stub.submits("bfl_submit", body) == 1, "the generation was submitted upstream again"
        assert running.finisher(request_id) == survivor
        assert_not_running(running.services, [request_id])
        assert_settled_once(running.services, caller.workspace, charged={request_id}, released=set(),
                            price=_price(running, FLUX))


# -- queue timeout ------------------------------------------------------------------------------------


def test_a_request_that_waits_past_its_queue_timeout_is_never_dispatched_nor_billed(pool: StackPool) -> None:
    running = pool.get("redis", "queue_timeout")
    entry = running.services.catalog.by_id(FLUX)
    assert running.services.catalog.max_in_flight("bfl") == 1 and entry.policy.queue_timeout_s == 2
    with running.caller("queue timeout") as caller:
        long_body = _body(FLUX, unique_prompt("occupies the only slot", "[stub:latency=6]"))
        long_id = caller.submit_ok(FLUX, long_body)
        caller.wait_status(FLUX, long_id, "IN_PROGRESS", timeout_s=10)
        starved = _body(FLUX, unique_prompt("starved"))
        admitted = time.monotonic()
        starved_id = caller.submit_ok(FLUX, starved)

        final = caller.wait_status(FLUX, starved_id, timeout_s=2 + REPUBLISH_AFTER_S + 6)
        waited = time.monotonic() - admitted
        assert final.get("error_type") == "queue_timeout", final
        assert waited >= 2.0, waited
        _assert_failed(caller, FLUX, starved_id, 504, "queue_timeout")
        assert running.stub.submits("bfl_submit", starved) == 0, "a timed-out request reached the provider"
        assert not record(running.services, starved_id).get("started_at"), "it was run"
        assert caller.status_body(FLUX, long_id)["status"] == "IN_PROGRESS", "the queue timeout hit a running request"

        caller.cancel(FLUX, long_id)
        long_final = caller.wait_status(FLUX, long_id, timeout_s=10)
        long_charged = "error_type" not in long_final
        assert_not_running(running.services, [long_id, starved_id])
        assert_settled_once(running.services, caller.workspace,
                            charged={long_id} if long_charged else set(),
                            released={starved_id} | (set() if long_charged else {long_id}),
                            price=entry.price_credits)


# -- the provider's in-flight cap ------------------------------------------------------------------------


def test_the_in_flight_cap_holds_and_waiting_positions_never_go_up(pool: StackPool) -> None:
    running = pool.get("redis", "cap2")
    assert running.services.catalog.max_in_flight("bfl") == 2
    redis_client = running.services.redis
    with running.caller("cap") as caller:
        bodies = [_body(FLUX, unique_prompt("capped", "[stub:latency=2]")) for _ in range(6)]
        ids = [caller.submit_ok(FLUX, body) for body in bodies]
        digests = [f"bfl_submit:{stub_digest(body)}" for body in bodies]

        max_running = max_stub = 0
        positions: dict[str, list[int]] = {rid: [] for rid in ids}
        last_status = {rid: "IN_QUEUE" for rid in ids}
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, f"not all done; last statuses {last_status}"
            # The stub first, then our records: a body it saw submitted whose
            # request is still open was upstream at the moment of the stub read.
            calls = running.stub.calls()["submits"]
            pipe = redis_client.pipeline(transaction=False)
            pipe.zcard(keys.running("bfl"))
            for request_id in ids:
                pipe.hget(keys.request(request_id), "status")
            in_flight, *statuses = pipe.execute()
            upstream = sum(1 for digest, status in zip(digests, statuses)
                           if calls.get(digest) and status != b"COMPLETED")
            assert in_flight <= 2, f"{in_flight} BFL requests hold a running slot"
            assert upstream <= 2, f"{upstream} BFL generations upstream at once"
            max_running, max_stub = max(max_running, in_flight), max(max_stub, upstream)

            for request_id in ids:
                if last_status[request_id] == "COMPLETED":
                    continue
                body = caller.status_body(FLUX, request_id)
                assert STATUS_ORDER[body["status"]] >= STATUS_ORDER[last_status[request_id]], (request_id, body)
                last_status[request_id] = body["status"]
                if body["status"] == "IN_QUEUE":
                    positions[request_id].append(body["queue_position"])
            if all(status == "COMPLETED" for status in last_status.values()):
                break
            time.sleep(0.05)

        assert max_running == 2 and max_stub == 2, (max_running, max_stub)
        # Four had to wait at least one whole generation (2 s): each was seen
        # waiting, and some behind others.
        assert sum(1 for seen in positions.values() if seen) >= 4, f"too few seen waiting: {positions}"
        assert any(seen and seen[0] > 0 for seen in positions.values()), positions
        for request_id, seen in positions.items():
            assert seen == sorted(seen, reverse=True), f"{request_id} queue position went up: {seen}"
        for request_id, body in zip(ids, bodies):
            assert "error_type" not in caller.status_body(FLUX, request_id)
            _assert_succeeded(caller, FLUX, request_id, body)
        assert submits(running.stub, "bfl_submit", bodies) == [1] * len(bodies)
        assert_not_running(running.services, ids)
        assert_settled_once(running.services, caller.workspace, charged=set(ids), released=set(),
                            price=_price(running, FLUX))
