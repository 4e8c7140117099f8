"""The phases on a fleet of their own: ``full_cycle`` (against the minimal loop, bench/minimal_loop.py)
and ``cluster`` (a three-primary Redis Cluster serving the store)."""

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Callable, NamedTuple

import redis

from router_queue.dev.stack import WEB_SERVING, cluster_port

from . import core
from .core import WEB_WORKERS, Context, MeasurementError, emit, log, phase
from .delivery import capped_body

#: full_cycle: the minimal loop's database; client threads, each looping submit -> poll -> collect;
#: seconds a client sleeps before each status read; seconds one cycle may take before the run fails.
MINIMAL_DB, CLIENTS, POLL_S, CYCLE_TIMEOUT_S = 11, 32, 0.01, 30.0
#: full_cycle: uncounted seconds before each run's window, its counted seconds, seconds between runs
#: (stragglers drain), interleaved (ours, minimal noop, minimal stub) rounds.
WARMUP_S, WINDOW_S, SETTLE_S, ROUNDS = 2.0, 10.0, 0.5, 3
#: cluster: primaries, workspaces submitting round-robin, deliveries measured, one model per provider.
PRIMARIES, WORKSPACES, DELIVERIES = 3, 100, 900
BODIES = {
    "bfl/flux-2-pro": lambda text: json.dumps({"prompt": text}),
    "vertexai/gemini-3.1-flash-image": capped_body,
    "openai/gpt-4o-mini-tts": lambda text: json.dumps({"input": text, "voice": "alloy"}),
}


class Side(NamedTuple):
    """A loop as its clients see it: submit to ``prefix``, poll ``{prefix}/{id}/status``, collect ``{prefix}/{id}``."""

    label: str
    port: int
    prefix: str
    headers: dict[str, str]


def _snapshot(client) -> tuple[float, float, int]:
    """(now, Redis CPU s, commands run so far: INFO commandstats calls, those inside scripts included)."""
    calls = sum(int(v["calls"]) for v in client.info("commandstats").values())
    return time.perf_counter(), core.redis_cpu(client), calls


def _client(side: Side, number: int, stop: threading.Event) -> list[tuple[float, float]]:
    """One client's cycles until ``stop``: (collected at, latency s) of each."""
    post_headers, done = {**side.headers, "Content-Type": "application/json"}, []
    try:
        with closing(core.KeepAlive(f"http://127.0.0.1:{side.port}", side.headers, CYCLE_TIMEOUT_S)) as conn:
            while not stop.is_set():
                body = capped_body(f"bench cycle {side.label}{number} {uuid.uuid4().hex} [stub:latency=0]")
                began = time.perf_counter()
                submitted = conn.call("POST", side.prefix, 201, body.encode(), post_headers)[2]
                request_id = json.loads(submitted)["request_id"]
                while True:
                    time.sleep(POLL_S)
                    answer = conn.call("GET", f"{side.prefix}/{request_id}/status", 200)[2]
                    if json.loads(answer)["status"] == core.COMPLETED:
                        break
                    if time.perf_counter() - began > CYCLE_TIMEOUT_S:
                        raise MeasurementError(f"request {request_id} not COMPLETED within {CYCLE_TIMEOUT_S} s")
                if not conn.call("GET", f"{side.prefix}/{request_id}", 200)[2]:
                    raise MeasurementError(f"the result of {request_id} was empty")
                done.append((ended := time.perf_counter(), ended - began))
        return done
    except Exception as exc:
        stop.set()
        raise MeasurementError(f"full_cycle {side.label}: client {number}: {exc!r}") from exc


def run_once(side: Side, redis_client, alive: Callable[[], None]) -> dict[str, float]:
    """The clients on ``side`` for warm-up + window; the window's figures."""
    stop = threading.Event()
    with ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(_client, side, n, stop) for n in range(CLIENTS)]
        stop.wait(WARMUP_S)
        before = _snapshot(redis_client)
        stop.wait(WINDOW_S)
        after = _snapshot(redis_client)
        stop.set()
    alive()
    window = [1000.0 * latency for c in clients for at, latency in c.result() if before[0] <= at <= after[0]]
    if not window:
        raise MeasurementError(f"full_cycle {side.label}: no delivery completed in the window")
    return {"rate": len(window) / (after[0] - before[0]), "p99": core.pct(window, 0.99),
            "redis_ms": 1000.0 * (after[1] - before[1]) / len(window), "commands": (after[2] - before[2]) / len(window)}


def start_minimal(ctx: Context, stub_url: str) -> int:
    """bench/minimal_loop.py served by gunicorn (its own gevent worker) and a prefork Celery worker: its port."""
    url = ctx.db_url(MINIMAL_DB)
    env = {k: v for k, v in core.server_env(url, MINIMAL_REDIS_URL=url, MINIMAL_STUB_URL=stub_url).items()
           if not k.startswith("CELERY")}
    web = core.start_gunicorn(ctx.children, "minimal-web", "bench.minimal_loop:app", env, WEB_WORKERS,
                              ("--worker-class", "gevent", *WEB_SERVING[2:], "--timeout", "660"))
    ctx.children.spawn("minimal-worker", [
        sys.executable, "-m", "celery", "-A", "bench.minimal_loop:celery_app", "worker", "--pool", "prefork",
        "--concurrency", "2", "--loglevel", "INFO", "--hostname", f"minimal-{os.getpid()}@%h", "--without-gossip",
        "--without-mingle"], env)
    worker_log = ctx.children.log_dir / "minimal-worker.log"
    core.wait_until(lambda: " ready." in worker_log.read_text(errors="replace"), 60,
                    "the minimal loop's worker was not ready", alive=ctx.children.alive)
    return int(web.rsplit(":", 1)[1])


@phase("full_cycle", "own_fleet", 10)
def full_cycle(ctx: Context) -> None:
    redis.Redis.from_url(ctx.db_url(MINIMAL_DB)).flushdb()
    rounds: list[dict[str, dict[str, float]]] = []
    with ctx.children.scope():
        fleet = core.Fleet(ctx.children, ctx.redis_url, caps={}, log_prefix="cycle-").start()
        port = start_minimal(ctx, fleet.stub)
        sides = [Side("ours", fleet.web_port, f"/v2/models/{core.CAPPED_MODEL_ID}/requests", fleet.auth),
                 *(Side(f"minimal-{v}", port, f"/minimal/{v}", {"X-API-Key": "minimal"}) for v in ("noop", "stub"))]
        for _ in range(ROUNDS):
            rounds.append({})
            for side in sides:
                rounds[-1][side.label] = run_once(side, fleet.client, ctx.children.alive)
                log(f"full_cycle {side.label}: " + ", ".join(f"{k} {v:.4g}" for k, v in rounds[-1][side.label].items()))
                time.sleep(SETTLE_S)

    def figure(name: str, subject: str, baseline: str, key: str, unit: str) -> None:
        """``key`` of the subject and the baseline in the round with its median ratio."""
        b, s = core.median_round(name, [(r[baseline][key], r[subject][key]) for r in rounds])
        emit(name, s, unit, b)

    figure("full_cycle_throughput", "ours", "minimal-noop", "rate", "deliveries/s")
    figure("full_cycle_p99", "ours", "minimal-noop", "p99", "ms")
    figure("redis_cpu_per_delivery", "ours", "minimal-noop", "redis_ms", "ms")
    figure("redis_commands_per_delivery", "ours", "minimal-noop", "commands", "commands")
    # the floor under full_cycle_throughput: one real provider call against none
    figure("full_cycle_floor_throughput", "minimal-stub", "minimal-noop", "rate", "deliveries/s")
    figure("full_cycle_throughput_same_call", "ours", "minimal-stub", "rate", "deliveries/s")
    figure("full_cycle_p99_same_call", "ours", "minimal-stub", "p99", "ms")


@phase("cluster", "own_fleet", 20)
def cluster(ctx: Context) -> None:
    children = ctx.children
    with children.scope():
        ports: list[int] = []
        for number in range(PRIMARIES):  # each port taken before the next is chosen
            ports.append(port := cluster_port())
            core.start_redis(children, f"cluster-node{number}", "--cluster-enabled", "yes", "--cluster-config-file",
                             f"nodes-{port}.conf", port=port)
        created = subprocess.run([core.tool("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                                  "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True,
                                 timeout=60)
        if created.returncode != 0:
            raise MeasurementError(f"cluster: redis-cli --cluster create failed: {created.stdout[-300:]}")
        nodes = [redis.Redis(port=port) for port in ports]
        core.wait_until(lambda: all(b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO") for node in nodes),
                        30, "cluster: the nodes did not agree on a cluster")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
        fleet = core.Fleet(children, url, caps={}, log_prefix="cluster-",
                           broker_url=core.start_redis(children, "cluster-broker")).start()
        callers = []
        for n in range(WORKSPACES):
            workspace = core.new_workspace(fleet.services, f"cluster-{n}", max_queued=10**6, rate_limit="100000/second")
            callers.append({**fleet.post_headers, "X-API-Key": fleet.services.accounts.mint_key(workspace)})

        def deliver(n: int) -> str:
            model = list(BODIES)[n % len(BODIES)]
            body = BODIES[model](f"bench cluster {n} {time.monotonic_ns()} [stub:latency=0]")
            return fleet.submit(body, model, callers[n % len(callers)])

        before = [core.redis_cpu(node) for node in nodes]
        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(deliver, range(DELIVERIES)))
        fleet.wait_records(ids, timeout_s=300, interval_s=0.2)
        spent = [core.redis_cpu(node) - b for node, b in zip(nodes, before)]
    core.log(f"cluster: primaries' CPU per delivery {sum(spent) / DELIVERIES * 1000:.2f} ms, by primary "
             + ", ".join(f"{share / sum(spent):.2f}" for share in spent))
    emit("cluster_busiest_primary_share", max(spent) / sum(spent), "share", 1.0)
