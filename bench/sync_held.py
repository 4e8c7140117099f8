"""Status reads on the fleet's front door while connections are held open, against the same reads with
none: ``sync_held`` (synchronous calls held) and ``streams`` (idle event streams, and their web CPU)."""

import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import requests

from . import core
from .core import COMPLETED, Context, MeasurementError, emit, phase

MODEL_ID, PROVIDER = "openai/gpt-4o-mini-tts", "openai"
#: Timed status reads per series, reader threads (a connection each), untimed reads per reader first.
READS, READERS, WARMUP_READS = 2000, 4, 20
#: sync_held: synchronous calls held open, and the stub's generation time of each, s.
HELD, HELD_LATENCY_S = 200, 30.0
#: streams: event streams held open, the stub's generation time of the request they follow, and the
#: seconds over which the web processes' CPU is taken, with and without them.
STREAMS, STREAM_LATENCY_S, IDLE_WINDOW_S = 1000, 90.0, 5.0


def _speech(fleet: core.Fleet, text: str, wanted: str) -> str:
    """The id of a speech generation submitted now (its stub answers in one call), once it is ``wanted``."""
    request_id = fleet.submit(json.dumps({"input": f"bench {text} {uuid.uuid4().hex}", "voice": "alloy"}), MODEL_ID)
    fleet.wait_records([request_id], wanted)
    return request_id


def read_series(fleet: core.Fleet, request_id: str) -> list[float]:
    """ms of each of ``READS`` status reads of ``request_id`` from ``READERS`` keep-alive connections."""
    path = f"/v2/models/{MODEL_ID}/requests/{request_id}/status"
    start = threading.Barrier(READERS)

    def reader(number: int) -> list[float]:
        try:
            with closing(core.KeepAlive(fleet.base, fleet.auth, timeout_s=30)) as conn:
                for _ in range(WARMUP_READS):
                    conn.call("GET", path, 200)
                start.wait(timeout=60)
                return [conn.call("GET", path, 200)[0] for _ in range(READS // READERS + (number < READS % READERS))]
        except Exception as exc:
            start.abort()
            raise MeasurementError(f"status reads failed: reader {number}: {exc!r}") from exc

    with ThreadPoolExecutor(READERS) as pool:
        return [ms for series in pool.map(reader, range(READERS)) for ms in series]


def _hold(fleet: core.Fleet, number: int, answers: list[tuple]) -> None:
    """One synchronous call on its own connection; its (status, content type, error) appended to ``answers``."""
    body = json.dumps({"input": f"bench held {number} {uuid.uuid4().hex} [stub:latency={HELD_LATENCY_S:g}]",
                       "voice": "alloy"})
    try:
        answer = requests.post(f"{fleet.base}/v2/models/{MODEL_ID}", data=body.encode(), headers=fleet.post_headers,
                               timeout=HELD_LATENCY_S + 120)
        answers.append((answer.status_code, answer.headers.get("Content-Type"), answer.content[:200]))
    except Exception as exc:  # noqa: BLE001 - counted and reported by the caller
        answers.append((None, None, repr(exc)))


@phase("sync_held", "fleet", 40)  # near the end: its held generations occupy the workers' threads while they run
def measure_sync_held(ctx: Context) -> None:
    fleet = ctx.fleet
    target = _speech(fleet, "held target", COMPLETED)  # the request whose status is read

    def admitted() -> int:
        counts = core.schedule_counts(fleet.client, PROVIDER)
        return counts["running"] + counts["queued"]

    def none_answered() -> None:
        fleet.alive()
        if answers:
            raise MeasurementError(f"sync_held: {len(answers)} held calls answered before the reads ended "
                                   f"(failed, or raise HELD_LATENCY_S): {answers[:3]}")

    if admitted():
        raise MeasurementError(f"sync_held: {PROVIDER} requests running or queued before the held calls")
    without = read_series(fleet, target)
    answers: list[tuple] = []
    threads = [threading.Thread(target=_hold, args=(fleet, n, answers), daemon=True) for n in range(HELD)]
    opened, measured = time.monotonic(), False
    for thread in threads:
        thread.start()
    try:
        core.wait_until(lambda: admitted() >= HELD, min(60.0, HELD_LATENCY_S / 2),
                        f"sync_held: not all {HELD} held calls running or queued", 0.1, none_answered)
        time.sleep(1.0)  # the admissions' own work is over; the front door just holds
        held = read_series(fleet, target)
        none_answered()
        measured = True
    finally:  # wait the generations out (after a failure briefly: stopping the fleet closes what is left)
        end = opened + HELD_LATENCY_S + 120 if measured else time.monotonic() + 5
        for thread in threads:
            thread.join(max(0.1, end - time.monotonic()))
    failed = [answer for answer in answers if answer[:2] != (200, "audio/mpeg")]
    if failed or len(answers) != HELD:
        raise MeasurementError(f"sync_held: {len(failed) + HELD - len(answers)} of {HELD} held calls "
                               f"did not answer 200 audio/mpeg: {failed[:3]}")
    baseline = without + read_series(fleet, target)
    emit("sync_held_status_p50", core.pct(held, 0.5), "ms", core.pct(baseline, 0.5))
    emit("sync_held_status_p99", core.pct(held, 0.99), "ms", core.pct(baseline, 0.99))


def _first_event(sock: socket.socket) -> None:
    """Read a stream until its first event: it must have answered ``200 text/event-stream``."""
    data = b""
    try:
        while b"\nevent: " not in data and (chunk := sock.recv(65536)):
            data += chunk
    except OSError as exc:
        raise MeasurementError(f"streams: a stream gave no first event: {exc!r}") from exc
    if not (data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data and b"\nevent: " in data):
        raise MeasurementError(f"streams: a stream did not answer 200 text/event-stream and an event: {data[:200]!r}")


@phase("streams", "fleet", 50)
def measure_streams(ctx: Context) -> None:
    fleet = ctx.fleet
    target = _speech(fleet, "streams target", COMPLETED)
    followed = _speech(fleet, f"streams followed [stub:latency={STREAM_LATENCY_S:g}]", core.IN_PROGRESS)
    began = time.monotonic()
    without = read_series(fleet, target)
    idle_without = 100 * core.cores_used(fleet.pids("web"), IDLE_WINDOW_S)  # % of a core
    # the streams: raw sockets, all opened, then each read up to its first event (the rest waits in the kernel)
    request = (f"GET /v2/models/{MODEL_ID}/requests/{followed}/events HTTP/1.1\r\nHost: 127.0.0.1:{fleet.web_port}"
               f"\r\nX-API-Key: {fleet.api_key}\r\nAccept: text/event-stream\r\n\r\n").encode()
    streams: list[socket.socket] = []
    try:
        for _ in range(STREAMS):
            streams.append(socket.create_connection(("127.0.0.1", fleet.web_port), timeout=60))
            streams[-1].sendall(request)
        for sock in streams:
            _first_event(sock)
        idle_with = 100 * core.cores_used(fleet.pids("web"), IDLE_WINDOW_S)
        with_streams = read_series(fleet, target)
        if time.monotonic() - began > STREAM_LATENCY_S:
            raise MeasurementError("streams: the followed generation ended while measuring; raise STREAM_LATENCY_S")
    finally:
        for sock in streams:
            sock.close()
    emit("streams_status_p50", core.pct(with_streams, 0.5), "ms", core.pct(without, 0.5))
    emit("streams_status_p99", core.pct(with_streams, 0.99), "ms", core.pct(without, 0.99))
    emit("streams_idle_web_cpu", idle_with, "%", max(idle_without, 0.01))
