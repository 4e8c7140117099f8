"""``sync_held``: status-read latency on the fleet's front door while ``--held`` synchronous calls are
held open, against the same reads with nothing held (before and after, pooled)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .core import Context, KeepAlive, MeasurementError, emit, option, pct, phase, summary
from .procs import log

MODEL_ID = "openai/gpt-4o-mini-tts"
PROVIDER = "openai"
#: Untimed reads per reader connection before each timed series.
WARMUP_READS = 20

def add_arguments(parser) -> None:
    group = parser.add_argument_group("status reads with synchronous calls held (sync_held)")
    option(group, "--held", 200, "synchronous calls held open for sync_held (default 200)")
    option(group, "--held-latency", 30.0, "stub generation time of each held call, s (default 30)", minimum=5)
    option(group, "--held-reads", 2000, "timed status reads per series of sync_held: before, during and after the "
           "hold (default 2000)")
    option(group, "--held-readers", 4, "threads sending the status reads, one connection each (default 4)")


# -- the status reads --------------------------------------------------------------


def read_series(port: int, path: str, headers: dict[str, str], reads: int, readers: int) -> list[float]:
    """``reads`` status reads from ``readers`` threads, one keep-alive connection each; ms per read."""
    per = [reads // readers + (1 if n < reads % readers else 0) for n in range(readers)]
    samples: list[list[float]] = [[] for _ in range(readers)]
    errors: list[str] = []
    start = threading.Barrier(readers)

    def one_reader(number: int) -> None:
        conn = KeepAlive(f"http://127.0.0.1:{port}", headers, timeout_s=30)
        try:
            def read() -> float:
                ms, status, body = conn.call("GET", path)
                if status != 200:
                    raise MeasurementError(f"a status read answered {status}: {body[:200]!r}")
                return ms

            for _ in range(WARMUP_READS):
                read()
            start.wait(timeout=60)
            samples[number].extend(read() for _ in range(per[number]))
        except Exception as exc:  # noqa: BLE001 - reported below, with the others
            errors.append(f"reader {number}: {exc!r}")
            start.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=one_reader, args=(n,), name=f"held-reader-{n}") for n in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise MeasurementError("status reads failed: " + "; ".join(errors[:3]))
    return [ms for series in samples for ms in series]


# -- the held synchronous calls ----------------------------------------------------


@dataclass
class HeldCall:
    """One synchronous call on its own connection, from its own thread."""

    body: bytes
    status: int | None = None
    content_type: str | None = None
    error: str | None = None
    sent_at: float = 0.0
    answered_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _hold(port: int, path: str, headers: dict[str, str], call: HeldCall, timeout_s: float) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        call.sent_at = time.monotonic()
        conn.request("POST", path, body=call.body, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        call.status, call.content_type = response.status, response.getheader("Content-Type")
        if response.status != 200:
            call.error = payload[:200].decode(errors="replace")
    except Exception as exc:  # noqa: BLE001 - counted and reported by the caller
        call.error = repr(exc)
    finally:
        call.answered_at = time.monotonic()
        conn.close()
        call.done.set()


def _admitted(fleet: Any) -> tuple[int, int]:
    """(running, queued) requests of the held calls' provider."""
    from router_queue.store import keys

    pipe = fleet.client.pipeline(transaction=False)
    pipe.zcard(keys.running(PROVIDER))
    pipe.zcard(keys.queue(PROVIDER))
    running, queued = pipe.execute()
    return int(running), int(queued)


def speech_body(text: str) -> str:
    """An OpenAI speech body: its stub answers after the latency in one call."""
    return json.dumps({"input": text, "voice": "alloy"})


def _answered(calls: list[HeldCall]) -> int:
    return sum(1 for call in calls if call.done.is_set())


# -- the figure ------------------------------------------------------------------------


# near the end: its held generations occupy the workers' threads while they run
@phase("sync_held", "fleet", 40)
def measure(ctx: Context) -> None:
    fleet = ctx.fleet
    args = fleet.args
    port = fleet.web_port
    auth = {"X-API-Key": fleet.api_key}
    run_path = f"/v2/models/{MODEL_ID}"

    # the request whose status is read: one finished speech generation
    target = fleet.submit_to(MODEL_ID, speech_body(f"bench held target {uuid.uuid4().hex}"))
    fleet.wait_records([target], ("COMPLETED",), timeout_s=30, interval_s=0.05)
    status_path = f"{run_path}/requests/{target}/status"
    running, queued = _admitted(fleet)
    if running or queued:
        raise MeasurementError(f"sync_held: {running} running and {queued} queued {PROVIDER} requests before "
                               "the held calls; the phase needs an idle provider")

    log(f"sync_held: {args.held_reads} status reads from {args.held_readers} threads, nothing held")
    without = read_series(port, status_path, auth, args.held_reads, args.held_readers)

    latency = args.held_latency
    calls = [HeldCall(speech_body(f"bench held {n} {uuid.uuid4().hex} [stub:latency={latency:g}]").encode())
             for n in range(args.held)]
    headers = {**auth, "Content-Type": "application/json"}
    threads = [threading.Thread(target=_hold, args=(port, run_path, headers, call, latency + 120),
                                name=f"held-{n}", daemon=True) for n, call in enumerate(calls)]
    opened = time.monotonic()
    for thread in threads:
        thread.start()
    measured = False
    try:
        deadline = opened + min(60.0, latency / 2)
        while True:
            running, queued = _admitted(fleet)
            if running + queued >= args.held:
                break
            answered = _answered(calls)
            if answered:
                errors = [c.error for c in calls if c.done.is_set() and c.error][:3]
                raise MeasurementError(f"sync_held: {answered} held calls answered before all were admitted "
                                       f"({errors})")
            if time.monotonic() > deadline:
                raise MeasurementError(f"sync_held: only {running} running + {queued} queued of {args.held} "
                                       f"held calls within {deadline - opened:.0f} s")
            fleet.alive()
            time.sleep(0.1)
        admitted_s = time.monotonic() - opened
        time.sleep(1.0)  # the admissions' own work is over; the front door just holds
        running, queued = _admitted(fleet)
        log(f"sync_held: {args.held} synchronous calls held ({running} running, {queued} queued; "
            f"all admitted {admitted_s:.2f} s after the first was sent)")
        log(f"sync_held: {args.held_reads} status reads from {args.held_readers} threads, {args.held} held")
        began = time.monotonic()
        held = read_series(port, status_path, auth, args.held_reads, args.held_readers)
        took = time.monotonic() - began
        answered = _answered(calls)
        if answered:
            raise MeasurementError(f"sync_held: {answered} held calls were answered while the reads ran "
                                   f"(reads took {took:.1f} s; raise --held-latency)")
        log(f"sync_held: with {args.held} held {summary(held)} (the reads took {took:.2f} s)")
        measured = True
    finally:
        # release: the generations end on their own at the stub's latency; wait them out (after a
        # failure only briefly: stopping the fleet closes what is left)
        end = opened + latency + 120 if measured else time.monotonic() + 5
        for thread in threads:
            thread.join(max(0.1, end - time.monotonic()))
    failed = [c for c in calls if c.status != 200 or c.content_type != "audio/mpeg"]
    spans = [c.answered_at - c.sent_at for c in calls if c.answered_at is not None]
    log(f"sync_held: the held calls ended {summary([s * 1000 for s in spans]) if spans else 'never'} "
        f"after being sent")
    if failed:
        sample = [(c.status, c.content_type, c.error) for c in failed[:3]]
        raise MeasurementError(f"sync_held: {len(failed)} of {args.held} held calls did not answer "
                               f"200 audio/mpeg: {sample}")

    after = read_series(port, status_path, auth, args.held_reads, args.held_readers)
    baseline = without + after
    emit("sync_held_status_p50", pct(held, 0.5), "ms", pct(baseline, 0.5))
    emit("sync_held_status_p99", pct(held, 0.99), "ms", pct(baseline, 0.99))
