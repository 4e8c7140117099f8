"""``full_cycle``: 32 clients looping submit -> poll -> collect on a fleet of its own (the shipped
caps) and on the minimal loop built from the bare parts (bench/minimal_loop.py), in interleaved
rounds; see bench/README.md for what each figure compares."""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from . import capped
from .core import (
    CAPPED_MODEL_ID,
    COMPLETED,
    Context,
    Fleet,
    KeepAlive,
    MeasurementError,
    emit,
    median_round,
    option,
    pct,
    phase,
    redis_cpu,
    wait_http,
    with_db,
)
from .procs import ROOT, Children, cpu_seconds, free_port, log, wait_for_port

MODEL_ID = CAPPED_MODEL_ID  # one synchronous provider call
#: Seconds one cycle may take before the run fails.
CYCLE_TIMEOUT_S = 30.0
#: Seconds between runs (the last run's stragglers drain).
SETTLE_S = 0.5


def add_arguments(parser) -> None:
    group = parser.add_argument_group("full cycle against a minimal loop (full_cycle)")
    option(group, "--cycle-clients", 32, "client threads of full_cycle, each submit -> poll -> collect in a loop "
           "(default 32)")
    option(group, "--cycle-seconds", 10.0, "counted seconds per full_cycle run (default 10)", minimum=0, above=True)
    option(group, "--cycle-warmup", 2.0, "uncounted seconds before each full_cycle run's window (default 2)",
           minimum=0)
    option(group, "--cycle-rounds", 3, "interleaved (ours, minimal noop, minimal stub) rounds of full_cycle "
           "(default 3)")
    option(group, "--cycle-poll-ms", 10.0, "ms a full_cycle client sleeps before each status read (default 10)",
           minimum=0)
    option(group, "--minimal-concurrency", 2, "prefork processes of the minimal loop's Celery worker (default 2, "
           "the cores here)")
    option(group, "--minimal-web-workers", None, "gunicorn workers of the minimal loop (default: --web-workers, "
           "as the fleet's)")
    option(group, "--minimal-db", 11, "Redis database of the minimal loop, flushed before and after (default 11)")
    option(group, "--minimal-stub", "on", "also run the minimal loop with a real stub call in every round "
           "(default on)", minimum=None, choices=("on", "off"))


def check_arguments(parser, args) -> None:
    if args.minimal_db in (0, args.redis_db) or args.minimal_db in args.side_dbs:
        parser.error("--minimal-db must differ from 0, --redis-db and --side-dbs")


# -- the sides ------------------------------------------------------------------------


@dataclass
class Side:
    """One loop as the client sees it, and the processes whose CPU it is charged."""

    label: str
    port: int
    submit_path: str
    status_path: Callable[[str], str]
    result_path: Callable[[str], str]
    headers: dict[str, str]
    #: process group -> PIDs (each counted with its direct children, /proc)
    groups: dict[str, list[int]]


@dataclass
class Snapshot:
    at: float
    cpu: dict[str, float]
    redis_cpu: float
    calls: Counter  # INFO commandstats calls per command, those inside scripts included
    usec: Counter  # and the µs Redis spent in each (a script's include its commands')


@dataclass
class Run:
    side: str
    deliveries: int
    seconds: float
    latencies_ms: list[float]
    cpu_s: dict[str, float]          # group -> CPU s over the window (redis and the client included)
    redis_cpu_s: float
    calls: Counter  # per command over the window
    usec: Counter
    polls: int

    @property
    def rate(self) -> float:
        return self.deliveries / self.seconds

    @property
    def p99(self) -> float:
        return pct(self.latencies_ms, 0.99)

    def per_delivery_ms(self, seconds: float) -> float:
        return 1000.0 * seconds / self.deliveries

    @property
    def redis_ms(self) -> float:
        return self.per_delivery_ms(self.redis_cpu_s)

    @property
    def commands_per_delivery(self) -> float:
        return sum(self.calls.values()) / self.deliveries

    def top_commands(self, n: int = 10) -> str:
        return " ".join(f"{name} {calls / self.deliveries:.1f}" for name, calls in self.calls.most_common(n))

    @property
    def script_ms(self) -> float:
        """Redis's ms per delivery inside scripts, their commands included (commandstats)."""
        return sum(self.usec[name] for name in ("evalsha", "eval")) / 1000.0 / self.deliveries

    @property
    def total_cpu_s(self) -> float:
        return sum(self.cpu_s.values())


def _snapshot(side: Side, redis_client) -> Snapshot:
    cpu = {}
    for group, pids in side.groups.items():
        cpu[group] = sum(cpu_seconds(pid) or 0.0 for pid in pids)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu["client"] = usage.ru_utime + usage.ru_stime
    stats = redis_client.info("commandstats")
    calls = Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})
    usec = Counter({name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()})
    return Snapshot(time.perf_counter(), cpu, redis_cpu(redis_client), calls, usec)


def _prompt_body(label: str) -> bytes:
    return capped.body(f"bench cycle {label} {uuid.uuid4().hex} [stub:latency=0]").encode()


def run_once(side: Side, args, redis_client, alive: Callable[[], None]) -> Run:
    """The clients on ``side`` for warm-up + window; the window's deliveries, latencies and costs."""
    stop = threading.Event()
    lock = threading.Lock()
    done: list[tuple[float, float]] = []  # (collected at, latency s)
    polls = [0]
    errors: list[str] = []
    poll_s = args.cycle_poll_ms / 1000.0
    post_headers = {**side.headers, "Content-Type": "application/json"}

    def request(conn: KeepAlive, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] = side.headers) -> tuple[int, bytes]:
        return conn.call(method, path, headers, body)[1:]

    def client(number: int) -> None:
        conn = KeepAlive(f"http://127.0.0.1:{side.port}", timeout_s=CYCLE_TIMEOUT_S)
        try:
            while not stop.is_set():
                body = _prompt_body(f"{side.label}{number}")
                began = time.perf_counter()
                code, answer = request(conn, "POST", side.submit_path, body, post_headers)
                if code != 201:
                    raise MeasurementError(f"a submit answered {code}: {answer[:200]!r}")
                request_id = json.loads(answer)["request_id"]
                status_path = side.status_path(request_id)
                n = 0
                while True:
                    time.sleep(poll_s)
                    code, answer = request(conn, "GET", status_path)
                    n += 1
                    if code != 200:
                        raise MeasurementError(f"a status read answered {code}: {answer[:200]!r}")
                    if json.loads(answer)["status"] == COMPLETED:
                        break
                    if time.perf_counter() - began > CYCLE_TIMEOUT_S:
                        raise MeasurementError(f"request {request_id} not COMPLETED within {CYCLE_TIMEOUT_S} s")
                code, answer = request(conn, "GET", side.result_path(request_id))
                ended = time.perf_counter()
                if code != 200 or not answer:
                    raise MeasurementError(f"a result read answered {code}: {answer[:200]!r}")
                with lock:
                    done.append((ended, ended - began))
                    polls[0] += n
        except Exception as exc:  # noqa: BLE001 - reported once, below
            errors.append(f"client {number}: {exc!r}")
            stop.set()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(n,), name=f"cycle-{n}", daemon=True)
               for n in range(args.cycle_clients)]
    for thread in threads:
        thread.start()
    stop.wait(args.cycle_warmup)
    before = _snapshot(side, redis_client)
    with lock:
        polls_before = polls[0]
    stop.wait(args.cycle_seconds)
    after = _snapshot(side, redis_client)
    with lock:
        polls_after = polls[0]
    stop.set()
    for thread in threads:
        thread.join(CYCLE_TIMEOUT_S + 5)
    alive()
    if errors:
        raise MeasurementError(f"full_cycle {side.label}: " + "; ".join(errors[:3]))
    window = [(at, lat) for at, lat in done if before.at <= at <= after.at]
    if not window:
        raise MeasurementError(f"full_cycle {side.label}: no delivery completed in the window")
    return Run(side.label, len(window), after.at - before.at, [1000.0 * lat for _, lat in window],
               {g: after.cpu[g] - before.cpu.get(g, 0.0) for g in after.cpu},
               after.redis_cpu - before.redis_cpu, after.calls - before.calls, after.usec - before.usec,
               polls_after - polls_before)


def _describe(run: Run) -> str:
    cores = os.cpu_count() or 1
    groups = " ".join(f"{g} {run.per_delivery_ms(s):.2f}" for g, s in run.cpu_s.items())
    total = run.total_cpu_s + run.redis_cpu_s
    return (f"{run.rate:.1f} deliveries/s, latency p50 {pct(run.latencies_ms, 0.5):.1f} p99 {run.p99:.1f} ms, "
            f"{run.polls / run.deliveries:.2f} status reads per delivery; CPU ms/delivery: {groups} "
            f"redis {run.redis_ms:.2f} = {run.per_delivery_ms(total):.2f} "
            f"({total / run.seconds:.2f} of {cores} cores busy with these); "
            f"Redis {run.commands_per_delivery:.1f} commands/delivery (those inside scripts included; "
            f"the most run: {run.top_commands()}; {run.script_ms:.3f} ms of it per delivery in scripts)")


# -- the minimal loop's processes --------------------------------------------------------


class MinimalLoop:
    """bench/minimal_loop.py served by gunicorn and run by a prefork Celery worker (bench children)."""

    def __init__(self, args, children: Children, redis_url: str, stub_url: str):
        self.args = args
        self.children = children
        self.redis_url = redis_url
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY")}
        self.env.update({
            "MINIMAL_REDIS_URL": redis_url,
            "MINIMAL_STUB_URL": stub_url,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        })
        self.names = ("minimal-web", "minimal-worker")
        self.web = None
        self.worker = None

    def start(self) -> None:
        from .minimal_loop import QUEUE, WEB_SERVING

        workers = self.args.minimal_web_workers or self.args.web_workers
        self.web = self.children.spawn("minimal-web", [
            sys.executable, "-m", "gunicorn", "--workers", str(workers), *WEB_SERVING, "--timeout", "660",
            "--bind", f"127.0.0.1:{self.port}", "bench.minimal_loop:app",
        ], self.env)
        wait_for_port(self.port, timeout_s=30.0, proc=self.web)
        self.worker = self.children.spawn("minimal-worker", [
            sys.executable, "-m", "celery", "-A", "bench.minimal_loop:celery_app", "worker", "--queues", QUEUE,
            "--pool", "prefork", "--concurrency", str(self.args.minimal_concurrency), "--loglevel", "INFO",
            "--hostname", f"minimal-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
        ], self.env)
        wait_http(f"http://127.0.0.1:{self.port}/healthz", self.web)
        deadline = time.monotonic() + 60
        log_path = self.children.log_dir / "minimal-worker.log"
        while " ready." not in log_path.read_text(errors="replace"):
            self.alive()
            if time.monotonic() > deadline:
                raise MeasurementError("the minimal loop's worker was not ready within 60 s")
            time.sleep(0.2)
        log(f"minimal loop up: gunicorn {workers} gevent workers on {self.port}, Celery prefork x "
            f"{self.args.minimal_concurrency} (late acks), database {self.args.minimal_db}")

    def alive(self) -> None:
        for name, proc in (("minimal-web", self.web), ("minimal-worker", self.worker)):
            if proc is not None and proc.poll() is not None:
                raise MeasurementError(f"{name} exited; see {self.children.log_dir}/{name}.log")

    def side(self, variant: str, stub_pid: int | None) -> Side:
        groups = {"web": [self.web.pid], "workers": [self.worker.pid]}
        if stub_pid is not None:
            groups["stub"] = [stub_pid]
        return Side(f"minimal-{variant}", self.port, f"/submit/{variant}", lambda i: f"/status/{i}",
                    lambda i: f"/result/{i}", {"X-API-Key": "minimal"}, groups)

    def stop(self) -> None:
        self.children.stop(set(self.names))


# -- the phase ------------------------------------------------------------------------


@phase("full_cycle", "own_fleet", 10)
def measure(ctx: Context) -> None:
    import redis

    args, children, redis_url = ctx.args, ctx.children, ctx.redis_url

    minimal_url = with_db(redis_url, args.minimal_db)
    minimal_client = redis.Redis.from_url(minimal_url)
    minimal_client.flushdb()
    fleet = Fleet(args, children, redis_url, caps={}, log_prefix="cycle-")
    minimal = None
    try:
        fleet.start()
        minimal = MinimalLoop(args, children, minimal_url, fleet.stub)
        minimal.start()
        stack = fleet.stack.procs
        ours = Side("ours", fleet.web_port, f"/v2/models/{MODEL_ID}/requests",
                    lambda i: f"/v2/models/{MODEL_ID}/requests/{i}/status",
                    lambda i: f"/v2/models/{MODEL_ID}/requests/{i}", fleet.auth,
                    {"web": [stack["web"].pid],
                     "workers": [p.pid for n, p in stack.items() if n.startswith("worker") or n == "beat"],
                     "stub": [stack["stub"].pid]})
        sides = [ours, minimal.side("noop", None)]
        if args.minimal_stub == "on":
            sides.append(minimal.side("stub", stack["stub"].pid))

        def alive() -> None:
            fleet.alive()
            minimal.alive()

        client = fleet.client
        log(f"full_cycle: {args.cycle_clients} clients, submit -> status every {args.cycle_poll_ms:g} ms -> "
            f"collect; {args.cycle_warmup:g} s warm-up + {args.cycle_seconds:g} s counted per run; "
            f"{args.cycle_rounds} rounds of {', '.join(s.label for s in sides)}")
        rounds: list[dict[str, Run]] = []
        for round_no in range(1, args.cycle_rounds + 1):
            runs = {}
            for side in sides:
                runs[side.label] = run_once(side, args, client, alive)
                log(f"full_cycle round {round_no}/{args.cycle_rounds} {side.label}: {_describe(runs[side.label])}")
                time.sleep(SETTLE_S)
            rounds.append(runs)
    finally:
        if minimal is not None:
            minimal.stop()
        fleet.stop()
        _flush(minimal_client, args.minimal_db)

    pairs = [(r["ours"], r["minimal-noop"]) for r in rounds]
    stub_pairs = [(r["ours"], r["minimal-stub"]) for r in rounds] if args.minimal_stub == "on" else []
    o, m = median_round(pairs, lambda o, m: o.rate / m.rate)
    emit("full_cycle_throughput", o.rate, "deliveries/s", m.rate)
    o, m = median_round(pairs, lambda o, m: o.p99 / m.p99)
    emit("full_cycle_p99", o.p99, "ms", m.p99)
    o, m = median_round(pairs, lambda o, m: o.redis_ms / m.redis_ms)
    emit("redis_cpu_per_delivery", o.redis_ms, "ms", m.redis_ms)
    o, m = median_round(pairs, lambda o, m: o.commands_per_delivery / m.commands_per_delivery)
    emit("redis_commands_per_delivery", o.commands_per_delivery, "commands", m.commands_per_delivery)
    if stub_pairs:
        # the floor under full_cycle_throughput: one real provider call against none
        floor = [(r["minimal-stub"], r["minimal-noop"]) for r in rounds]
        s, m = median_round(floor, lambda s, m: s.rate / m.rate)
        emit("full_cycle_floor_throughput", s.rate, "deliveries/s", m.rate)
        o, m = median_round(stub_pairs, lambda o, m: o.rate / m.rate)
        emit("full_cycle_throughput_same_call", o.rate, "deliveries/s", m.rate)
        o, m = median_round(stub_pairs, lambda o, m: o.p99 / m.p99)
        emit("full_cycle_p99_same_call", o.p99, "ms", m.p99)


def _flush(client, db: int) -> None:
    try:
        client.flushdb()
    except Exception as exc:  # noqa: BLE001 - best effort at the end
        log(f"could not flush database {db} at the end: {exc}")
