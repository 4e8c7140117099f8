"""``full_cycle``: clients looping submit -> poll -> collect on a fleet of its own (the shipped caps) and
on the minimal loop built from the bare parts (bench/minimal_loop.py), in interleaved rounds."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from .core import (
    CAPPED_MODEL_ID,
    COMPLETED,
    ROOT,
    Context,
    Fleet,
    KeepAlive,
    MeasurementError,
    cpu_seconds,
    emit,
    flush_quietly,
    log,
    median_round,
    option,
    own_cpu,
    pct,
    phase,
    redis_cpu,
    start_gunicorn,
    wait_http,
    wait_until,
    with_db,
)
from .delivery import capped_body

#: Ours: one synchronous provider call per delivery.
OURS = f"/v2/models/{CAPPED_MODEL_ID}/requests"
#: Seconds one cycle may take before the run fails.
CYCLE_TIMEOUT_S = 30.0
#: Seconds between runs (the last run's stragglers drain).
SETTLE_S = 0.5


def add_arguments(parser) -> None:
    group = parser.add_argument_group("full cycle against a minimal loop (full_cycle)")
    option(group, "--cycle-clients", 32, "client threads of full_cycle, each submit -> poll -> collect in a loop")
    option(group, "--cycle-seconds", 10.0, "counted seconds per full_cycle run", minimum=0, above=True)
    option(group, "--cycle-warmup", 2.0, "uncounted seconds before each full_cycle run's window", minimum=0)
    option(group, "--cycle-rounds", 3, "interleaved (ours, minimal noop, minimal stub) rounds of full_cycle")
    option(group, "--cycle-poll-ms", 10.0, "ms a full_cycle client sleeps before each status read", minimum=0)
    option(group, "--minimal-concurrency", 2, "prefork processes of the minimal loop's Celery worker (default 2, "
           "the cores here)")
    option(group, "--minimal-web-workers", None, "gunicorn workers of the minimal loop (default: --web-workers, "
           "as the fleet's)")
    option(group, "--minimal-db", 11, "Redis database of the minimal loop, flushed before and after")
    option(group, "--minimal-stub", "on", "also run the minimal loop with a real stub call in every round",
           minimum=None, choices=("on", "off"))


def check_arguments(parser, args) -> None:
    if args.minimal_db in (0, args.redis_db) or args.minimal_db in args.side_dbs:
        parser.error("--minimal-db must differ from 0, --redis-db and --side-dbs")


@dataclass
class Side:
    """One loop as the client sees it (paths with ``{}`` for the id), and the processes its CPU is charged."""

    label: str
    port: int
    submit_path: str
    status_path: str
    result_path: str
    headers: dict[str, str]
    groups: dict[str, list[int]]  # process group -> PIDs (each counted with its direct children)


@dataclass
class Snapshot:
    at: float
    cpu: dict[str, float]  # per process group, the client (this process) included
    redis_cpu: float
    calls: Counter  # INFO commandstats calls per command, those inside scripts included
    usec: Counter  # and the µs Redis spent in each (a script's include its commands')

    @classmethod
    def take(cls, side: Side, client) -> Snapshot:
        cpu = {group: sum(cpu_seconds(pid) or 0.0 for pid in pids) for group, pids in side.groups.items()}
        stats = client.info("commandstats")
        return cls(time.perf_counter(), {**cpu, "client": own_cpu()}, redis_cpu(client),
                   Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}),
                   Counter({name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()}))


@dataclass
class Run:
    """One run's window: its deliveries, their latencies, and the costs over it."""

    deliveries: int
    seconds: float
    latencies_ms: list[float]
    cpu_s: dict[str, float]  # group -> CPU s (the client included)
    redis_cpu_s: float
    calls: Counter
    usec: Counter
    polls: int

    @property
    def rate(self) -> float:
        return self.deliveries / self.seconds

    @property
    def p99(self) -> float:
        return pct(self.latencies_ms, 0.99)

    @property
    def redis_ms(self) -> float:
        return 1000.0 * self.redis_cpu_s / self.deliveries

    @property
    def commands_per_delivery(self) -> float:
        return sum(self.calls.values()) / self.deliveries

    def describe(self) -> str:
        per = self.deliveries / 1000.0  # CPU ms per delivery: s / per
        total = sum(self.cpu_s.values()) + self.redis_cpu_s
        top = " ".join(f"{name} {calls / self.deliveries:.1f}" for name, calls in self.calls.most_common(10))
        script_ms = (self.usec["evalsha"] + self.usec["eval"]) / 1000.0 / self.deliveries
        return (f"{self.rate:.1f} deliveries/s, latency p50 {pct(self.latencies_ms, 0.5):.1f} p99 {self.p99:.1f} ms, "
                f"{self.polls / self.deliveries:.2f} status reads per delivery; CPU ms/delivery: "
                + " ".join(f"{g} {s / per:.2f}" for g, s in self.cpu_s.items())
                + f" redis {self.redis_ms:.2f} = {total / per:.2f} ({total / self.seconds:.2f} of "
                f"{os.cpu_count() or 1} cores busy with these); Redis {self.commands_per_delivery:.1f} "
                f"commands/delivery (those inside scripts included; the most run: {top}; {script_ms:.3f} ms of it "
                "per delivery in scripts)")


def run_once(side: Side, args, redis_client, alive) -> Run:
    """The clients on ``side`` for warm-up + window; the window's deliveries, latencies and costs."""
    stop, lock = threading.Event(), threading.Lock()
    done: list[tuple[float, float]] = []  # (collected at, latency s)
    polls = [0]
    errors: list[str] = []
    post_headers = {**side.headers, "Content-Type": "application/json"}

    def request(conn: KeepAlive, method: str, path: str, body: bytes | None = None, headers=side.headers,
                status: int = 200) -> bytes:
        code, answer = conn.call(method, path, headers, body)[1:]
        if code != status or not answer:
            raise MeasurementError(f"{method} {path} answered {code}: {answer[:200]!r}")
        return answer

    def client(number: int) -> None:
        conn = KeepAlive(f"http://127.0.0.1:{side.port}", timeout_s=CYCLE_TIMEOUT_S)
        try:
            while not stop.is_set():
                body = capped_body(f"bench cycle {side.label}{number} {uuid.uuid4().hex} [stub:latency=0]").encode()
                began = time.perf_counter()
                answer = request(conn, "POST", side.submit_path, body, post_headers, 201)
                request_id = json.loads(answer)["request_id"]
                n = 0
                while True:
                    time.sleep(args.cycle_poll_ms / 1000.0)
                    n += 1
                    if json.loads(request(conn, "GET", side.status_path.format(request_id)))["status"] == COMPLETED:
                        break
                    if time.perf_counter() - began > CYCLE_TIMEOUT_S:
                        raise MeasurementError(f"request {request_id} not COMPLETED within {CYCLE_TIMEOUT_S} s")
                request(conn, "GET", side.result_path.format(request_id))
                ended = time.perf_counter()
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
    before, polls_before = Snapshot.take(side, redis_client), polls[0]
    stop.wait(args.cycle_seconds)
    after, polls_after = Snapshot.take(side, redis_client), polls[0]
    stop.set()
    for thread in threads:
        thread.join(CYCLE_TIMEOUT_S + 5)
    alive()
    if errors:
        raise MeasurementError(f"full_cycle {side.label}: " + "; ".join(errors[:3]))
    window = [latency for at, latency in done if before.at <= at <= after.at]
    if not window:
        raise MeasurementError(f"full_cycle {side.label}: no delivery completed in the window")
    return Run(len(window), after.at - before.at, [1000.0 * latency for latency in window],
               {g: after.cpu[g] - before.cpu.get(g, 0.0) for g in after.cpu}, after.redis_cpu - before.redis_cpu,
               after.calls - before.calls, after.usec - before.usec, polls_after - polls_before)


class MinimalLoop:
    """bench/minimal_loop.py served by gunicorn and run by a prefork Celery worker (bench children)."""

    def __init__(self, ctx: Context, redis_url: str, stub_url: str):
        self.args, self.children = ctx.args, ctx.children
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY")}
        self.env.update(MINIMAL_REDIS_URL=redis_url, MINIMAL_STUB_URL=stub_url,
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.web = self.worker = None
        self.port = 0

    def start(self) -> None:
        from . import minimal_loop  # its module-level Celery app and Redis client: only when a loop runs

        workers = self.args.minimal_web_workers or self.args.web_workers
        url, self.web = start_gunicorn(self.children, "minimal-web", "bench.minimal_loop:app", self.env, workers,
                                       (*minimal_loop.WEB_SERVING, "--timeout", "660"))
        self.port = int(url.rsplit(":", 1)[1])
        self.worker = self.children.spawn("minimal-worker", [
            sys.executable, "-m", "celery", "-A", "bench.minimal_loop:celery_app", "worker", "--queues",
            minimal_loop.QUEUE, "--pool", "prefork", "--concurrency", str(self.args.minimal_concurrency),
            "--loglevel", "INFO", "--hostname", f"minimal-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
        ], self.env)
        wait_http(f"{url}/healthz", self.web)
        worker_log = self.children.log_dir / "minimal-worker.log"
        wait_until(lambda: " ready." in worker_log.read_text(errors="replace"), 60,
                   "the minimal loop's worker was not ready", alive=self.alive)
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
        return Side(f"minimal-{variant}", self.port, f"/submit/{variant}", "/status/{}", "/result/{}",
                    {"X-API-Key": "minimal"}, groups)

    def stop(self) -> None:
        self.children.stop({"minimal-web", "minimal-worker"})


@phase("full_cycle", "own_fleet", 10)
def measure(ctx: Context) -> None:
    import redis

    args = ctx.args
    minimal_url = with_db(ctx.redis_url, args.minimal_db)
    minimal_client = redis.Redis.from_url(minimal_url)
    minimal_client.flushdb()
    fleet = Fleet(args, ctx.children, ctx.redis_url, caps={}, log_prefix="cycle-")
    minimal = None
    try:
        fleet.start()
        minimal = MinimalLoop(ctx, minimal_url, fleet.stub)
        minimal.start()
        stack = fleet.stack.procs
        sides = [Side("ours", fleet.web_port, OURS, OURS + "/{}/status", OURS + "/{}", fleet.auth,
                      {"web": [stack["web"].pid],
                       "workers": [p.pid for n, p in stack.items() if n.startswith("worker") or n == "beat"],
                       "stub": [stack["stub"].pid]}),
                 minimal.side("noop", None)]
        if args.minimal_stub == "on":
            sides.append(minimal.side("stub", stack["stub"].pid))

        def alive() -> None:
            fleet.alive()
            minimal.alive()

        log(f"full_cycle: {args.cycle_clients} clients, submit -> status every {args.cycle_poll_ms:g} ms -> "
            f"collect; {args.cycle_warmup:g} s warm-up + {args.cycle_seconds:g} s counted per run; "
            f"{args.cycle_rounds} rounds of {', '.join(s.label for s in sides)}")
        rounds: list[dict[str, Run]] = []
        for round_no in range(1, args.cycle_rounds + 1):
            rounds.append({})
            for side in sides:
                run = rounds[-1][side.label] = run_once(side, args, fleet.client, alive)
                log(f"full_cycle round {round_no}/{args.cycle_rounds} {side.label}: {run.describe()}")
                time.sleep(SETTLE_S)
    finally:
        if minimal is not None:
            minimal.stop()
        fleet.stop()
        flush_quietly(minimal_client, args.minimal_db)

    def figure(name: str, pairs: list[tuple[Run, Run]], attr: str, unit: str) -> None:
        """``attr`` of (subject, baseline) in the round with its median ratio."""
        subject, baseline = median_round(pairs, lambda s, b: getattr(s, attr) / getattr(b, attr))
        emit(name, getattr(subject, attr), unit, getattr(baseline, attr))

    noop = [(r["ours"], r["minimal-noop"]) for r in rounds]
    figure("full_cycle_throughput", noop, "rate", "deliveries/s")
    figure("full_cycle_p99", noop, "p99", "ms")
    figure("redis_cpu_per_delivery", noop, "redis_ms", "ms")
    figure("redis_commands_per_delivery", noop, "commands_per_delivery", "commands")
    if args.minimal_stub == "on":
        # the floor under full_cycle_throughput: one real provider call against none
        figure("full_cycle_floor_throughput", [(r["minimal-stub"], r["minimal-noop"]) for r in rounds], "rate",
               "deliveries/s")
        same_call = [(r["ours"], r["minimal-stub"]) for r in rounds]
        figure("full_cycle_throughput_same_call", same_call, "rate", "deliveries/s")
        figure("full_cycle_p99_same_call", same_call, "p99", "ms")
