"""The phase on a pooled fleet of its own: ``pool_failover`` (docs/POOLS.md).

Vertex AI as a pool of two locations of ``MEMBER_CAP`` slots; ``LATENCY_S``
generations arrive evenly, both members healthy, then one answering every call
with 429 (the stub's ``429_key``). A request's wait is all but its generation
(completed_at - created_at - ``LATENCY_S``). ``pool_failover_wait``: the p50
wait with one member paused against both healthy at half the pool's capacity,
where the member left carries all of it past its capacity (queueing's floor:
bench/README.md); ``pool_failover_wait_quarter_load``: the same at a quarter.
``pool_failover_wait_floor`` measures that floor: the same half load on a fleet
whose pool is the one healthy member alone, against the two healthy members.
"""

import json
import statistics
import time
from pathlib import Path

import redis

from . import core
from .core import Context, MeasurementError, emit, log, phase
from .delivery import capped_body

#: Each location's cap; the generation's seconds at the stub; requests per run; runs of each side.
MEMBER_CAP, LATENCY_S, REQUESTS, ROUNDS = 4, 0.5, 120, 2
#: Arrivals a second at full load: the pool's capacity (2 members x MEMBER_CAP / LATENCY_S).
FULL_RATE = MEMBER_CAP * 2 / LATENCY_S
LOCATIONS = ("us-central1", "europe-west4")


def pool_catalog(directory: Path, locations: tuple[str, ...] = LOCATIONS) -> Path:
    raw = json.loads((core.ROOT / "router_queue" / "catalog.json").read_text())
    raw["providers"]["vertexai"] = {"members": [
        {"name": location, "max_in_flight": MEMBER_CAP, "project": "bench", "location": location,
         "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"}} for location in locations]}
    path = directory / f"catalog-pool-{len(locations)}.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def waits(fleet: core.Fleet, paused: bool, rate: float) -> tuple[list[float], list[float]]:
    """Each request's wait and generation (s) of one run at ``rate`` a second."""
    fault = f" [stub:429_key={LOCATIONS[1]}]" if paused else ""
    ids, started = [], time.monotonic()
    for n in range(REQUESTS):
        time.sleep(max(0.0, started + n / rate - time.monotonic()))
        ids.append(fleet.submit(capped_body(fleet.prompt(f"pool{n}", LATENCY_S) + fault), core.CAPPED_MODEL_ID))
    rows = fleet.wait_records(ids, timeout_s=120, interval_s=0.2).values()
    ran = [float(r["completed_at"]) - float(r["started_at"]) for r in rows]
    return [float(r["completed_at"]) - float(r["created_at"]) - LATENCY_S for r in rows], ran


def measure(fleet: core.Fleet, share: float) -> tuple[float, float, float]:
    """(p50 wait healthy, p50 wait with one member paused, the member left's load) at ``share`` of capacity."""
    rate = FULL_RATE * share
    healthy, paused, ran = [], [], []
    for _ in range(ROUNDS):
        healthy.append(statistics.median(waits(fleet, False, rate)[0]))
        time.sleep(2)
        one_paused, generations = waits(fleet, True, rate)
        paused.append(statistics.median(one_paused))
        ran += generations
        time.sleep(2)
    load = rate * statistics.mean(ran) / MEMBER_CAP  # the member left's utilisation
    log(f"pool_failover at {share:g} of capacity ({rate:g}/s): p50 waits healthy "
        f"{', '.join(f'{w * 1000:.0f}' for w in healthy)} ms, one member paused "
        f"{', '.join(f'{w * 1000:.0f}' for w in paused)} ms; the member left {load:.2f} busy")
    return statistics.median(healthy), statistics.median(paused), load


@phase("pool_failover", "own_fleet", 30)
def pool_failover(ctx: Context) -> None:
    children = ctx.children
    with children.scope():
        fleet = core.Fleet(children, ctx.db_url(9), caps={}, log_prefix="pool-",
                           extra_env={"CATALOG_PATH": str(pool_catalog(children.log_dir))}).start()
        if fleet.services.catalog.max_in_flight("vertexai") != 2 * MEMBER_CAP:
            raise MeasurementError("pool_failover: the fleet's catalog is not the pool's")
        half = measure(fleet, 0.5)
        quarter = measure(fleet, 0.25)
        states = fleet.services.members.states("vertexai", fleet.services.catalog.members("vertexai"))
        log("pool_failover: " + "; ".join(f"{s.member}: sent {s.taken}, 429s {s.rate_limited}" for s in states))
    with children.scope():
        # queueing's floor: the member left, alone and healthy, carrying the same load
        redis.Redis.from_url(ctx.db_url(9)).flushdb()
        fleet = core.Fleet(children, ctx.db_url(9), caps={}, log_prefix="pool-alone-",
                           extra_env={"CATALOG_PATH": str(pool_catalog(children.log_dir, LOCATIONS[:1]))}).start()
        if fleet.services.catalog.max_in_flight("vertexai") != MEMBER_CAP:
            raise MeasurementError("pool_failover: the one-member fleet's catalog is not its own")
        alone = statistics.median(statistics.median(waits(fleet, False, FULL_RATE / 2)[0]) for _ in range(ROUNDS))
        log(f"pool_failover: one healthy member alone at the same load: p50 wait {alone * 1000:.0f} ms")
    emit("pool_failover_wait", 1000 * half[1], "ms", 1000 * half[0])
    emit("pool_failover_wait_floor", 1000 * alone, "ms", 1000 * half[0])
    emit("pool_failover_wait_quarter_load", 1000 * quarter[1], "ms", 1000 * quarter[0])
