"""``cluster_busiest_primary_share``: the store on a Redis Cluster of three primaries (no replicas),
Celery's broker on a Redis of its own, deliveries to three providers from 100 workspaces; the
busiest primary's share of the primaries' CPU over the load (baseline 1: one primary does it all)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from router_queue.dev.stack import cluster_port

from .core import (
    Context,
    Fleet,
    MeasurementError,
    emit,
    http_json,
    log,
    option,
    phase,
    redis_cpu,
    start_redis,
    wait_for_port,
)

PRIMARIES = 3
#: One model per provider, with a body its stub answers at once.
BODIES = {
    "bfl/flux-2-pro": lambda text: {"prompt": f"{text} [stub:latency=0]"},
    "vertexai/gemini-3.1-flash-image": lambda text: {
        "contents": [{"role": "user", "parts": [{"text": f"{text} [stub:latency=0]"}]}]},
    "openai/gpt-4o-mini-tts": lambda text: {"input": f"{text} [stub:latency=0]", "voice": "alloy"},
}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("cluster")
    option(group, "--cluster-workspaces", 100, "workspaces submitting in the cluster phase")
    option(group, "--cluster-deliveries", 900, "deliveries measured in the cluster phase")


def _start_cluster(ctx: Context) -> tuple[str, list[redis.Redis]]:
    """Three cluster-enabled redis-servers made one cluster; its URL and a client of each node."""
    binary, ports = shutil.which("redis-server"), []
    for number in range(PRIMARIES):
        port = cluster_port()
        proc = ctx.children.spawn(f"cluster-node{number}", [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(ctx.children.log_dir), "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf"], dict(os.environ))
        wait_for_port(port, timeout_s=30.0, proc=proc)
        ports.append(port)
    subprocess.run([shutil.which("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                    "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
    nodes = [redis.Redis(port=port) for port in ports]
    deadline = time.monotonic() + 30
    while not all(b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO") for node in nodes):
        if time.monotonic() > deadline:
            raise MeasurementError("cluster: the nodes did not agree on a cluster within 30 s")
        time.sleep(0.2)
    return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports), nodes


@phase("cluster", "own_fleet", 20)
def measure(ctx: Context) -> None:
    args, children = ctx.args, ctx.children
    url, nodes = _start_cluster(ctx)
    broker_url = start_redis(children, shutil.which("redis-server"), "cluster-broker")
    fleet = Fleet(args, children, url, caps={}, log_prefix="cluster-", broker_url=broker_url)
    try:
        fleet.start()
        accounts = fleet.services.accounts
        callers = []
        for number in range(args.cluster_workspaces):
            workspace = accounts.create_workspace(f"cluster-{number}", queue_enabled=True, credits=10**12)
            accounts.set_limits(workspace, max_queued=10**6, rate_limit="100000/second")
            callers.append({"X-API-Key": accounts.mint_key(workspace), "Content-Type": "application/json"})
        models = list(BODIES)

        def deliver(n: int) -> str:
            model = models[n % len(models)]
            body = json.dumps(BODIES[model](f"bench cluster {n} {time.monotonic_ns()}"))
            code, answer = http_json("POST", f"{fleet.base}/v2/models/{model}/requests", callers[n % len(callers)],
                                     body)
            if code != 201:
                raise MeasurementError(f"cluster: a submit to {model} answered {code}: {answer}")
            return answer["request_id"]

        before = [redis_cpu(node) for node in nodes]
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(deliver, range(args.cluster_deliveries)))
        fleet.wait_records(ids, ("COMPLETED",), timeout_s=300, interval_s=0.2, progress_s=10)
        spent = [redis_cpu(node) - b for node, b in zip(nodes, before)]
        elapsed = time.monotonic() - started
    finally:
        fleet.stop()
        children.stop({f"cluster-node{n}" for n in range(PRIMARIES)} | {"cluster-broker"})
    share = max(spent) / sum(spent)
    log(f"cluster: {len(ids)} deliveries to {len(models)} providers from {args.cluster_workspaces} workspaces "
        f"in {elapsed:.1f} s; Redis CPU per primary {', '.join(f'{1000 * s / len(ids):.3f}' for s in spent)} "
        f"ms per delivery (every key carries the one hash tag {{rq}}: one primary serves the store)")
    emit("cluster_busiest_primary_share", share, "share", 1.0)
