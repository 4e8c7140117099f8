"""The delivery phases on the shared fleet: ``dispatch``, ``grant_to_start`` (both against the bare Celery
round trip), ``inflight`` and ``waiting_cpu`` (bench/README.md)."""

import json
import statistics
import time

from . import core, schedule
from .core import CAP, CAPPED_MODEL_ID, CAPPED_PROVIDER, Context, MeasurementError, emit, log, phase

#: Stub seconds of the generation holding the capped slot in waiting_cpu (it outlasts the phase) and
#: while grant_to_start's chain is submitted.
HOLD_S, BLOCK_S = 600, 2
#: dispatch: sequential submits (each after a ping) after 5 of each as warm-up; grant_to_start: generations
#: run one after another behind the cap.
SAMPLES, WARMUP, CHAIN = 50, 5, 40
#: inflight: generations submitted at once from SUBMITTERS threads, each LATENCY_S at the stub; seconds allowed.
INFLIGHT, SUBMITTERS, LATENCY_S, INFLIGHT_TIMEOUT_S = 500, 32, 5.0, 300.0
#: waiting_cpu: requests waiting behind the cap, seconds of each CPU window, seconds let pass before each.
WAITING, WINDOW_S, SETTLE_S = 10_000, 20.0, 3.0


def capped_body(text: str) -> str:
    """A body for the capped model (a Gemini prompt)."""
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": text}]}]})


@phase("dispatch", "fleet", 10)
def measure_dispatch(ctx: Context) -> None:
    """Admitted -> claimed of sequential submits vs publish -> run -> answer of a ping, interleaved."""
    fleet = ctx.fleet
    pings: list[float] = []
    claims: list[float] = []
    for _ in range(WARMUP + SAMPLES):
        pings += fleet.ping(1)
        time.sleep(0.05)  # idle between samples: none starts while the last one winds down
        request_id = fleet.submit(json.dumps({"prompt": fleet.prompt("dispatch", 0)}))
        row = fleet.wait_records([request_id], interval_s=0.005)[request_id]  # the fleet is idle again
        claims.append(float(row["started_at"]) - float(row["created_at"]))
    emit("dispatch_latency", 1000 * statistics.median(claims[WARMUP:]), "ms",
         1000 * statistics.median(pings[WARMUP:]))


def _hold_slot(fleet: core.Fleet, latency: float, what: str) -> str:
    """Check the capped provider is idle and capped at 1, then submit a ``latency`` s generation and wait
    until a worker runs it (it holds the slot)."""
    counts = core.schedule_counts(fleet.client, CAPPED_PROVIDER)
    if counts["queued"] or counts["running"] or counts["granted"]:
        raise MeasurementError(f"{what}: {CAPPED_PROVIDER} is not idle ({counts}); the phase needs it to itself")
    if (cap := fleet.services.catalog.max_in_flight(CAPPED_PROVIDER)) != CAP:
        raise MeasurementError(f"{what}: {CAPPED_PROVIDER}'s cap is {cap} in the fleet's catalog, not {CAP}")
    request_id = fleet.submit(capped_body(fleet.prompt(what, latency)), CAPPED_MODEL_ID)
    fleet.wait_records([request_id], core.IN_PROGRESS, interval_s=0.02)
    return request_id


@phase("grant_to_start", "fleet", 20)
def measure_grant_to_start(ctx: Context) -> None:
    fleet = ctx.fleet
    fleet.ping(5)  # warm-up
    pings = fleet.ping(20)
    blocker = _hold_slot(fleet, BLOCK_S, "grant_to_start")
    ids = fleet.submit_all([capped_body(fleet.prompt(f"chain{i}", 0)) for i in range(CHAIN)], CAPPED_MODEL_ID, 8)
    if fleet.records([blocker])[blocker]["status"] != core.IN_PROGRESS:
        raise MeasurementError(f"grant_to_start: the {BLOCK_S} s blocker ended before the {CHAIN} submits did: "
                               "the chain would overlap its own submits")
    rows = fleet.wait_records([blocker, *ids], timeout_s=BLOCK_S + 30 + 2 * CHAIN, interval_s=0.2)
    pings += fleet.ping(20)
    order = sorted(rows.values(), key=lambda r: float(r["started_at"]))
    gaps = [float(b["started_at"]) - float(a["completed_at"]) for a, b in zip(order, order[1:])]
    if min(gaps) < -0.001:
        raise MeasurementError(f"grant_to_start: a generation started {-1000 * min(gaps):.1f} ms before the "
                               f"previous one ended: the cap of {CAP} did not hold")
    emit("grant_to_start_latency", 1000 * statistics.median(gaps), "ms", 1000 * statistics.median(pings))


def completion_s(fleet: core.Fleet, count: int, timeout_s: float) -> float:
    """Seconds from the first of ``count`` submits of a ``LATENCY_S`` generation until the last of them
    is COMPLETED (its record's ``completed_at``)."""
    prompts = [json.dumps({"prompt": fleet.prompt(f"inflight{i}", LATENCY_S)}) for i in range(count)]
    began = time.time()
    ids = fleet.submit_all(prompts, core.MODEL_ID, SUBMITTERS)
    rows = fleet.wait_records(ids, timeout_s=timeout_s, interval_s=0.1 if count == 1 else 0.5)
    return max(float(r["completed_at"]) for r in rows.values()) - began


@phase("inflight", "fleet", 30)
def measure_inflight(ctx: Context) -> None:
    alone = completion_s(ctx.fleet, 1, LATENCY_S + 120)
    emit("inflight_500_completion", completion_s(ctx.fleet, INFLIGHT, INFLIGHT_TIMEOUT_S), "s", alone)


@phase("waiting_cpu", "fleet", 60)  # last: it leaves vertexai's one slot held by a long generation
def measure_waiting_cpu(ctx: Context) -> None:
    fleet = ctx.fleet
    holder = _hold_slot(fleet, HOLD_S, "waiting_cpu")
    entry = fleet.services.catalog.by_id(CAPPED_MODEL_ID)

    def check(queued: int, when: str) -> None:
        counts = core.schedule_counts(fleet.client, CAPPED_PROVIDER)
        status = fleet.records([holder])[holder]["status"]
        if counts["queued"] != queued or counts["running"] != 1 or counts["granted"] or status != core.IN_PROGRESS:
            raise MeasurementError(f"waiting_cpu: {when}: {counts}, the holder {status}; expected {queued} "
                                   "queued behind the one running holder")

    def cores(queued: int, what: str) -> float:
        """The cores the workers and beat used over a window."""
        check(queued, f"before the window '{what}'")
        time.sleep(SETTLE_S)
        used = core.cores_used(fleet.pids("worker", "beat"), WINDOW_S)
        fleet.alive()
        check(queued, f"after the window '{what}'")
        log(f"waiting_cpu: {what}: {used:.4f} cores")
        return used

    idle_before = cores(0, "idle, slot held, nothing waiting")
    body = capped_body(fleet.prompt("waiting", 0))
    ids = schedule.seed_spread(fleet.services, [fleet.workspace], entry, WAITING, body)
    waiting = cores(WAITING, f"{WAITING} waiting")
    schedule.cancel_all(fleet.services, ids, fleet.workspace, entry)
    idle_after = cores(0, "idle again, slot held, nothing waiting")
    emit("waiting_cpu_10k", waiting, "cores", (idle_before + idle_after) / 2)
