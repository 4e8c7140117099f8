"""``cluster_busiest_primary_share``: the busiest primary's share of the CPU of a three-primary Redis
Cluster serving the store while three providers deliver for 100 workspaces (bench/README.md)."""

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from router_queue.dev.stack import cluster_port

from . import core
from .core import Context, MeasurementError, emit, phase
from .delivery import capped_body

#: Cluster primaries, workspaces submitting round-robin, deliveries measured.
PRIMARIES, WORKSPACES, DELIVERIES = 3, 100, 900
#: One model per provider and its body.
BODIES = {
    "bfl/flux-2-pro": lambda text: json.dumps({"prompt": text}),
    "vertexai/gemini-3.1-flash-image": capped_body,
    "openai/gpt-4o-mini-tts": lambda text: json.dumps({"input": text, "voice": "alloy"}),
}


@phase("cluster", "own_fleet", 20)
def measure(ctx: Context) -> None:
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
