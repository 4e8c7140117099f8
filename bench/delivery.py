"""The delivery phases on the shared fleet: ``dispatch_latency`` and ``grant_to_start_latency`` against the
bare Celery round trip, ``inflight_<n>_completion`` (n generations at once against one alone), and
``waiting_cpu_<n>`` (the workers' and beat's CPU while n requests wait behind vertexai's cap of 1, against
the same fleet idle)."""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from . import core, schedule
from .core import Context, MeasurementError, emit, log, phase

#: Stub seconds of the generation holding the capped slot: in waiting_cpu (it outlasts the phase), and
#: while grant_to_start's chain is submitted.
HOLD_S, BLOCK_S = 600, 2
#: dispatch: sequential submits, each after a ping.
SAMPLES = 50
#: grant_to_start: generations run one after another behind the cap.
CHAIN = 40
#: inflight: generations submitted at once (from SUBMITTERS threads), each LATENCY_S long at the stub, and
#: the seconds they may take.
INFLIGHT, SUBMITTERS, LATENCY_S, INFLIGHT_TIMEOUT_S = 500, 32, 5.0, 300.0
#: waiting_cpu: requests waiting behind the cap, seconds of each CPU window, seconds let pass before each
#: window (the last step's work winds down).
WAITING, WINDOW_S, SETTLE_S = 10_000, 20.0, 3.0


def capped_body(text: str) -> str:
    """A body for the capped model (a Gemini prompt)."""
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": text}]}]})


def _failed(rows: dict, what: str) -> None:
    if failed := {i: r["error_type"] for i, r in rows.items() if r["error_type"] or not r["started_at"]}:
        raise MeasurementError(f"{what}: some generations failed: {dict(list(failed.items())[:3])}")


@phase("dispatch", "fleet", 10)
def measure_dispatch(ctx: Context) -> None:
    """Admitted -> claimed of sequential submits vs publish -> run -> answer of a ping, interleaved."""
    fleet = ctx.fleet

    def dispatch() -> float:
        """Admitted -> claimed, in seconds; waits for COMPLETED so the fleet is idle again."""
        request_id = fleet.submit(fleet.prompt("dispatch", 0))
        rows = fleet.wait_records([request_id], (core.COMPLETED,), timeout_s=30, interval_s=0.005)
        _failed(rows, "dispatch")
        return float(rows[request_id]["started_at"]) - float(rows[request_id]["created_at"])

    for _ in range(5):  # warm-up
        fleet.ping(1)
        dispatch()
    pings: list[float] = []
    claims: list[float] = []
    for _ in range(SAMPLES):
        pings += fleet.ping(1)
        time.sleep(0.05)  # idle between samples: none starts while the last one winds down
        claims.append(dispatch())
    emit("dispatch_latency", 1000 * statistics.median(claims), "ms", 1000 * statistics.median(pings))


def _require_idle(fleet: core.Fleet, what: str) -> None:
    counts = core.schedule_counts(fleet.client, core.CAPPED_PROVIDER)
    if counts["queued"] or counts["running"] or counts["granted"]:
        raise MeasurementError(f"{what}: {core.CAPPED_PROVIDER} is not idle ({counts}); the phase needs it to itself")
    if (cap := fleet.services.catalog.max_in_flight(core.CAPPED_PROVIDER)) != core.CAP:
        raise MeasurementError(f"{what}: {core.CAPPED_PROVIDER}'s cap is {cap} in the fleet's catalog, not {core.CAP}")


def _hold_slot(fleet: core.Fleet, latency: float, what: str) -> str:
    """Submit a ``latency`` s generation and wait until a worker runs it (it holds the slot)."""
    request_id = fleet.submit_to(core.CAPPED_MODEL_ID, capped_body(fleet.prompt(what, latency)))
    fleet.wait_records([request_id], (core.IN_PROGRESS,), timeout_s=30, interval_s=0.02)
    return request_id


@phase("grant_to_start", "fleet", 20)
def measure_grant_to_start(ctx: Context) -> None:
    fleet, count = ctx.fleet, CHAIN
    _require_idle(fleet, "grant_to_start")
    fleet.ping(5)  # warm-up
    pings = fleet.ping(20)
    blocker = _hold_slot(fleet, BLOCK_S, "block")
    bodies = [capped_body(fleet.prompt(f"chain{i}", 0)) for i in range(count)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(lambda b: fleet.submit_to(core.CAPPED_MODEL_ID, b), bodies))
    if fleet.records([blocker])[blocker]["status"] != core.IN_PROGRESS:
        raise MeasurementError(f"grant_to_start: the {BLOCK_S} s blocker ended before the {count} submits did: "
                               "the chain would overlap its own submits")
    rows = fleet.wait_records([blocker, *ids], (core.COMPLETED,), timeout_s=BLOCK_S + 30 + 2 * count,
                              interval_s=0.2)
    pings += fleet.ping(20)
    _failed(rows, "grant_to_start")
    order = sorted(rows.values(), key=lambda r: float(r["started_at"]))
    gaps = [float(b["started_at"]) - float(a["completed_at"]) for a, b in zip(order, order[1:])]
    if min(gaps) < -0.001:
        raise MeasurementError(f"grant_to_start: a generation started {-1000 * min(gaps):.1f} ms before the "
                               f"previous one ended: the cap of {core.CAP} did not hold")
    emit("grant_to_start_latency", 1000 * statistics.median(gaps), "ms", 1000 * statistics.median(pings))


def completion_s(fleet: core.Fleet, count: int, timeout_s: float) -> float:
    """Seconds from the first of ``count`` submits of a ``LATENCY_S`` generation (from ``SUBMITTERS`` threads)
    until the last of them is COMPLETED (its record's ``completed_at``); every one must succeed."""
    prompts = [fleet.prompt(f"inflight{i}", LATENCY_S) for i in range(count)]
    began = time.time()
    with ThreadPoolExecutor(max_workers=SUBMITTERS, thread_name_prefix="submit") as pool:
        ids = list(pool.map(fleet.submit, prompts))
    rows = fleet.wait_records(ids, (core.COMPLETED,), timeout_s=timeout_s, interval_s=0.1 if count == 1 else 0.5)
    _failed(rows, "inflight")
    return max(float(r["completed_at"]) for r in rows.values()) - began


@phase("inflight", "fleet", 30)
def measure_inflight(ctx: Context) -> None:
    alone = completion_s(ctx.fleet, 1, LATENCY_S + 120)
    emit("inflight_500_completion", completion_s(ctx.fleet, INFLIGHT, INFLIGHT_TIMEOUT_S), "s", alone)


# last: it leaves vertexai's one slot held by a long generation
@phase("waiting_cpu", "fleet", 60)
def measure_waiting_cpu(ctx: Context) -> None:
    fleet, count = ctx.fleet, WAITING
    _require_idle(fleet, "waiting_cpu")
    holder = _hold_slot(fleet, HOLD_S, "hold")
    entry = fleet.services.catalog.by_id(core.CAPPED_MODEL_ID)
    pids = fleet.pids("worker", "beat")

    def check(queued: int, when: str) -> None:
        counts = core.schedule_counts(fleet.client, core.CAPPED_PROVIDER)
        status = fleet.records([holder])[holder]["status"]
        if counts["queued"] != queued or counts["running"] != 1 or counts["granted"] or status != core.IN_PROGRESS:
            raise MeasurementError(f"waiting_cpu: {when}: {counts}, the holder {status}; expected {queued} "
                                   "queued behind the one running holder")

    def cores(queued: int, what: str) -> float:
        """The cores the workers and beat used over a window (schedstat: /proc stat's ticks are too coarse)."""
        check(queued, f"before the window '{what}'")
        time.sleep(SETTLE_S)
        began, before = time.monotonic(), core.cpu_seconds(pids, precise=True)
        time.sleep(WINDOW_S)
        used = (core.cpu_seconds(pids, precise=True) - before) / (time.monotonic() - began)
        fleet.alive()
        check(queued, f"after the window '{what}'")
        log(f"waiting_cpu: {what}: {used:.4f} cores")
        return used

    idle_before = cores(0, "idle, slot held, nothing waiting")
    ids = schedule.seed_spread(fleet.services, [fleet.workspace], entry, count,
                               capped_body(fleet.prompt("waiting", 0)))
    waiting = cores(count, f"{count} waiting")
    schedule.cancel_all(fleet.services, ids, fleet.workspace, entry)
    idle_after = cores(0, "idle again, slot held, nothing waiting")
    emit("waiting_cpu_10k", waiting, "cores", (idle_before + idle_after) / 2)
