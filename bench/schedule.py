"""The schedule behind a provider's cap, seeded and driven through ``RequestStore``: the helpers the
capped figures share, and the store-only phases ``dispatch_cost`` and ``waiting_memory``."""

from __future__ import annotations

import copy
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from .core import Context, MeasurementError, capped_catalog, emit, median_round, option, phase, redis_cpu, script_usec
from .procs import log

#: Admits (or cancels) sent per pipeline while seeding.
BATCH = 2000
#: The lease a bench-side claim takes: nothing reaps it during a run.
BENCH_LEASE_S = 10**6


def add_arguments(parser) -> None:
    group = parser.add_argument_group("dispatch cost (dispatch_cost)")
    option(group, "--cost-workspaces", 1000, "workspaces the waiting requests are spread over (default 1000)")
    option(group, "--cost-queue", 10_000, "requests waiting behind the cap of 1, on each side, throughout "
           "(default 10000)")
    option(group, "--cost-cycles", 2000, "complete -> grant -> claim cycles per run (default 2000)")
    option(group, "--cost-rounds", 5, "interleaved (1 workspace, many) rounds; the median-ratio round is reported "
           "(default 5)")


# -- set-up helpers ------------------------------------------------------------------


def services_for(redis_url: str, catalog_path: Path):
    """``Services`` on ``redis_url`` with ``catalog_path`` as the catalog (so the store's
    ``max_in_flight`` is that catalog's caps)."""
    from router_queue.services import Services
    from router_queue.settings import Settings

    return Services.build(Settings.from_env({"REDIS_URL": redis_url, "CATALOG_PATH": str(catalog_path)}))


def make_workspaces(services, count: int, name: str, *, credits: int = 10**12, max_queued: int = 10**9,
                    rate_limit: str = "10000000/second") -> list[str]:
    """``count`` workspaces with queued delivery on, credits, and limits out of reach."""
    out = []
    for number in range(count):
        workspace = services.accounts.create_workspace(f"{name}-{number}", queue_enabled=True, credits=credits)
        services.accounts.set_limits(workspace, max_queued=max_queued, rate_limit=rate_limit)
        out.append(workspace)
    return out


def _pipelined(services, attr: str, fake_reply: Callable[[list, list], list], calls: Iterable[Callable],
               ok: Callable[[Any], bool], what: str) -> int:
    """Each ``fn(store)`` on a store copy whose ``<attr>`` script queues on a pipeline (``BATCH`` per
    round trip) and answers ``fake_reply``: the store builds KEYS and ARGV. Every reply must pass ``ok``."""
    store = services.store
    script = getattr(store, attr, None)
    if script is None:
        raise MeasurementError(f"RequestStore has no {attr} script handle; the bench needs updating")
    box: dict[str, Any] = {}

    def queue_call(keys, args, client=None):
        script(keys=keys, args=args, client=box["pipe"])
        return fake_reply(keys, args)

    batching = copy.copy(store)
    setattr(batching, attr, queue_call)
    done = 0
    pending = list(calls)
    for start in range(0, len(pending), BATCH):
        box["pipe"] = services.redis.pipeline(transaction=False)
        for fn in pending[start:start + BATCH]:
            fn(batching)
        replies = box["pipe"].execute()
        bad = [r for r in replies if not ok(r)]
        if bad:
            raise MeasurementError(f"{what}: the script answered {bad[0]!r}")
        done += len(replies)
    return done


def _code(reply: Any) -> str:
    first = reply[0] if isinstance(reply, list) and reply else reply
    return first.decode() if isinstance(first, bytes) else str(first)


def seed_spread(services, workspaces: list[str], entry, count: int, body: str,
                counts: list[int] | None = None) -> list[str]:
    """``count`` admitted requests for ``entry``, round-robin over ``workspaces``
    (``counts[i]`` each when given), through ``RequestStore.admit`` on pipelines.
    Returns their ids in admission order."""
    if counts is None:
        per, extra = divmod(count, len(workspaces))
        counts = [per + (1 if i < extra else 0) for i in range(len(workspaces))]
    left = list(counts)
    order: list[str] = []
    while any(left):
        for i, workspace in enumerate(workspaces):
            if left[i]:
                left[i] -= 1
                order.append(workspace)
    ids = [services.ids.mint(ws, entry.id) for ws in order]

    def admit(request_id: str, workspace: str):
        return lambda store: store.admit(request_id=request_id, workspace=workspace, model=entry.id,
                                         provider=entry.provider, body=body)

    _pipelined(services, "_admit", lambda keys, args: [b"ADMITTED", str(args[0]).encode(), 0],
               (admit(i, ws) for i, ws in zip(ids, order)), lambda r: _code(r) == "ADMITTED",
               "seeding the schedule")
    return ids


def cancel_all(services, request_ids: list[str], workspace_of: dict[str, str] | str, entry) -> int:
    """Cancel waiting requests through ``RequestStore.cancel`` on pipelines; how many were cancelled."""

    def cancel(request_id: str):
        workspace = workspace_of if isinstance(workspace_of, str) else workspace_of[request_id]
        return lambda store: store.cancel(request_id=request_id, workspace=workspace, model=entry.id,
                                          provider=entry.provider)

    return _pipelined(services, "_cancel", lambda keys, args: [b"CANCELLED"],
                      (cancel(i) for i in request_ids), lambda r: _code(r) == "CANCELLED",
                      "cancelling the waiting requests")


def bench_lease():
    from router_queue.store.requests import Lease

    return Lease(token=uuid.uuid4().hex, lease_s=BENCH_LEASE_S, queue_timeout_s=86400 * 365, max_takeovers=3,
                 resume_key=f"bench:{uuid.uuid4().hex}:0")


def hold_the_slot(services, entry, body: str) -> str:
    """Admit one request in a workspace of its own and claim it (IN_PROGRESS under a
    lease nothing reaps): it holds the provider's one slot; nothing else is granted."""
    workspace = make_workspaces(services, 1, "bench-holder")[0]
    request_id = services.ids.mint(workspace, entry.id)
    admission = services.store.admit(request_id=request_id, workspace=workspace, model=entry.id,
                                     provider=entry.provider, body=body)
    if admission.outcome != "ADMITTED" or admission.position != 0:
        raise MeasurementError(f"the slot holder was not granted at once: {admission}")
    record, _ = services.store.load(request_id)
    code = services.store.claim(record, bench_lease())
    if code != "CLAIMED":
        raise MeasurementError(f"claiming the slot holder answered {code}")
    return request_id


def schedule_counts(services, provider: str) -> dict[str, int]:
    """How many requests are queued, running (slots taken) and granted not started."""
    from router_queue.store import keys

    pipe = services.redis.pipeline(transaction=False)
    pipe.zcard(keys.queue(provider))
    pipe.zcard(keys.running(provider))
    pipe.zcard(f"{keys.schedule(provider)}:granted")
    pipe.zcard(keys.schedule_workspaces(provider))
    queued, running, granted, workspaces = pipe.execute()
    return {"queued": queued, "running": running, "granted": granted, "workspaces": workspaces}


def formula_position(client, provider: str, workspace: str, request_id: str) -> int | None:
    """lib.lua's ``position()`` recomputed here from the schedule's keys (keys.py), for a
    request that is granted or waiting; None otherwise."""
    from router_queue.store import keys

    base = keys.schedule(provider)
    granted_rank = client.zrank(f"{base}:granted", request_id)
    if granted_rank is not None:
        return int(granted_rank)
    i = client.zrank(f"{base}:ws:{workspace}", request_id)
    if i is None:
        return None
    granted = int(client.zcard(f"{base}:granted"))
    slot = client.zrange(f"{base}:wslots:{workspace}", i, i, withscores=True)
    if not slot:
        return granted + i
    ahead = client.zrank(f"{base}:slots", slot[0][0])
    return None if ahead is None else granted + int(ahead)


def seed_behind(services, entry, ahead: int, workspace_count: int, body: str) -> tuple[str, str, int]:
    """(workspace, id, position) of a request admitted behind ``ahead`` waiting ones, under a cap of 1
    held by a claimed request; the position checked by admit.lua, lib.lua's formula and ``ahead``
    (bench/README.md)."""
    if services.store.max_in_flight(entry.provider) != 1:
        raise MeasurementError(f"{entry.provider} is not capped at 1 in the bench's catalog copy")
    hold_the_slot(services, entry, body)
    workspaces = make_workspaces(services, max(1, min(workspace_count, ahead)), "bench-depth")
    seed_spread(services, workspaces, entry, ahead, body)
    target_ws = workspaces[0]
    request_id = services.ids.mint(target_ws, entry.id)
    admission = services.store.admit(request_id=request_id, workspace=target_ws, model=entry.id,
                                     provider=entry.provider, body=body)
    if admission.outcome != "ADMITTED":
        raise MeasurementError(f"admitting the target failed: {admission.outcome}")
    formula = formula_position(services.redis, entry.provider, target_ws, request_id)
    counts = schedule_counts(services, entry.provider)
    if not (admission.position == formula == ahead) or counts["running"] != 1 or counts["granted"] != 0:
        raise MeasurementError(
            f"the target's position: admit.lua says {admission.position}, lib.lua's formula {formula}, "
            f"expected {ahead} ({counts})")
    return target_ws, request_id, ahead


def time_status_reads(services, request_id: str, provider: str, count: int = 2000) -> tuple[float, float]:
    """``count`` status.lua reads through ``RequestStore.status_view``, no HTTP: (wall us per
    read, Redis script us per read from INFO commandstats)."""
    store = services.store
    for _ in range(100):
        store.status_view(request_id, provider)
    usec = script_usec(services.redis)
    began = time.perf_counter()
    for _ in range(count):
        store.status_view(request_id, provider)
    wall = time.perf_counter() - began
    return 1e6 * wall / count, (script_usec(services.redis) - usec) / count


# -- dispatch_cost ---------------------------------------------------------------------


class CycleSide:
    """One side of dispatch_cost: a database whose provider (cap 1) has a queue waiting."""

    def __init__(self, label: str, redis_url: str, catalog_path: Path, entry_id: str, workspaces: int, queued: int):
        self.label = label
        self.services = services_for(redis_url, catalog_path)
        self.client = self.services.redis
        self.client.flushdb()
        self.entry = self.services.catalog.by_id(entry_id)
        store = self.services.store
        if store.max_in_flight(self.entry.provider) != 1:
            raise MeasurementError(f"{self.entry.provider} is not capped at 1 in the bench's catalog copy")
        # no broker: the grants reach this callback (the Dispatcher's place)
        self.granted: list[str] = []
        store.grants.publish = lambda provider, ids: self.granted.extend(ids)
        started = time.monotonic()
        self.workspaces = make_workspaces(self.services, workspaces, "bench-cost")
        seed_spread(self.services, self.workspaces, self.entry, queued, '{"prompt": "bench"}')
        from router_queue.store import keys

        head = self.client.zrange(f"{keys.schedule(self.entry.provider)}:granted", 0, -1)
        counts = schedule_counts(self.services, self.entry.provider)
        if len(head) != 1 or counts["running"] != 1 or counts["queued"] != queued:
            raise MeasurementError(f"dispatch_cost {label}: after seeding {counts}, granted {len(head)}")
        self.current = head[0].decode()
        log(f"dispatch_cost: {label}: {queued} admitted over {workspaces} workspace(s) in "
            f"{time.monotonic() - started:.1f} s ({counts['queued'] - 1} waiting, 1 granted)")

    def run(self, cycles: int) -> tuple[float, float, int]:
        """``cycles`` x (load, claim, complete): (wall s, Redis CPU s, distinct workspaces granted)."""
        store, lease = self.services.store, bench_lease()
        seen: set[str] = set()
        cpu0 = redis_cpu(self.client)
        began = time.perf_counter()
        for _ in range(cycles):
            record, _ = store.load(self.current)
            code = store.claim(record, lease)
            if code != "CLAIMED":
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
    args, side_urls, tmp = ctx.args, ctx.side_urls, ctx.tmp
    entry_id = "bfl/flux-2-pro"
    catalog_path = capped_catalog(tmp, {"bfl": 1})
    # enough for every round to leave --cost-queue waiting at its end
    queued = args.cost_queue + args.cost_rounds * args.cost_cycles + 1
    one = CycleSide("1 workspace", side_urls[0], catalog_path, entry_id, 1, queued)
    many = CycleSide(f"{args.cost_workspaces} workspaces", side_urls[1], catalog_path, entry_id,
                     args.cost_workspaces, queued)
    warm = min(200, args.cost_cycles)
    for side in (one, many):
        side.run(warm)
    rounds = []
    for round_no in range(1, args.cost_rounds + 1):
        results = {}
        for side in (one, many):
            wall, cpu, distinct = side.run(args.cost_cycles)
            results[side.label] = (wall, cpu)
            log(f"dispatch_cost round {round_no}/{args.cost_rounds}: {side.label}: "
                f"{1000 * wall / args.cost_cycles:.3f} ms/cycle wall, "
                f"Redis CPU {1000 * cpu / args.cost_cycles:.3f} ms/cycle; "
                f"granted to {distinct} distinct workspace(s)")
        rounds.append((results[one.label], results[many.label]))
    for side in (one, many):
        counts = schedule_counts(side.services, side.entry.provider)
        log(f"dispatch_cost: {side.label} at the end: {counts['queued']} queued over "
            f"{counts['workspaces']} workspace(s)")
    k = args.cost_cycles
    base, subject = median_round(rounds, lambda b, s: s[0] / b[0])
    log("dispatch_cost: wall ratio per round: " + " ".join(f"{m[0] / o[0]:.3f}" for o, m in rounds)
        + "; Redis CPU ratio per round: " + " ".join(f"{m[1] / o[1]:.3f}" if o[1] else "nan" for o, m in rounds))
    name = str(args.cost_workspaces)
    emit(f"dispatch_cost_{name}_workspaces", 1000 * subject[0] / k, "ms", 1000 * base[0] / k)
    base, subject = median_round(rounds, lambda b, s: s[1] / b[1] if b[1] else float("inf"))
    emit(f"dispatch_redis_cpu_{name}_workspaces", 1000 * subject[1] / k, "ms", 1000 * base[1] / k)
    for side in (one, many):
        side.client.flushdb()


#: What the issue allows a waiting request to cost in Redis beyond its body.
WAITING_OVERHEAD_BUDGET = 1536


@phase("waiting_memory", "store", 20, side_dbs=True)
def measure_waiting_memory(ctx: Context, count: int = 1000) -> None:
    """``memory_per_waiting_request``: Redis ``used_memory`` added per request
    waiting behind a capped provider, admitted as a submit is (a price held in
    the ledger, an Idempotency-Key reserved), against the body plus 1.5 KiB."""
    entry = "bfl/flux-2-pro"
    services = services_for(ctx.side_urls[0], capped_catalog(ctx.tmp, {"bfl": 1}))
    client = services.redis
    client.flushdb()
    workspace = services.accounts.create_workspace("memory", queue_enabled=True, credits=10**12)
    services.accounts.set_limits(workspace, max_queued=10**9)
    body = json.dumps({"prompt": "a red teapot on a windowsill, morning light, " + "x" * 60})

    def admit(n: int) -> None:
        request_id = services.ids.mint(workspace, entry)
        outcome = services.store.admit(request_id=request_id, workspace=workspace, model=entry, provider="bfl",
                                       body=body, price=60, fingerprint=f"{n:064x}",
                                       idempotency_key_hash=f"{n:064x}")
        if outcome.outcome != "ADMITTED":
            raise MeasurementError(f"waiting_memory: admission answered {outcome.outcome}")

    admit(0)  # takes the one slot: everything after waits
    before = client.info("memory")["used_memory"]
    for n in range(1, count + 1):
        admit(n)
    after = client.info("memory")["used_memory"]
    per_request = (after - before) / count
    log(f"waiting_memory: {count} waiting requests added {after - before} bytes of used_memory: "
        f"{per_request:.0f} per request for a {len(body)}-byte body ({per_request - len(body):.0f} beyond it; "
        f"one GiB holds about {2**30 / per_request:,.0f} such waiting requests)")
    client.flushdb()
    emit("memory_per_waiting_request", per_request, "bytes", len(body) + WAITING_OVERHEAD_BUDGET)
