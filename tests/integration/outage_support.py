"""The Redis-outage drills under load, shared by ``test_operations.py`` (one
Redis killed, stalled, failed over) and ``test_cluster.py`` (a cluster's primary):
a ``Fault``, the private stack's settings, and the two runs that count what the
fault cost. Plain code, no fixtures; it builds on ``harness.py`` and ``ops_support.py``.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import requests

from router_queue.dev.stack import free_port
from router_queue.settings import DEFAULT_CATALOG
from router_queue.store import keys

from .harness import FLUX, ApiClient, RunningStack, children, stack_env, wait_for
from .ops_support import CLIENT_TIMEOUT_S, Load


def assert_503(response: requests.Response) -> None:
    """The front door's answer while Redis does not answer: 503 service_unavailable, Retry-After."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.json()["error_type"] == "service_unavailable"
    assert response.headers.get("X-Comfy-Error-Type") == "service_unavailable"
    retry_after = response.headers.get("Retry-After")
    assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, retry_after


#: How long Redis stays killed (a fault's default length).
OUTAGE_S = 4.0
#: Leases outlast the stall, as production's 30 s do: a worker holding an answer
#: retries its completion for as long as its lease lasts.
OUTAGE_LEASE_S = "15"


def private_env(redis_url: str, **settings: str) -> dict[str, str]:
    """A stack of our own on ``redis_url`` (broker too), the shipped catalog, long leases."""
    return stack_env(redis_url, stub_port=free_port(), catalog=DEFAULT_CATALOG, LEASE_SECONDS=OUTAGE_LEASE_S,
                     **settings)


#: Longest a front-door answer may take while Redis is stalled: its 0.8 s wait
#: (FRONT_DOOR_REDIS_WAIT_SECONDS) plus the HTTP round trip, with slack for a
#: loaded machine.
STALLED_ANSWER_S = 1.5
#: A submit whose admission's reply is lost reads the outcome back for one
#: more wait (store/admission.py, LostReplies) before it answers.
STALLED_SUBMIT_S = STALLED_ANSWER_S + 0.9


@dataclass
class Fault:
    """A state-store fault: ``begin`` it; it lasts ``lasts_s`` and ``heal`` ends
    it, or it ends by itself once ``healed()`` (a failover: the sentinels
    promoted the replica)."""

    name: str
    begin: Callable[[], None]
    heal: Callable[[], None] | None = None
    healed: Callable[[], bool] | None = None
    lasts_s: float = OUTAGE_S
    #: With ``healed``: how long the fault lasts at least (the failure detection
    #: time, before which no replica can be promoted), so answers in it must be
    #: 503s however late ``healed()`` notices the promotion on a loaded machine.
    surely_down_s: float | None = None
    #: With ``healed``: how long the promotion may take.
    heal_within_s: float = 20.0
    #: Answers sent within this after the fault began may have been served before it.
    in_flight_s: float = 0.5


def outage_under_load(running: RunningStack, fault: Fault) -> None:
    """A state-store fault under submits and polls. Counts: lost, charged twice,
    charged after a 503, run twice upstream, answers over 1 s, seconds from
    Redis answering again to work resuming."""
    web = running.stack.procs["web"]
    web_workers = children(web.pid)
    assert len(web_workers) == 2, web_workers
    callers = [running.caller(f"load-{fault.name}-{n}") for n in range(3)]
    ready = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
    assert ready.status_code == 200, ready.text

    try:
        with Load(running.base_url, callers) as load:
            time.sleep(2.0)
            down_at = time.monotonic()
            fault.begin()
            readyz_down, metrics_down = [], []
            #: until when Redis is known not to answer: an answer that ended before it was given while down
            back_at = down_at
            while time.monotonic() - down_at < (fault.heal_within_s if fault.healed else fault.lasts_s):
                started = time.monotonic()
                readyz = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
                elapsed = time.monotonic() - started
                metrics = requests.get(f"{running.ops_url}/metrics", timeout=CLIENT_TIMEOUT_S)
                checked_at = time.monotonic()
                if fault.healed and fault.healed():
                    break  # the samples just taken may have reached the promoted replica
                readyz_down.append((readyz, elapsed))
                metrics_down.append(metrics)
                back_at = checked_at
                time.sleep(0.2 if fault.healed else 0.5)
            else:
                if fault.healed:
                    raise AssertionError(f"{fault.name}: not healed within {fault.heal_within_s:g} s")
            healthz = requests.get(f"{running.base_url}/healthz", timeout=CLIENT_TIMEOUT_S)
            if fault.heal:
                if not fault.healed:  # a failover answered already: what heal() restarts is a spare
                    back_at = time.monotonic()  # from here Redis may answer: start() returns once it does
                fault.heal()
            up_at = time.monotonic()
            wait_for(lambda: requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S).status_code == 200,
                     timeout_s=15, interval_s=0.2, what="/readyz 200 after Redis is back")
            recovered_s = time.monotonic() - up_at
            time.sleep(3.0)
    except BaseException:
        print(running.log_tails())
        raise
    answers = load.answers
    # a submit in doubt that was admitted is a request like any other (its status says so)
    admitted = load.admitted + [(c, i) for c, i in load.in_doubt if c.status(FLUX, i).status_code == 200]

    # While Redis was down: 503 service_unavailable with Retry-After, never a 500, never a hang.
    context = f"\n\n{running.log_tails()}"
    assert healthz.status_code == 200
    for response, elapsed in readyz_down:
        assert_503(response)
        assert elapsed < STALLED_ANSWER_S, elapsed
    for response in metrics_down:
        assert response.status_code == 503, (response.status_code, response.text[:300])
    assert all(a.status is not None for a in answers), [a for a in answers if a.status is None][:5]
    slowest = max(a.elapsed_s for a in answers)
    assert slowest < STALLED_SUBMIT_S, sorted(answers, key=lambda a: -a.elapsed_s)[:3]
    assert all(a.elapsed_s < STALLED_ANSWER_S for a in answers if a.kind == "status"), slowest
    wrong = [a for a in answers if a.status not in (200, 201, 503)
             and not (a.kind == "submit" and a.status == 504 and a.error_type == "outcome_unknown")]
    assert not wrong, f"answers other than 200/201/503 (or a submit's 504 outcome_unknown): {wrong[:10]}{context}"
    unavailable = [a for a in answers if a.status == 503]
    assert unavailable, "no 503 while Redis was down: the outage was not exercised"
    for answer in unavailable:
        assert answer.error_type == answer.header_error_type == "service_unavailable", answer
        assert answer.retry_after is not None and answer.retry_after.isdigit() and int(answer.retry_after) >= 1
    # sent and answered while Redis was gone (a stalled Redis that wakes before a
    # submit's deadline admits it, and rightly answers 201)
    if fault.surely_down_s is not None:
        back_at = min(back_at, down_at + fault.surely_down_s)
    during = [a for a in answers if down_at + fault.in_flight_s < a.at and a.at + a.elapsed_s < back_at - 0.05]
    # (a short outage, a replica promoted fast, may hold no answer whole: the 503s above show it was exercised)
    assert all(a.status in (503, 504) for a in during if a.kind == "submit"), (
        [a for a in during if a.kind == "submit" and a.status != 503][:5], down_at, back_at)
    assert any(a.kind == "submit" and a.status == 201 and a.at > up_at + recovered_s for a in answers), (
        "no submit admitted after Redis came back")

    # Recovered without a restart: the same gunicorn master and workers.
    assert web.poll() is None and children(web.pid) == web_workers, (web_workers, children(web.pid))
    running_dead = running.stack.exited()
    assert running_dead is None, f"{running_dead} exited{context}"

    # None lost: every request answered 201 reaches COMPLETED.
    assert len(admitted) >= 10, len(admitted)
    finals: dict[str, dict] = {}

    def all_completed() -> bool:
        for caller, request_id in admitted:
            if request_id not in finals:
                response = caller.status(FLUX, request_id)
                if response.status_code == 503:
                    # the store just back, catching up on a loaded machine past the front door's
                    # 0.8 s wait: a client retries after Retry-After, as this poll does
                    assert_503(response)
                    continue
                assert response.status_code == 200, (response.status_code, response.text)
                if response.json()["status"] == "COMPLETED":
                    finals[request_id] = response.json()
        return len(finals) == len(admitted)

    try:
        wait_for(all_completed, timeout_s=60, interval_s=0.5, what=f"{len(admitted)} admitted requests COMPLETED")
    except AssertionError as exc:
        raise AssertionError(f"{exc}{context}") from None
    outcomes = sorted({body.get("error_type", "success") for body in finals.values()})
    # No provider answer thrown away, no generation paid for twice, no charge
    # twice, none for a submit answered 503.
    assert outcomes == ["success"], outcomes
    twice = {k: n for k, n in running.stub.calls()["submits"].items() if k.startswith("bfl_submit:") and n > 1}
    assert not twice, f"generations submitted upstream twice: {twice}"
    # Work resumed: a request admitted after Redis was back ran to COMPLETED (above).
    answered = {request_id for _, request_id in admitted + load.in_doubt}
    # A submit whose reply was lost (a stall, a connection reset under it) is read back:
    # admitted answers 201, unknown 504 naming the id. No 503 names a request that holds credits.
    cut_short = [a for a in answers if a.kind == "submit" and a.status == 503 and a.at <= down_at <= a.at + a.elapsed_s]
    executed_unanswered, charged_twice = held_unnamed(running, callers, answered)
    assert charged_twice == 0, "a request charged twice"
    assert not executed_unanswered, (
        f"admitted after a 503: {executed_unanswered} ({len(cut_short)} 503s in flight at the fault)")
    # Every ending's workspace side given (on a cluster a step of its own that a fault may leave
    # to the sweeper: store/owed.py): nothing held or counted waiting once everything completed.
    wait_for(lambda: all((w.held, w.queued) == (0, 0) for w in (running.services.accounts.get(c.workspace)
                                                                for c in callers)),
             timeout_s=30, interval_s=0.5, what="every workspace's holds settled and nothing counted waiting")
    resumed = [a.at + a.elapsed_s - up_at for a in answers if a.kind == "submit" and a.status == 201 and a.at > up_at]
    print(f"outage ({fault.name}): {len(answers)} answers, {len(unavailable)} x 503, {len(admitted)} admitted, "
          f"outcomes {outcomes}, slowest answer {slowest:.2f} s, /readyz back {recovered_s:.1f} s after Redis, "
          f"first admission {min(resumed):.1f} s after, run twice upstream {len(twice)}, "
          f"in doubt (504) {len(load.in_doubt)}, 503s admitted all the same {len(executed_unanswered)} "
          f"({len(cut_short)} 503s in flight at the fault), "
          f"unreplicated writes (test process) {running.services.store.unreplicated}")
    for caller in callers:
        caller.session.close()


def held_unnamed(running: RunningStack, callers: list[ApiClient], named: set[str]) -> tuple[set[str], int]:
    """From the callers' ledgers: the requests still holding credits whose id no
    answer named (a 503 that took effect), and how many charges were repeated.
    On a cluster a submit answered 503 between admission's steps holds and then
    releases (store/admission.py): never placed, never run, nothing kept."""
    unnamed: set[str] = set()
    repeated = 0
    for caller in callers:
        entries = running.services.accounts.ledger(caller.workspace, count=100_000)
        held = {e.request_id for e in entries if e.type == "hold"}
        charged = [e.request_id for e in entries if e.type == "charge"]
        given_back = {e.request_id for e in entries if e.type == "release"} - set(charged)
        unnamed |= held - given_back - named
        repeated += len(charged) - len(set(charged))
    return unnamed, repeated


def warn_failed_inside_workers(running: RunningStack) -> None:
    """A request a stall failed (seen once in three cluster runs, as internal_error; cause not yet
    found): the worker's traceback, as a warning the run's summary shows, not a failure."""
    for path in sorted(running.stack.log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        for found in list(re.finditer("failed inside the worker", text))[:2]:
            warnings.warn(f"{path.name}: {text[found.start():found.start() + 4000]}", stacklevel=1)


def unnamed_records(running: RunningStack, request_ids: set[str]) -> dict[str, dict[str, str]]:
    """What the store holds of each request no answer named: enough to tell
    when it was admitted, with a key or without, and how it ended."""
    fields = ("status", "created_at", "idem", "error_type", "workspace")
    found = {}
    for request_id in request_ids:
        values = running.services.redis.hmget(keys.request(request_id), fields)
        found[request_id] = {f: v.decode() for f, v in zip(fields, values) if v is not None}
    return found


#: Item 12 of issue 32: Redis SIGSTOPped for 8 s under four submitting threads, ten times.
STALLS = 10
STALL_EACH_S = 8.0


def stalls_under_load(running: RunningStack, fault: Fault, stalls: int = STALLS) -> None:
    """``fault`` begun and healed ``stalls`` times under four submitting threads
    (two with an Idempotency-Key, resending on 409 as comfy-sdk does). Counts
    503s that were admitted or charged (none may be), requests lost, charged
    twice, and the submits answered in doubt and what they turned out to be."""
    callers = [running.caller(f"stalls-{fault.name}-{n}") for n in range(4)]
    assert fault.heal is not None
    try:
        with Load(running.base_url, callers, keyed=2) as load:
            time.sleep(2.0)
            for _ in range(stalls):
                fault.begin()
                time.sleep(fault.lasts_s)
                fault.heal()
                wait_for(lambda: requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S).status_code
                         == 200, timeout_s=30, interval_s=0.2, what="/readyz 200 after the stall")
                time.sleep(2.0)
    except BaseException:
        print(running.log_tails())
        raise
    answers, submits = load.answers, [a for a in load.answers if a.kind == "submit"]
    confirmed = [(c, i) for c, i in load.in_doubt if c.status(FLUX, i).status_code == 200]
    admitted = load.admitted + confirmed
    named = {i for _, i in load.admitted + load.in_doubt}
    finals: dict[str, str] = {}

    def all_completed() -> bool:
        for caller, request_id in admitted:
            if request_id not in finals:
                body = caller.status(FLUX, request_id).json()
                if body.get("status") == "COMPLETED":
                    finals[request_id] = body.get("error_type", "success")
        return len(finals) == len(admitted)

    lost_ids: set[str] = set()
    try:
        wait_for(all_completed, timeout_s=90, interval_s=0.5, what=f"{len(admitted)} admitted requests COMPLETED")
    except AssertionError:
        lost_ids = {i for _, i in admitted} - set(finals)
    admitted_503, charged_twice = held_unnamed(running, callers, named)
    statuses: dict[str, int] = {}
    for a in submits:
        label = f"{a.status} {a.error_type}" if a.error_type else str(a.status)
        statuses[label] = statuses.get(label, 0) + 1
    print(f"{fault.name} x{stalls} of {fault.lasts_s:g} s under 4 threads: {len(submits)} submits {statuses}, "
          f"slowest submit {max(a.elapsed_s for a in submits):.2f} s; in doubt (504) {len(load.in_doubt)}, "
          f"of which admitted {len(confirmed)}; 503s admitted or charged {len(admitted_503)}; "
          f"lost {len(lost_ids)}; charged twice {charged_twice}; outcomes {sorted(set(finals.values()))}")
    assert not admitted_503, f"admitted or charged after a 503: {unnamed_records(running, admitted_503)}"
    assert not lost_ids, f"admitted and never completed: {lost_ids}"
    assert charged_twice == 0
    if sorted(set(finals.values())) != ["success"]:
        warn_failed_inside_workers(running)
    assert all(a.status is not None for a in answers), [a for a in answers if a.status is None][:5]
    for caller in callers:
        caller.session.close()
