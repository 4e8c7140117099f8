"""Status reads on the fleet's front door while connections are held open, against the same reads with
none: ``sync_held`` (``--held`` synchronous calls) and ``streams`` (``--streams`` idle event streams, and
the web CPU they cost)."""

from __future__ import annotations

import http.client
import json
import selectors
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from .core import (
    COMPLETED,
    IN_PROGRESS,
    Context,
    Fleet,
    KeepAlive,
    MeasurementError,
    cpu_seconds,
    emit,
    log,
    option,
    pct,
    phase,
    schedule_counts,
    spread,
    wait_until,
)

MODEL_ID, PROVIDER = "openai/gpt-4o-mini-tts", "openai"
#: Untimed reads per reader connection before each timed series.
WARMUP_READS = 20
#: Seconds over which the web processes' CPU is taken, with and without streams.
IDLE_WINDOW_S = 5.0


def add_arguments(parser) -> None:
    group = parser.add_argument_group("status reads with synchronous calls held (sync_held)")
    option(group, "--held", 200, "synchronous calls held open for sync_held")
    option(group, "--held-latency", 30.0, "stub generation time of each held call, s", minimum=5)
    option(group, "--held-reads", 2000, "timed status reads per series of sync_held (before, during, after the hold)")
    option(group, "--held-readers", 4, "threads sending the status reads, one connection each")
    group = parser.add_argument_group("event streams (streams)")
    option(group, "--streams", 1000, "event streams held open for streams")
    option(group, "--stream-latency", 90.0, "stub generation time of the followed request, s", minimum=30)


def speech_body(text: str) -> str:
    """An OpenAI speech body: its stub answers after the latency in one call."""
    return json.dumps({"input": text, "voice": "alloy"})


def _speech(fleet: Fleet, text: str, wanted: str) -> str:
    """Submit a speech generation and wait until it is ``wanted``; its id."""
    request_id = fleet.submit_to(MODEL_ID, speech_body(f"bench {text} {uuid.uuid4().hex}"))
    fleet.wait_records([request_id], (wanted,), timeout_s=30, interval_s=0.05)
    return request_id


def read_series(fleet: Fleet, request_id: str) -> list[float]:
    """``--held-reads`` status reads of ``request_id`` from ``--held-readers`` threads, one keep-alive
    connection each; ms per read."""
    reads, readers = fleet.args.held_reads, fleet.args.held_readers
    path = f"/v2/models/{MODEL_ID}/requests/{request_id}/status"
    samples: list[list[float]] = [[] for _ in range(readers)]
    errors: list[str] = []
    start = threading.Barrier(readers)

    def one_reader(number: int) -> None:
        conn = KeepAlive(fleet.base, fleet.auth, timeout_s=30)

        def read() -> float:
            ms, status, body = conn.call("GET", path)
            if status != 200:
                raise MeasurementError(f"a status read answered {status}: {body[:200]!r}")
            return ms

        try:
            for _ in range(WARMUP_READS):
                read()
            start.wait(timeout=60)
            samples[number].extend(read() for _ in range(reads // readers + (number < reads % readers)))
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


# -- sync_held -------------------------------------------------------------------------


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

    def hold(self, port: int, path: str, headers: dict[str, str], timeout_s: float) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        try:
            self.sent_at = time.monotonic()
            conn.request("POST", path, body=self.body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            self.status, self.content_type = response.status, response.getheader("Content-Type")
            if response.status != 200:
                self.error = payload[:200].decode(errors="replace")
        except Exception as exc:  # noqa: BLE001 - counted and reported by the caller
            self.error = repr(exc)
        finally:
            self.answered_at = time.monotonic()
            conn.close()
            self.done.set()


# near the end: its held generations occupy the workers' threads while they run
@phase("sync_held", "fleet", 40)
def measure_sync_held(ctx: Context) -> None:
    fleet, args = ctx.fleet, ctx.args
    target = _speech(fleet, "held target", COMPLETED)  # the request whose status is read

    def admitted() -> tuple[int, int]:
        counts = schedule_counts(fleet.client, PROVIDER)
        return counts["running"], counts["queued"]

    if any(admitted()):
        raise MeasurementError(f"sync_held: {PROVIDER} requests running or queued before the held calls "
                               f"{admitted()}; the phase needs an idle provider")
    log(f"sync_held: {args.held_reads} status reads from {args.held_readers} threads, nothing held")
    without = read_series(fleet, target)

    latency = args.held_latency
    calls = [HeldCall(speech_body(f"bench held {n} {uuid.uuid4().hex} [stub:latency={latency:g}]").encode())
             for n in range(args.held)]
    threads = [threading.Thread(target=call.hold, args=(fleet.web_port, f"/v2/models/{MODEL_ID}",
                                                        fleet.post_headers, latency + 120),
                                name=f"held-{n}", daemon=True) for n, call in enumerate(calls)]
    opened = time.monotonic()
    for thread in threads:
        thread.start()
    measured = False
    try:
        def none_answered() -> None:
            fleet.alive()
            if answered := [c for c in calls if c.done.is_set()]:
                raise MeasurementError(f"sync_held: {len(answered)} held calls answered before all were admitted "
                                       f"({[c.error for c in answered if c.error][:3]})")

        wait_until(lambda: sum(admitted()) >= args.held, min(60.0, latency / 2),
                   f"sync_held: not all {args.held} held calls running or queued", 0.1, none_answered)
        admitted_s = time.monotonic() - opened
        time.sleep(1.0)  # the admissions' own work is over; the front door just holds
        running, queued = admitted()
        log(f"sync_held: {args.held} synchronous calls held ({running} running, {queued} queued; "
            f"all admitted {admitted_s:.2f} s after the first was sent)")
        log(f"sync_held: {args.held_reads} status reads from {args.held_readers} threads, {args.held} held")
        began = time.monotonic()
        held = read_series(fleet, target)
        took = time.monotonic() - began
        if answered_n := sum(c.done.is_set() for c in calls):
            raise MeasurementError(f"sync_held: {answered_n} held calls were answered while the reads ran "
                                   f"(reads took {took:.1f} s; raise --held-latency)")
        log(f"sync_held: with {args.held} held {spread(held)} (the reads took {took:.2f} s)")
        measured = True
    finally:
        # the generations end on their own at the stub's latency: wait them out (after a failure only
        # briefly: stopping the fleet closes what is left)
        end = opened + latency + 120 if measured else time.monotonic() + 5
        for thread in threads:
            thread.join(max(0.1, end - time.monotonic()))
    spans = [c.answered_at - c.sent_at for c in calls if c.answered_at is not None]
    log(f"sync_held: the held calls ended {spread(spans, 'ms', 1000)} after being sent")
    if failed := [c for c in calls if c.status != 200 or c.content_type != "audio/mpeg"]:
        raise MeasurementError(f"sync_held: {len(failed)} of {args.held} held calls did not answer 200 audio/mpeg: "
                               f"{[(c.status, c.content_type, c.error) for c in failed[:3]]}")
    baseline = without + read_series(fleet, target)
    emit("sync_held_status_p50", pct(held, 0.5), "ms", pct(baseline, 0.5))
    emit("sync_held_status_p99", pct(held, 0.99), "ms", pct(baseline, 0.99))


# -- streams ---------------------------------------------------------------------------


class Streams:
    """``count`` event streams on one request, as raw non-blocking sockets drained in this thread."""

    def __init__(self, fleet: Fleet, path: str, count: int):
        self.selector = selectors.DefaultSelector()
        self.received: dict[socket.socket, bytes] = {}
        request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{fleet.web_port}\r\nX-API-Key: {fleet.api_key}\r\n"
                   "Accept: text/event-stream\r\n\r\n").encode()
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", fleet.web_port), timeout=10)
            sock.sendall(request)
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ)
            self.received[sock] = b""

    def drain(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(timeout_s):
            try:
                chunk = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            self.received[key.fileobj] += chunk

    def all_streaming(self, deadline_s: float) -> int:
        """Drain until every stream answered 200 and its first event; how many did."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self.drain(0.2)
            ready = sum(1 for data in self.received.values()
                        if data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data and b"\nevent: " in data)
            if ready == len(self.received):
                break
        return ready

    def close(self) -> None:
        for sock in self.received:
            self.selector.unregister(sock)
            sock.close()
        self.selector.close()


def _web_cpu_percent(fleet: Fleet) -> float:
    """The web processes' CPU over ``IDLE_WINDOW_S``, in % of a core."""
    pid = fleet.stack.procs["web"].pid
    before, began = cpu_seconds(pid) or 0.0, time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    return 100.0 * ((cpu_seconds(pid) or 0.0) - before) / (time.monotonic() - began)


@phase("streams", "fleet", 50)
def measure_streams(ctx: Context) -> None:
    fleet, args = ctx.fleet, ctx.args
    target = _speech(fleet, "streams target", COMPLETED)
    followed = _speech(fleet, f"streams followed [stub:latency={args.stream_latency:g}]", IN_PROGRESS)
    began = time.monotonic()
    log(f"streams: {args.held_reads} status reads from {args.held_readers} threads, no stream open")
    without = read_series(fleet, target)
    idle_without = _web_cpu_percent(fleet)
    streams = Streams(fleet, f"/v2/models/{MODEL_ID}/requests/{followed}/events", args.streams)
    try:
        if (ready := streams.all_streaming(60)) != args.streams:
            raise MeasurementError(f"streams: only {ready} of {args.streams} streams answered their first event")
        log(f"streams: {args.streams} event streams open and idle")
        idle_with = _web_cpu_percent(fleet)
        with_streams = read_series(fleet, target)
        streams.drain(0)
        if time.monotonic() - began > args.stream_latency:
            raise MeasurementError("streams: the followed generation ended while measuring; raise --stream-latency")
    finally:
        streams.close()
    emit("streams_status_p50", pct(with_streams, 0.5), "ms", pct(without, 0.5))
    emit("streams_status_p99", pct(with_streams, 0.99), "ms", pct(without, 0.99))
    emit("streams_idle_web_cpu", idle_with, "%", max(idle_without, 0.01))
