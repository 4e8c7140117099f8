"""``streams``: status reads while ``--streams`` idle event streams sit open on one running
generation, against the same reads with none open; and the web CPU the idle streams cost."""

from __future__ import annotations

import selectors
import socket
import time
import uuid
from typing import Any

from .core import Context, MeasurementError, emit, option, pct, phase
from .procs import cpu_seconds, log
from .sync_held import MODEL_ID, read_series, speech_body

#: Seconds over which the web processes' CPU is taken, with and without streams.
IDLE_WINDOW_S = 5.0


def add_arguments(parser) -> None:
    group = parser.add_argument_group("event streams (streams)")
    option(group, "--streams", 1000, "event streams held open for streams (default 1000)")
    option(group, "--stream-latency", 90.0, "stub generation time of the followed request, s (default 90)",
           minimum=30)


def _web_cpu(fleet: Any) -> float:
    return cpu_seconds(fleet.stack.procs["web"].pid) or 0.0


def _cpu_percent(fleet: Any) -> float:
    before, began = _web_cpu(fleet), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    return 100.0 * (_web_cpu(fleet) - before) / (time.monotonic() - began)


class Streams:
    """``count`` event streams on one request, as raw sockets in this thread."""

    def __init__(self, port: int, path: str, api_key: str, count: int):
        self.selector = selectors.DefaultSelector()
        self.received: dict[socket.socket, bytes] = {}
        request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-API-Key: {api_key}\r\n"
                   "Accept: text/event-stream\r\n\r\n").encode()
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
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
            if chunk:
                self.received[key.fileobj] += chunk

    def all_streaming(self, deadline_s: float) -> int:
        """Drain until every stream answered 200 and its first event; how many did."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self.drain(0.2)
            ready = sum(1 for data in self.received.values()
                        if data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data and b"\nevent: " in data)
            if ready == len(self.received):
                return ready
        return ready

    def close(self) -> None:
        for sock in list(self.received):
            self.selector.unregister(sock)
            sock.close()
        self.selector.close()


@phase("streams", "fleet", 50)
def measure(ctx: Context) -> None:
    fleet = ctx.fleet
    args = fleet.args
    port = fleet.web_port
    auth = {"X-API-Key": fleet.api_key}
    base = f"/v2/models/{MODEL_ID}/requests"

    target = fleet.submit_to(MODEL_ID, speech_body(f"bench streams target {uuid.uuid4().hex}"))
    fleet.wait_records([target], ("COMPLETED",), timeout_s=30, interval_s=0.05)
    status_path = f"{base}/{target}/status"
    followed = fleet.submit_to(MODEL_ID, speech_body(f"bench streams followed {uuid.uuid4().hex} "
                                                 f"[stub:latency={args.stream_latency:g}]"))
    fleet.wait_records([followed], ("IN_PROGRESS",), timeout_s=30, interval_s=0.05)
    began = time.monotonic()

    log(f"streams: {args.held_reads} status reads from {args.held_readers} threads, no stream open")
    without = read_series(port, status_path, auth, args.held_reads, args.held_readers)
    idle_without = _cpu_percent(fleet)

    streams = Streams(port, f"{base}/{followed}/events", fleet.api_key, args.streams)
    try:
        ready = streams.all_streaming(60)
        if ready != args.streams:
            raise MeasurementError(f"streams: only {ready} of {args.streams} streams answered their first event")
        log(f"streams: {args.streams} event streams open and idle")
        idle_with = _cpu_percent(fleet)
        with_streams = read_series(port, status_path, auth, args.held_reads, args.held_readers)
        streams.drain(0)
        if time.monotonic() - began > args.stream_latency:
            raise MeasurementError("streams: the followed generation ended while measuring; raise --stream-latency")
    finally:
        streams.close()
    emit("streams_status_p50", pct(with_streams, 0.5), "ms", pct(without, 0.5))
    emit("streams_status_p99", pct(with_streams, 0.99), "ms", pct(without, 0.99))
    emit("streams_idle_web_cpu", idle_with, "%", max(idle_without, 0.01))
