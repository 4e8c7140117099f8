"""The phases on the shared fleet: ``dispatch``, ``grant_to_start``, ``inflight``, ``waiting_cpu``, and status
reads while connections are held open against the same with none (``sync_held``, ``streams``)."""

import json
import socket
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import requests

from . import core, schedule
from .core import CAP, CAPPED_MODEL_ID, CAPPED_PROVIDER, COMPLETED, Context, MeasurementError, emit, log, phase

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
#: sync_held and streams: the model and provider of their (speech) generations.
SPEECH_MODEL, SPEECH_PROVIDER = "openai/gpt-4o-mini-tts", "openai"
#: Timed status reads per series, reader threads (a connection each), untimed reads per reader first.
READS, READERS, WARMUP_READS = 2000, 4, 20
#: sync_held: synchronous calls held open, and the stub's generation time of each, s.
HELD, HELD_LATENCY_S = 200, 30.0
#: streams: event streams held open, the stub's generation time of the request they follow, and the
#: seconds over which the web processes' CPU is taken, with and without them.
STREAMS, STREAM_LATENCY_S, IDLE_WINDOW_S = 1000, 90.0, 5.0


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
    emit("dispatch_latency", 1000 * statistics.median(claims[WARMUP:]), "ms", 1000 * statistics.median(pings[WARMUP:]))


def _hold_slot(fleet: core.Fleet, latency: float, what: str) -> str:
    """The id of a ``latency`` s generation holding the capped provider's one slot (idle until then)."""
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
    """Seconds from the first of ``count`` submits of a ``LATENCY_S`` generation to the last ``completed_at``."""
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


def _speech(fleet: core.Fleet, text: str, wanted: str) -> str:
    """The id of a speech generation submitted now (its stub answers in one call), once it is ``wanted``."""
    request_id = fleet.submit(json.dumps({"input": f"bench {text} {uuid.uuid4().hex}", "voice": "alloy"}), SPEECH_MODEL)
    fleet.wait_records([request_id], wanted)
    return request_id


def read_series(fleet: core.Fleet, request_id: str) -> list[float]:
    """ms of each of ``READS`` status reads of ``request_id`` from ``READERS`` keep-alive connections."""
    path = f"/v2/models/{SPEECH_MODEL}/requests/{request_id}/status"
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
        answer = requests.post(f"{fleet.base}/v2/models/{SPEECH_MODEL}", data=body.encode(), headers=fleet.post_headers,
                               timeout=HELD_LATENCY_S + 120)
        answers.append((answer.status_code, answer.headers.get("Content-Type"), answer.content[:200]))
    except Exception as exc:  # noqa: BLE001 - counted and reported by the caller
        answers.append((None, None, repr(exc)))


@phase("sync_held", "fleet", 40)  # near the end: its held generations occupy the workers' threads while they run
def measure_sync_held(ctx: Context) -> None:
    fleet = ctx.fleet
    target = _speech(fleet, "held target", COMPLETED)  # the request whose status is read

    def admitted() -> int:
        counts = core.schedule_counts(fleet.client, SPEECH_PROVIDER)
        return counts["running"] + counts["queued"]

    def none_answered() -> None:
        fleet.alive()
        if answers:
            raise MeasurementError(f"sync_held: {len(answers)} held calls answered before the reads ended "
                                   f"(failed, or raise HELD_LATENCY_S): {answers[:3]}")

    if admitted():
        raise MeasurementError(f"sync_held: {SPEECH_PROVIDER} requests running or queued before the held calls")
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
    request = (f"GET /v2/models/{SPEECH_MODEL}/requests/{followed}/events HTTP/1.1\r\nHost: 127.0.0.1:{fleet.web_port}"
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
