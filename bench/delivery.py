"""The delivery phases on the shared fleet: ``dispatch_latency`` and ``grant_to_start_latency`` against the
bare Celery round trip, ``inflight_<n>_completion`` (n generations at once against one alone), and
``waiting_cpu_<n>`` (the workers' and beat's CPU while n requests wait behind vertexai's cap of 1, against
the same fleet idle)."""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from . import schedule
from .core import (
    CAP,
    CAPPED_MODEL_ID,
    CAPPED_PROVIDER,
    COMPLETED,
    IN_PROGRESS,
    Context,
    Fleet,
    MeasurementError,
    Pinger,
    cpu_seconds,
    emit,
    label,
    log,
    median_round,
    option,
    phase,
    schedule_counts,
    spread,
    wait_until,
)

#: Stub seconds of the generation holding the capped slot: in waiting_cpu (it outlasts the phase), and
#: while grant_to_start's chain is submitted.
HOLD_S, BLOCK_S = 600, 2
#: Seconds let pass before each CPU window of waiting_cpu (the last step's work winds down).
SETTLE_S = 3.0


def add_arguments(parser) -> None:
    group = parser.add_argument_group("delivery figures (inflight, dispatch)")
    option(group, "--inflight", 500, "generations submitted at once for the in-flight figure")
    option(group, "--latency", 5.0, "stub generation time in seconds, [stub:latency=...]", minimum=0)
    option(group, "--submitters", 32, "concurrent HTTP submitters for the in-flight burst")
    option(group, "--inflight-rounds", 1, "(one alone, n at once) rounds; the median-ratio round is reported")
    option(group, "--inflight-timeout", 300.0, "seconds the n generations may take before the figure fails",
           minimum=0, above=True)
    option(group, "--samples", 50, "dispatch samples (and as many pings), interleaved")
    group = parser.add_argument_group("behind a cap of 1 (grant_to_start, waiting_cpu)")
    option(group, "--grant-chain", 40, "generations run one after another behind the cap for grant_to_start",
           minimum=2)
    option(group, "--waiting", 10_000, "requests waiting behind vertexai's cap of 1 for waiting_cpu")
    option(group, "--waiting-window", 20.0, "seconds of each CPU window of waiting_cpu", minimum=0, above=True)


def capped_body(text: str) -> str:
    """A body for the capped model (a Gemini prompt)."""
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": text}]}]})


def _failed(rows: dict, what: str) -> None:
    if failed := {i: r["error_type"] for i, r in rows.items() if r["error_type"] or not r["started_at"]}:
        raise MeasurementError(f"{what}: some generations failed: {dict(list(failed.items())[:3])}")


# -- dispatch --------------------------------------------------------------------------


@phase("dispatch", "fleet", 10)
def measure_dispatch(ctx: Context) -> None:
    """Admitted -> claimed of sequential submits vs publish -> run -> answer of a ping, interleaved."""
    fleet, ping = ctx.fleet, Pinger(ctx.fleet)

    def dispatch() -> tuple[float, float]:
        """(admitted -> claimed, HTTP submit) in seconds; waits for COMPLETED so the fleet is idle again."""
        began = time.perf_counter()
        request_id = fleet.submit(fleet.prompt("dispatch", 0))
        submit_s = time.perf_counter() - began
        rows = fleet.wait_records([request_id], (COMPLETED,), timeout_s=30, interval_s=0.005)
        _failed(rows, "dispatch")
        return float(rows[request_id]["started_at"]) - float(rows[request_id]["created_at"]), submit_s

    log("dispatch: warm-up (5 pings, 5 submits)")
    try:
        for _ in range(5):
            ping()
            dispatch()
        pings, claims, submits = [], [], []
        for _ in range(fleet.args.samples):
            pings += ping.sample(1)  # idle between samples: none starts while the last one winds down
            time.sleep(0.05)
            claim_s, submit_s = dispatch()
            claims.append(claim_s)
            submits.append(submit_s)
    finally:
        ping.close()
    log(f"dispatch: ping round trip {spread(pings, 'ms', 1000)}")
    log(f"dispatch: admitted -> claimed {spread(claims, 'ms', 1000)}")
    log(f"dispatch: HTTP submit (answered 201) {spread(submits, 'ms', 1000)}")
    emit("dispatch_latency", 1000 * statistics.median(claims), "ms", 1000 * statistics.median(pings))


# -- grant_to_start ----------------------------------------------------------------------


def _require_idle(fleet: Fleet, what: str) -> None:
    counts = schedule_counts(fleet.client, CAPPED_PROVIDER)
    if counts["queued"] or counts["running"] or counts["granted"]:
        raise MeasurementError(f"{what}: {CAPPED_PROVIDER} is not idle ({counts}); the phase needs it to itself")
    if (cap := fleet.services.catalog.max_in_flight(CAPPED_PROVIDER)) != CAP:
        raise MeasurementError(f"{what}: {CAPPED_PROVIDER}'s cap is {cap} in the fleet's catalog, not {CAP}")


def _hold_slot(fleet: Fleet, latency: float, what: str) -> str:
    """Submit a ``latency`` s generation and wait until a worker runs it (it holds the slot)."""
    request_id = fleet.submit_to(CAPPED_MODEL_ID, capped_body(fleet.prompt(what, latency)))
    fleet.wait_records([request_id], (IN_PROGRESS,), timeout_s=30, interval_s=0.02)
    return request_id


@phase("grant_to_start", "fleet", 20)
def measure_grant_to_start(ctx: Context) -> None:
    fleet, count = ctx.fleet, ctx.fleet.args.grant_chain
    _require_idle(fleet, "grant_to_start")
    ping = Pinger(fleet)
    try:
        for _ in range(5):
            ping()
        pings = ping.sample(20)
        blocker = _hold_slot(fleet, BLOCK_S, "block")
        bodies = [capped_body(fleet.prompt(f"chain{i}", 0)) for i in range(count)]
        began = time.monotonic()
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="chain") as pool:
            ids = list(pool.map(lambda b: fleet.submit_to(CAPPED_MODEL_ID, b), bodies))
        submitted_s = time.monotonic() - began
        if fleet.records([blocker])[blocker]["status"] != IN_PROGRESS:
            raise MeasurementError(f"grant_to_start: the {BLOCK_S} s blocker ended before the {count} submits "
                                   f"did ({submitted_s:.2f} s): the chain would overlap its own submits")
        counts = schedule_counts(fleet.client, CAPPED_PROVIDER)
        log(f"grant_to_start: {count} submits took {submitted_s:.2f} s, all waiting behind the blocker "
            f"({counts['queued']} queued, {counts['running']} running)")
        rows = fleet.wait_records([blocker, *ids], (COMPLETED,), timeout_s=BLOCK_S + 30 + 2 * count,
                                  interval_s=0.2)
        pings += ping.sample(20)
    finally:
        ping.close()
    _failed(rows, "grant_to_start")
    order = sorted(rows.values(), key=lambda r: float(r["started_at"]))
    gaps = [float(b["started_at"]) - float(a["completed_at"]) for a, b in zip(order, order[1:])]
    if min(gaps) < -0.001:
        raise MeasurementError(f"grant_to_start: a generation started {-1000 * min(gaps):.1f} ms before the "
                               f"previous one ended: the cap of {CAP} did not hold")
    runs = [float(r["completed_at"]) - float(r["started_at"]) for r in order[1:]]
    span = float(order[-1]["completed_at"]) - float(order[1]["started_at"])
    log(f"grant_to_start: end -> next start {spread(gaps, 'ms', 1000)}")
    log(f"grant_to_start: claimed -> completed (a [stub:latency=0] generation) {spread(runs, 'ms', 1000)}; "
        f"the chain of {count} took {span:.3f} s ({1000 * span / count:.1f} ms per generation)")
    log(f"grant_to_start: ping round trip {spread(pings, 'ms', 1000)}")
    emit("grant_to_start_latency", 1000 * statistics.median(gaps), "ms", 1000 * statistics.median(pings))


# -- inflight --------------------------------------------------------------------------


def one_alone(fleet: Fleet, latency: float) -> float:
    """Seconds from submit to the record's ``completed_at`` of one generation (polled over HTTP): the same
    clock the n-at-once figure reads."""
    began = time.time()
    request_id = fleet.submit(fleet.prompt("alone", latency))
    wait_until(lambda: fleet.status(request_id) == COMPLETED, latency + 120,
               f"the lone generation {request_id} did not complete", 0.1, fleet.alive)
    row = fleet.records([request_id])[request_id]
    if row["error_type"]:
        raise MeasurementError(f"the lone generation completed with {row['error_type']}")
    return float(row["completed_at"]) - began


def many_at_once(fleet: Fleet, count: int, latency: float) -> float:
    """Seconds from the first of ``count`` submits until the last of them is COMPLETED."""
    args = fleet.args
    prompts = [fleet.prompt(f"inflight{i}", latency) for i in range(count)]
    cpu_before, began = fleet.cpu(), time.time()
    with ThreadPoolExecutor(max_workers=args.submitters, thread_name_prefix="submit") as pool:
        ids = list(pool.map(fleet.submit, prompts))
    submitted_s = time.time() - began
    log(f"inflight: {count} submits ({args.submitters} concurrent) took {submitted_s:.2f} s "
        f"({count / submitted_s:.0f}/s)")
    rows = fleet.wait_records(ids, (COMPLETED,), timeout_s=args.inflight_timeout, interval_s=0.5, progress_s=2.0)
    used = {name: seconds - cpu_before.get(name, 0.0) for name, seconds in fleet.cpu().items()}
    if failed := Counter(row["error_type"] for row in rows.values() if row["error_type"]):
        raise MeasurementError(f"inflight: of {count} generations, some completed with errors: {dict(failed)}")
    value = max(float(r["completed_at"]) for r in rows.values()) - began
    waits = [float(r["started_at"]) - float(r["created_at"]) for r in rows.values()]
    log(f"inflight: last of {count} completed {value:.3f} s after the first submit; admitted -> claimed "
        f"{spread(waits, 's')}; CPU s: "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(used.items(), key=lambda kv: -kv[1])))
    return value


@phase("inflight", "fleet", 30)
def measure_inflight(ctx: Context) -> None:
    fleet, args = ctx.fleet, ctx.args
    rounds = []
    for round_no in range(1, args.inflight_rounds + 1):
        alone = one_alone(fleet, args.latency)
        many = many_at_once(fleet, args.inflight, args.latency)
        rounds.append((alone, many))
        log(f"inflight round {round_no}/{args.inflight_rounds}: one alone {alone:.3f} s; "
            f"{args.inflight} at once {many:.3f} s; ratio {many / alone:.3f}")
    alone, many = median_round(rounds, lambda alone, many: many / alone)
    emit(f"inflight_{args.inflight}_completion", many, "s", alone)


# -- waiting_cpu -----------------------------------------------------------------------


def _window(fleet: Fleet, seconds: float, what: str) -> float:
    """Sleep ``seconds``; the cores every Celery worker and beat used meanwhile (schedstat, ns: /proc stat's
    10 ms ticks are too coarse for an idle fleet's ratio; they are logged beside it)."""
    pids = [proc.pid for name, proc in fleet.stack.procs.items() if name.startswith("worker") or name == "beat"]

    def cpu(precise: bool) -> float | None:
        seconds = [cpu_seconds(pid, precise) for pid in pids]
        return None if None in seconds else sum(seconds)

    began, precise0, ticks0 = time.monotonic(), cpu(True), cpu(False) or 0.0
    time.sleep(seconds)
    fleet.alive()
    wall, precise1, ticks1 = time.monotonic() - began, cpu(True), cpu(False) or 0.0
    used = precise1 - precise0 if precise0 is not None and precise1 is not None else ticks1 - ticks0
    log(f"waiting_cpu: {what}: workers + beat {used:.3f} CPU s over {wall:.1f} s = {used / wall:.4f} cores "
        f"(/proc stat utime+stime {ticks1 - ticks0:.2f} s)")
    return used / wall


# last: it leaves vertexai's one slot held by a long generation
@phase("waiting_cpu", "fleet", 60)
def measure_waiting_cpu(ctx: Context) -> None:
    fleet, count, window = ctx.fleet, ctx.args.waiting, ctx.args.waiting_window
    _require_idle(fleet, "waiting_cpu")
    holder = _hold_slot(fleet, HOLD_S, "hold")
    entry = fleet.services.catalog.by_id(CAPPED_MODEL_ID)
    log(f"waiting_cpu: {holder} holds {CAPPED_PROVIDER}'s one slot ([stub:latency={HOLD_S}]); "
        f"windows of {window:g} s after {SETTLE_S:g} s settling each")

    def check(queued: int, when: str) -> None:
        counts = schedule_counts(fleet.client, CAPPED_PROVIDER)
        status = fleet.records([holder])[holder]["status"]
        if counts["queued"] != queued or counts["running"] != 1 or counts["granted"] or status != IN_PROGRESS:
            raise MeasurementError(f"waiting_cpu: {when}: {counts}, the holder {status}; expected {queued} "
                                   "queued behind the one running holder")

    def settled_window(queued: int, what: str) -> float:
        check(queued, f"before the window '{what}'")
        time.sleep(SETTLE_S)
        cores = _window(fleet, window, what)
        check(queued, f"after the window '{what}'")
        return cores

    idle_before = settled_window(0, "idle, slot held, nothing waiting")
    started = time.monotonic()
    ids = schedule.seed_spread(fleet.services, [fleet.workspace], entry, count,
                               capped_body(fleet.prompt("waiting", 0)))
    log(f"waiting_cpu: admitted {count} requests (RequestStore.admit, pipelined) in "
        f"{time.monotonic() - started:.1f} s")
    waiting = settled_window(count, f"{count} waiting")
    started = time.monotonic()
    cancelled = schedule.cancel_all(fleet.services, ids, fleet.workspace, entry)
    log(f"waiting_cpu: cancelled the {cancelled} (RequestStore.cancel, pipelined) in "
        f"{time.monotonic() - started:.1f} s")
    idle_after = settled_window(0, "idle again, slot held, nothing waiting")
    baseline = (idle_before + idle_after) / 2
    log(f"waiting_cpu: idle {idle_before:.4f} and {idle_after:.4f} cores (baseline: their mean), "
        f"{count} waiting {waiting:.4f} cores; the holder runs on ({HOLD_S} s) until the fleet stops")
    emit(f"waiting_cpu_{label(count)}", waiting, "cores", baseline)
