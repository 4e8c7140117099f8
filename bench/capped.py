"""Behind vertexai's cap of 1 on the fleet: ``grant_to_start_latency`` (one generation's end to the
next one's start, against the bare Celery round trip) and ``waiting_cpu_<n>`` (the workers' and beat's
CPU while n requests wait, against the same fleet idle)."""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from . import schedule
from .core import (
    CAP,
    CAPPED_MODEL_ID,
    CAPPED_PROVIDER,
    Context,
    Fleet,
    MeasurementError,
    Pinger,
    emit,
    label,
    option,
    phase,
    spread,
)
from .procs import log, precise_cpu_seconds

PROVIDER, MODEL_ID = CAPPED_PROVIDER, CAPPED_MODEL_ID
#: Stub seconds of the generation holding the slot in waiting_cpu (it outlasts the phase).
HOLD_S = 600
#: Stub seconds of the generation holding the slot while the chain is submitted.
BLOCK_S = 2
#: Seconds let pass before each CPU window (the last step's work winds down).
SETTLE_S = 3.0
#: Pings on each side of the chain, and concurrent submitters of the chain.
PINGS, SUBMITTERS = 20, 8


def add_arguments(parser) -> None:
    group = parser.add_argument_group("behind a cap of 1 (grant_to_start, waiting_cpu)")
    option(group, "--grant-chain", 40, "short generations run one after another behind vertexai's cap of 1 for "
           "grant_to_start (default 40)", minimum=2)
    option(group, "--waiting", 10_000, "requests waiting behind vertexai's cap of 1 for waiting_cpu (default 10000)")
    option(group, "--waiting-window", 20.0, "seconds of each CPU window of waiting_cpu (default 20)", minimum=0,
           above=True)


def body(text: str) -> str:
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": text}]}]})


prompt = Fleet.prompt


def _counts(fleet) -> dict[str, int]:
    return schedule.schedule_counts(fleet.services, PROVIDER)


def _require_idle(fleet, what: str) -> None:
    counts = _counts(fleet)
    if counts["queued"] or counts["running"] or counts["granted"]:
        raise MeasurementError(f"{what}: {PROVIDER} is not idle ({counts}); the phase needs it to itself")
    cap = fleet.services.catalog.max_in_flight(PROVIDER)
    if cap != CAP:
        raise MeasurementError(f"{what}: {PROVIDER}'s cap is {cap} in the fleet's catalog, not {CAP}")


def _hold_slot(fleet, latency: float, what: str) -> str:
    """Submit a ``latency`` s generation and wait until a worker runs it (it holds the slot)."""
    request_id = fleet.submit_to(MODEL_ID, body(prompt(what, latency)))
    fleet.wait_records([request_id], ("IN_PROGRESS",), timeout_s=30, interval_s=0.02)
    return request_id


# -- grant_to_start --------------------------------------------------------------------


@phase("grant_to_start", "fleet", 20)
def measure_grant_to_start(ctx: Context) -> None:
    fleet = ctx.fleet
    count = fleet.args.grant_chain
    _require_idle(fleet, "grant_to_start")
    ping = Pinger(fleet)
    try:
        for _ in range(5):
            ping()
        pings = []
        for _ in range(PINGS):
            time.sleep(0.05)
            pings.append(ping())

        blocker = _hold_slot(fleet, BLOCK_S, "block")
        bodies = [body(prompt(f"chain{i}", 0)) for i in range(count)]
        began = time.monotonic()
        with ThreadPoolExecutor(max_workers=SUBMITTERS, thread_name_prefix="chain") as pool:
            ids = list(pool.map(lambda b: fleet.submit_to(MODEL_ID, b), bodies))
        submitted_s = time.monotonic() - began
        if fleet.records([blocker])[blocker]["status"] != "IN_PROGRESS":
            raise MeasurementError(f"grant_to_start: the {BLOCK_S} s blocker ended before the {count} submits "
                                   f"did ({submitted_s:.2f} s): the chain would overlap its own submits")
        counts = _counts(fleet)
        log(f"grant_to_start: {count} submits took {submitted_s:.2f} s, all waiting behind the blocker "
            f"({counts['queued']} queued, {counts['running']} running)")
        rows = fleet.wait_records([blocker, *ids], ("COMPLETED",), timeout_s=BLOCK_S + 30 + 2 * count,
                                  interval_s=0.2)
        for _ in range(PINGS):
            time.sleep(0.05)
            pings.append(ping())
    finally:
        ping.close()

    failed = {i: r["error_type"] for i, r in rows.items() if r["error_type"] or not r["started_at"]}
    if failed:
        raise MeasurementError(f"grant_to_start: some generations failed: {dict(list(failed.items())[:3])}")
    order = sorted(rows.values(), key=lambda r: float(r["started_at"]))
    gaps = [float(b["started_at"]) - float(a["completed_at"]) for a, b in zip(order, order[1:])]
    if min(gaps) < -0.001:
        raise MeasurementError(f"grant_to_start: a generation started {-1000 * min(gaps):.1f} ms before the "
                               f"previous one ended: the cap of {CAP} did not hold")
    runs = [float(r["completed_at"]) - float(r["started_at"]) for r in order[1:]]
    span = float(order[-1]["completed_at"]) - float(order[1]["started_at"])
    log(f"grant_to_start: end -> next start {spread(gaps, 'ms', 1000)}")
    log(f"grant_to_start: claimed -> completed (a [stub:latency=0] generation) {spread(runs, 'ms', 1000)}; "
        f"the chain of "
        f"{count} took {span:.3f} s ({1000 * span / count:.1f} ms per generation)")
    log(f"grant_to_start: ping round trip {spread(pings, 'ms', 1000)}")
    emit("grant_to_start_latency", 1000 * statistics.median(gaps), "ms", 1000 * statistics.median(pings))


# -- waiting_cpu -----------------------------------------------------------------------


def _counted(fleet) -> list[str]:
    """The processes the figure sums: every Celery worker and beat."""
    return [name for name in fleet.stack.procs if name.startswith("worker") or name == "beat"]


def _cpu(fleet) -> tuple[float | None, float]:
    """The counted processes' CPU seconds: schedstat (ns) if readable, else /proc stat ticks."""
    counted = _counted(fleet)
    precise = [precise_cpu_seconds(fleet.stack.procs[n].pid) for n in counted]
    ticks = fleet.cpu()
    return (None if None in precise else sum(precise)), sum(ticks.get(n, 0.0) for n in counted)


def _window(fleet, seconds: float, what: str) -> float:
    """Sleep ``seconds``; the cores the workers and beat used meanwhile (schedstat: /proc stat's
    10 ms ticks are too coarse for an idle fleet's ratio)."""
    began, (precise0, ticks0) = time.monotonic(), _cpu(fleet)
    time.sleep(seconds)
    fleet.alive()
    wall, (precise1, ticks1) = time.monotonic() - began, _cpu(fleet)
    used = precise1 - precise0 if precise0 is not None and precise1 is not None else ticks1 - ticks0
    log(f"waiting_cpu: {what}: workers + beat {used:.3f} CPU s over {wall:.1f} s = {used / wall:.4f} cores "
        f"(/proc stat utime+stime {ticks1 - ticks0:.2f} s)")
    return used / wall


# last: it leaves vertexai's one slot held by a long generation
@phase("waiting_cpu", "fleet", 60)
def measure_waiting_cpu(ctx: Context) -> None:
    fleet = ctx.fleet
    args = fleet.args
    count, window = args.waiting, args.waiting_window
    _require_idle(fleet, "waiting_cpu")
    holder = _hold_slot(fleet, HOLD_S, "hold")
    entry = fleet.services.catalog.by_id(MODEL_ID)
    log(f"waiting_cpu: {holder} holds {PROVIDER}'s one slot ([stub:latency={HOLD_S}]); "
        f"windows of {window:g} s after {SETTLE_S:g} s settling each")

    def check(queued: int, when: str) -> None:
        counts = _counts(fleet)
        status = fleet.records([holder])[holder]["status"]
        if counts["queued"] != queued or counts["running"] != 1 or counts["granted"] or status != "IN_PROGRESS":
            raise MeasurementError(f"waiting_cpu: {when}: {counts}, the holder {status}; expected {queued} "
                                   "queued behind the one running holder")

    check(0, "before the idle window")
    time.sleep(SETTLE_S)
    idle_before = _window(fleet, window, "idle, slot held, nothing waiting")

    started = time.monotonic()
    ids = schedule.seed_spread(fleet.services, [fleet.workspace], entry, count, body(prompt("waiting", 0)))
    check(count, "after admitting")
    log(f"waiting_cpu: admitted {count} requests (RequestStore.admit, pipelined) in "
        f"{time.monotonic() - started:.1f} s; all waiting, none granted")
    time.sleep(SETTLE_S)
    waiting = _window(fleet, window, f"{count} waiting")
    check(count, "after the waiting window")

    started = time.monotonic()
    cancelled = schedule.cancel_all(fleet.services, ids, fleet.workspace, entry)
    check(0, "after cancelling")
    log(f"waiting_cpu: cancelled the {cancelled} (RequestStore.cancel, pipelined) in "
        f"{time.monotonic() - started:.1f} s")
    time.sleep(SETTLE_S)
    idle_after = _window(fleet, window, "idle again, slot held, nothing waiting")
    baseline = (idle_before + idle_after) / 2
    log(f"waiting_cpu: idle {idle_before:.4f} and {idle_after:.4f} cores (baseline: their mean), "
        f"{count} waiting {waiting:.4f} cores; the holder runs on ({HOLD_S} s) until the fleet stops")
    emit(f"waiting_cpu_{label(count)}", waiting, "cores", baseline)
