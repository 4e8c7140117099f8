"""The delivery phases on the whole stack: ``inflight_<n>_completion`` (n generations at once
against one alone) and ``dispatch_latency`` (admitted -> claimed on an idle fleet against the bare
Celery round trip)."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .core import COMPLETED, Context, Fleet, MeasurementError, Pinger, emit, median_round, option, phase, spread
from .procs import log


def add_arguments(parser) -> None:
    group = parser.add_argument_group("delivery figures (inflight, dispatch)")
    option(group, "--inflight", 500, "generations submitted at once for the in-flight figure (default 500)")
    option(group, "--latency", 5.0, "stub generation time in seconds, [stub:latency=...] (default 5)", minimum=0)
    option(group, "--submitters", 32, "concurrent HTTP submitters for the in-flight burst (default 32)")
    option(group, "--inflight-rounds", 1, "(one alone, n at once) rounds; the median-ratio round is reported "
           "(default 1)")
    option(group, "--inflight-timeout", 300.0, "seconds the n generations may take before the figure fails "
           "(default 300)", minimum=0, above=True)
    option(group, "--samples", 50, "dispatch samples (and as many pings), interleaved (default 50)")


# -- inflight ---------------------------------------------------------------------


def one_alone(fleet: Fleet, latency: float) -> float:
    """Seconds from submit to the record's ``completed_at`` of one generation (polled over HTTP):
    the same clock the n-at-once figure reads."""
    began = time.time()
    request_id = fleet.submit(fleet.prompt("alone", latency))
    deadline = time.monotonic() + latency + 120
    while fleet.status(request_id) != COMPLETED:
        if time.monotonic() > deadline:
            raise MeasurementError(f"the lone generation {request_id} did not complete")
        fleet.alive()
        time.sleep(0.1)
    row = fleet.records([request_id])[request_id]
    if row["error_type"]:
        raise MeasurementError(f"the lone generation completed with {row['error_type']}")
    return float(row["completed_at"]) - began


def many_at_once(fleet: Fleet, count: int, latency: float) -> float:
    """Seconds from the first of ``count`` submits until the last of them is COMPLETED."""
    args = fleet.args
    lock = threading.Lock()
    ids: list[str] = []
    prompts = [fleet.prompt(f"inflight{i}", latency) for i in range(count)]

    def one(prompt: str) -> None:
        request_id = fleet.submit(prompt)
        with lock:
            ids.append(request_id)

    cpu_before, began = fleet.cpu(), time.time()
    with ThreadPoolExecutor(max_workers=args.submitters, thread_name_prefix="submit") as pool:
        for future in [pool.submit(one, p) for p in prompts]:
            future.result()
    submitted_s = time.time() - began
    log(f"inflight: {count} submits ({args.submitters} concurrent) took {submitted_s:.2f} s "
        f"({count / submitted_s:.0f}/s)")
    rows = fleet.wait_records(ids, (COMPLETED,), timeout_s=args.inflight_timeout, interval_s=0.5, progress_s=2.0)
    used = {name: seconds - cpu_before.get(name, 0.0) for name, seconds in fleet.cpu().items()}

    failed: dict[str, int] = {}
    for row in rows.values():
        if row["error_type"]:
            failed[row["error_type"]] = failed.get(row["error_type"], 0) + 1
    if failed:
        raise MeasurementError(f"inflight: of {count} generations, some completed with errors: {failed}")
    created = [float(r["created_at"]) for r in rows.values()]
    started = [float(r["started_at"]) for r in rows.values()]
    value = max(float(r["completed_at"]) for r in rows.values()) - began

    log(f"inflight: last of {count} completed {value:.3f} s after the first submit; admitted -> claimed "
        f"{spread([s - c for s, c in zip(started, created)])}; CPU s: "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(used.items(), key=lambda kv: -kv[1])))
    return value


@phase("inflight", "fleet", 30)
def measure_inflight(ctx: Context) -> None:
    fleet = ctx.fleet
    args = fleet.args
    rounds = []
    for round_no in range(1, args.inflight_rounds + 1):
        alone = one_alone(fleet, args.latency)
        many = many_at_once(fleet, args.inflight, args.latency)
        rounds.append((alone, many))
        log(f"inflight round {round_no}/{args.inflight_rounds}: one alone {alone:.3f} s; "
            f"{args.inflight} at once {many:.3f} s; ratio {many / alone:.3f}")
    alone, many = median_round(rounds, lambda alone, many: many / alone)
    emit(f"inflight_{args.inflight}_completion", many, "s", alone)


# -- dispatch ---------------------------------------------------------------------


@phase("dispatch", "fleet", 10)
def measure_dispatch(ctx: Context) -> None:
    """Admitted -> claimed of sequential submits vs publish -> run -> answer of a ping, interleaved."""
    fleet = ctx.fleet
    args = fleet.args
    ping = Pinger(fleet)

    def dispatch() -> tuple[float, float]:
        """(admitted -> claimed, HTTP submit) in seconds; waits for COMPLETED so the fleet is idle again."""
        began = time.perf_counter()
        request_id = fleet.submit(fleet.prompt("dispatch", 0))
        submit_s = time.perf_counter() - began
        row = fleet.wait_records([request_id], (COMPLETED,), timeout_s=30, interval_s=0.005)[request_id]
        if row["error_type"] or not row["started_at"]:
            raise MeasurementError(f"dispatch: request {request_id} completed with {row['error_type']} "
                                   f"(started_at {row['started_at']})")
        return float(row["started_at"]) - float(row["created_at"]), submit_s

    warm = 5
    log(f"dispatch: warm-up ({warm} pings, {warm} submits)")
    try:
        for _ in range(warm):
            ping()
            dispatch()
        pings, claims, submits = [], [], []
        for _ in range(args.samples):
            time.sleep(0.05)  # idle between samples: no sample starts while the last one winds down
            pings.append(ping())
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
