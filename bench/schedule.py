"""The schedule behind a provider's cap, seeded and driven through ``RequestStore``: the helpers the
capped figures share, and the store-only phases ``dispatch_cost`` and ``waiting_memory``."""

from __future__ import annotations

import copy
import json
import time
import uuid
from pathlib import Path
from typing import Callable

from .core import (
    Context,
    MeasurementError,
    capped_catalog,
    emit,
    log,
    median_round,
    new_workspace,
    option,
    phase,
    redis_cpu,
    schedule_counts,
    script_usec,
)

#: Admits (or cancels) sent per pipeline while seeding.
BATCH = 2000
#: What the issue allows a waiting request to cost in Redis beyond its body.
WAITING_OVERHEAD_BUDGET = 1536


def add_arguments(parser) -> None:
    group = parser.add_argument_group("dispatch cost (dispatch_cost)")
    option(group, "--cost-workspaces", 1000, "workspaces the waiting requests are spread over")
    option(group, "--cost-queue", 10_000, "requests waiting behind the cap of 1, on each side, throughout")
    option(group, "--cost-cycles", 2000, "complete -> grant -> claim cycles per run")
    option(group, "--cost-rounds", 5, "interleaved (1 workspace, many) rounds; the median-ratio round is reported")


def services_for(redis_url: str, catalog_path: Path):
    """``Services`` on ``redis_url`` whose catalog (and so the store's ``max_in_flight``) is ``catalog_path``."""
    from router_queue.services import Services
    from router_queue.settings import Settings

    return Services.build(Settings.from_env({"REDIS_URL": redis_url, "CATALOG_PATH": str(catalog_path)}))


def _pipelined(services, attr: str, fake_reply: Callable[[list, list], list], calls: list[Callable],
               expected: str, what: str) -> int:
    """Each ``fn(store)`` on a store copy whose ``<attr>`` script queues on a pipeline (``BATCH`` per round
    trip) and answers ``fake_reply``, so the store builds KEYS and ARGV; every reply must start ``expected``."""
    script = getattr(services.store, attr, None)
    if script is None:
        raise MeasurementError(f"RequestStore has no {attr} script handle; the bench needs updating")
    pipe = None

    def queue_call(keys, args, client=None):
        script(keys=keys, args=args, client=pipe)
        return fake_reply(keys, args)

    batching = copy.copy(services.store)
    setattr(batching, attr, queue_call)
    for start in range(0, len(calls), BATCH):
        pipe = services.redis.pipeline(transaction=False)
        for fn in calls[start:start + BATCH]:
            fn(batching)
        for reply in pipe.execute():
            first = reply[0] if isinstance(reply, list) and reply else reply
            if (first.decode() if isinstance(first, bytes) else str(first)) != expected:
                raise MeasurementError(f"{what}: the script answered {reply!r}")
    return len(calls)


def seed_spread(services, workspaces: list[str], entry, count: int, body: str) -> list[str]:
    """``count`` requests for ``entry`` admitted round-robin over ``workspaces`` through ``RequestStore.admit``
    on pipelines; their ids in admission order."""
    order = [workspaces[n % len(workspaces)] for n in range(count)]
    ids = [services.ids.mint(ws, entry.id) for ws in order]

    def admit(request_id: str, workspace: str):
        return lambda store: store.admit(request_id=request_id, workspace=workspace, model=entry.id,
                                         provider=entry.provider, body=body)

    _pipelined(services, "_admit", lambda keys, args: [b"ADMITTED", str(args[0]).encode(), 0],
               [admit(i, ws) for i, ws in zip(ids, order)], "ADMITTED", "seeding the schedule")
    return ids


def cancel_all(services, request_ids: list[str], workspace: str, entry) -> int:
    """Cancel waiting requests through ``RequestStore.cancel`` on pipelines; how many were cancelled."""

    def cancel(request_id: str):
        return lambda store: store.cancel(request_id=request_id, workspace=workspace, model=entry.id,
                                          provider=entry.provider)

    return _pipelined(services, "_cancel", lambda keys, args: [b"CANCELLED"], [cancel(i) for i in request_ids],
                      "CANCELLED", "cancelling the waiting requests")


def bench_lease():
    """A lease nothing reaps during a run."""
    from router_queue.store.requests import Lease

    return Lease(token=uuid.uuid4().hex, lease_s=10**6, queue_timeout_s=86400 * 365, max_takeovers=3,
                 resume_key=f"bench:{uuid.uuid4().hex}:0")


def formula_position(client, provider: str, workspace: str, request_id: str) -> int | None:
    """lib.lua's ``position()`` recomputed from the schedule's keys, for a granted or waiting request."""
    from router_queue.store import keys

    base = keys.schedule(provider)
    if (granted_rank := client.zrank(f"{base}:granted", request_id)) is not None:
        return int(granted_rank)
    if (i := client.zrank(f"{base}:ws:{workspace}", request_id)) is None:
        return None
    granted = int(client.zcard(f"{base}:granted"))
    if not (slot := client.zrange(f"{base}:wslots:{workspace}", i, i, withscores=True)):
        return granted + i
    ahead = client.zrank(f"{base}:slots", slot[0][0])
    return None if ahead is None else granted + int(ahead)


def seed_behind(services, entry, ahead: int, workspace_count: int, body: str) -> tuple[str, str]:
    """(workspace, id) of a request admitted behind ``ahead`` waiting ones, under a cap of 1 held by a claimed
    request; its position checked by admit.lua, lib.lua's formula and ``ahead``."""
    store = services.store
    if store.max_in_flight(entry.provider) != 1:
        raise MeasurementError(f"{entry.provider} is not capped at 1 in the bench's catalog copy")
    # the slot holder: admitted in a workspace of its own and claimed, so nothing else is granted
    holder_ws = new_workspace(services, "bench-holder-0")
    holder_id = services.ids.mint(holder_ws, entry.id)
    holder = store.admit(request_id=holder_id, workspace=holder_ws, model=entry.id, provider=entry.provider,
                         body=body)
    if holder.outcome != "ADMITTED" or holder.position != 0:
        raise MeasurementError(f"the slot holder was not granted at once: {holder}")
    if (code := store.claim(store.load(holder_id)[0], bench_lease())) != "CLAIMED":
        raise MeasurementError(f"claiming the slot holder answered {code}")
    workspaces = [new_workspace(services, f"bench-depth-{n}") for n in range(max(1, min(workspace_count, ahead)))]
    seed_spread(services, workspaces, entry, ahead, body)
    request_id = services.ids.mint(workspaces[0], entry.id)
    admission = store.admit(request_id=request_id, workspace=workspaces[0], model=entry.id,
                            provider=entry.provider, body=body)
    if admission.outcome != "ADMITTED":
        raise MeasurementError(f"admitting the target failed: {admission.outcome}")
    formula = formula_position(services.redis, entry.provider, workspaces[0], request_id)
    counts = schedule_counts(services.redis, entry.provider)
    if not (admission.position == formula == ahead) or counts["running"] != 1 or counts["granted"] != 0:
        raise MeasurementError(f"the target's position: admit.lua says {admission.position}, lib.lua's formula "
                               f"{formula}, expected {ahead} ({counts})")
    return workspaces[0], request_id


def time_status_reads(services, request_id: str, provider: str, count: int = 2000) -> tuple[float, float]:
    """``count`` status.lua reads through ``RequestStore.status_view``, no HTTP: (wall µs per read, the
    script's µs per read from INFO commandstats)."""
    for _ in range(100):
        services.store.status_view(request_id, provider)
    usec, began = script_usec(services.redis), time.perf_counter()
    for _ in range(count):
        services.store.status_view(request_id, provider)
    wall = time.perf_counter() - began
    return 1e6 * wall / count, (script_usec(services.redis) - usec) / count


# -- dispatch_cost ---------------------------------------------------------------------


class CycleSide:
    """One side of dispatch_cost: a database whose provider (cap 1) has a queue waiting."""

    def __init__(self, label: str, redis_url: str, catalog_path: Path, workspaces: int, queued: int):
        self.label = label
        self.services = services_for(redis_url, catalog_path)
        self.client = self.services.redis
        self.client.flushdb()
        self.entry = self.services.catalog.by_id("bfl/flux-2-pro")
        if self.services.store.max_in_flight(self.entry.provider) != 1:
            raise MeasurementError(f"{self.entry.provider} is not capped at 1 in the bench's catalog copy")
        self.granted: list[str] = []  # no broker: the grants reach this list (the Dispatcher's place)
        self.services.store.grants.publish = lambda provider, ids: self.granted.extend(ids)
        started = time.monotonic()
        names = [new_workspace(self.services, f"bench-cost-{n}") for n in range(workspaces)]
        seed_spread(self.services, names, self.entry, queued, '{"prompt": "bench"}')
        from router_queue.store import keys

        head = self.client.zrange(f"{keys.schedule(self.entry.provider)}:granted", 0, -1)
        counts = schedule_counts(self.client, self.entry.provider)
        if len(head) != 1 or counts["running"] != 1 or counts["queued"] != queued:
            raise MeasurementError(f"dispatch_cost {label}: after seeding {counts}, granted {len(head)}")
        self.current = head[0].decode()
        log(f"dispatch_cost: {label}: {queued} admitted over {workspaces} workspace(s) in "
            f"{time.monotonic() - started:.1f} s ({counts['queued'] - 1} waiting, 1 granted)")

    def run(self, cycles: int) -> tuple[float, float, int]:
        """``cycles`` x (load, claim, complete): (wall s, Redis CPU s, distinct workspaces granted)."""
        store, lease = self.services.store, bench_lease()
        seen: set[str] = set()
        cpu0, began = redis_cpu(self.client), time.perf_counter()
        for _ in range(cycles):
            record, _ = store.load(self.current)
            if (code := store.claim(record, lease)) != "CLAIMED":
                raise MeasurementError(f"dispatch_cost {self.label}: claim answered {code}")
            self.granted.clear()
            code = store.complete(record, output=b"{}", content_type="application/json")
            if code != "COMPLETED" or len(self.granted) != 1:
                raise MeasurementError(f"dispatch_cost {self.label}: complete answered {code}, "
                                       f"granted {self.granted} (the queue ran dry?)")
            seen.add(record.workspace)
            self.current = self.granted[0]
        wall = time.perf_counter() - began
        return wall, redis_cpu(self.client) - cpu0, len(seen)


@phase("dispatch_cost", "store", 10, side_dbs=True)
def measure_dispatch_cost(ctx: Context) -> None:
    args, k = ctx.args, ctx.args.cost_cycles
    catalog_path = capped_catalog(ctx.tmp, {"bfl": 1})
    queued = args.cost_queue + args.cost_rounds * k + 1  # every round leaves --cost-queue waiting at its end
    sides = (CycleSide("1 workspace", ctx.side_urls[0], catalog_path, 1, queued),
             CycleSide(f"{args.cost_workspaces} workspaces", ctx.side_urls[1], catalog_path, args.cost_workspaces,
                       queued))
    for side in sides:
        side.run(min(200, k))  # warm-up
    rounds = []
    for round_no in range(1, args.cost_rounds + 1):
        results = []
        for side in sides:
            wall, cpu, distinct = side.run(k)
            results.append((wall, cpu))
            log(f"dispatch_cost round {round_no}/{args.cost_rounds}: {side.label}: {1000 * wall / k:.3f} ms/cycle "
                f"wall, Redis CPU {1000 * cpu / k:.3f} ms/cycle; granted to {distinct} distinct workspace(s)")
        rounds.append(tuple(results))
    for side in sides:
        counts = schedule_counts(side.client, side.entry.provider)
        log(f"dispatch_cost: {side.label} at the end: {counts['queued']} queued over "
            f"{counts['workspaces']} workspace(s)")
    log("dispatch_cost: wall ratio per round: " + " ".join(f"{m[0] / o[0]:.3f}" for o, m in rounds)
        + "; Redis CPU ratio per round: " + " ".join(f"{m[1] / o[1]:.3f}" if o[1] else "nan" for o, m in rounds))
    base, subject = median_round(rounds, lambda b, s: s[0] / b[0])
    emit(f"dispatch_cost_{args.cost_workspaces}_workspaces", 1000 * subject[0] / k, "ms", 1000 * base[0] / k)
    base, subject = median_round(rounds, lambda b, s: s[1] / b[1] if b[1] else float("inf"))
    emit(f"dispatch_redis_cpu_{args.cost_workspaces}_workspaces", 1000 * subject[1] / k, "ms", 1000 * base[1] / k)
    for side in sides:
        side.client.flushdb()


@phase("waiting_memory", "store", 20, side_dbs=True)
def measure_waiting_memory(ctx: Context) -> None:
    """``memory_per_waiting_request``: Redis ``used_memory`` added per request waiting behind a capped provider,
    admitted as a submit is (a price held, an Idempotency-Key reserved), against the body plus 1.5 KiB."""
    count, entry = 1000, "bfl/flux-2-pro"
    services = services_for(ctx.side_urls[0], capped_catalog(ctx.tmp, {"bfl": 1}))
    client = services.redis
    client.flushdb()
    workspace = new_workspace(services, "memory", max_queued=10**9)
    body = json.dumps({"prompt": "a red teapot on a windowsill, morning light, " + "x" * 60})

    def admit(n: int) -> None:
        outcome = services.store.admit(request_id=services.ids.mint(workspace, entry), workspace=workspace,
                                       model=entry, provider="bfl", body=body, price=60,
                                       fingerprint=f"{n:064x}", idempotency_key_hash=f"{n:064x}")
        if outcome.outcome != "ADMITTED":
            raise MeasurementError(f"waiting_memory: admission answered {outcome.outcome}")

    admit(0)  # takes the one slot: everything after waits
    before = client.info("memory")["used_memory"]
    for n in range(1, count + 1):
        admit(n)
    added = client.info("memory")["used_memory"] - before
    per_request = added / count
    log(f"waiting_memory: {count} waiting requests added {added} bytes of used_memory: {per_request:.0f} per "
        f"request for a {len(body)}-byte body ({per_request - len(body):.0f} beyond it; one GiB holds about "
        f"{2**30 / per_request:,.0f} such waiting requests)")
    client.flushdb()
    emit("memory_per_waiting_request", per_request, "bytes", len(body) + WAITING_OVERHEAD_BUDGET)
