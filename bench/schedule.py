"""The schedule behind a provider's cap, driven through ``RequestStore``: the seeding the capped figures
share, and the store-only phases ``dispatch_cost`` and ``waiting_memory``."""

import copy
import json
import time
import uuid

from router_queue.store.record import Submission

from . import core
from .core import Context, MeasurementError, emit, log, phase

#: Admits (or cancels) sent per pipeline while seeding.
BATCH = 2000
#: waiting_memory: requests admitted, and what the issue allows each to cost in Redis beyond its body.
WAITING_COUNT, WAITING_OVERHEAD_BUDGET = 1000, 1536
#: dispatch_cost: workspaces of the subject side, requests waiting behind the cap of 1 on each side
#: throughout, complete -> grant -> claim cycles per run (and of the warm-up), rounds.
COST_WORKSPACES, COST_QUEUE, CYCLES, COST_WARMUP, COST_ROUNDS = 1000, 10_000, 2000, 200, 5


def _pipelined(services, method: str, calls: list[dict], reply: list, what: str) -> None:
    """``RequestStore.<method>(**kwargs)`` for each of ``calls`` on a store copy whose script queues on a
    pipeline (``BATCH`` per round trip) and answers ``reply``; every real reply must start as ``reply``."""
    script, pipe = getattr(services.store, f"_{method}"), None

    def queue_call(keys, args, client=None):
        script(keys=keys, args=args, client=pipe)
        return reply

    batching = copy.copy(services.store)
    setattr(batching, f"_{method}", queue_call)
    for start in range(0, len(calls), BATCH):
        pipe = services.redis.pipeline(transaction=False)
        for kwargs in calls[start:start + BATCH]:
            getattr(batching, method)(**kwargs)
        for answer in pipe.execute():
            if not isinstance(answer, list) or answer[:1] != reply[:1]:
                raise MeasurementError(f"{what}: the script answered {answer!r}")


def seed_spread(services, workspaces: list[str], entry, count: int, body: str) -> list[str]:
    """The ids of ``count`` requests for ``entry`` admitted round-robin over ``workspaces``, in order."""
    order = [workspaces[n % len(workspaces)] for n in range(count)]
    ids = [services.ids.mint(ws, entry.id) for ws in order]
    _pipelined(services, "admit", [dict(submission=Submission(request_id=i, workspace=ws, model=entry.id,
                                                              provider=entry.provider, body=body))
                                   for i, ws in zip(ids, order)], [b"ADMITTED", b"0", 0], "seeding the schedule")
    return ids


def cancel_all(services, request_ids: list[str], workspace: str, entry) -> None:
    """Cancel waiting requests (``RequestStore.cancel``, pipelined)."""
    _pipelined(services, "cancel", [dict(request_id=i, workspace=workspace, model=entry.id, provider=entry.provider)
                                    for i in request_ids], [b"CANCELLED"], "cancelling the requests")


def bench_lease():
    """A lease nothing reaps during a run."""
    from router_queue.store.requests_values import Lease

    return Lease(token=uuid.uuid4().hex, lease_s=10**6, queue_timeout_s=86400 * 365, max_takeovers=3,
                 resume_key=f"bench:{uuid.uuid4().hex}:0")


def seed_behind(services, entry, ahead: int, workspace_count: int, body: str) -> tuple[str, str]:
    """(workspace, id) of a request admitted behind ``ahead`` waiting ones, under a cap of 1 held by a claimed
    request; admit.lua must place it at ``ahead``."""
    store = services.store
    if store.max_in_flight(entry.provider) != 1:
        raise MeasurementError(f"{entry.provider} is not capped at 1 in the bench's catalog copy")
    # the slot holder: admitted in a workspace of its own and claimed, so nothing else is granted
    holder_ws = core.new_workspace(services, "bench-holder-0")
    holder_id = services.ids.mint(holder_ws, entry.id)
    holder = store.admit(Submission(request_id=holder_id, workspace=holder_ws, model=entry.id,
                                    provider=entry.provider, body=body))
    if holder.outcome != "ADMITTED" or holder.position != 0:
        raise MeasurementError(f"the slot holder was not granted at once: {holder}")
    if (code := store.claim(store.load(holder_id)[0], bench_lease())) != "CLAIMED":
        raise MeasurementError(f"claiming the slot holder answered {code}")
    workspaces = [core.new_workspace(services, f"bench-depth-{n}") for n in range(max(1, min(workspace_count, ahead)))]
    seed_spread(services, workspaces, entry, ahead, body)
    request_id = services.ids.mint(workspaces[0], entry.id)
    admission = store.admit(Submission(request_id=request_id, workspace=workspaces[0], model=entry.id,
                                       provider=entry.provider, body=body))
    counts = core.schedule_counts(services.redis, entry.provider)
    if admission.position != ahead or counts["running"] != 1 or counts["granted"] != 0:
        raise MeasurementError(f"the target: {admission.outcome} at position {admission.position}, expected "
                               f"{ahead} ({counts})")
    return workspaces[0], request_id


class CycleSide:
    """One side of dispatch_cost: a database whose provider (cap 1) has a queue waiting."""

    def __init__(self, label: str, redis_url: str, catalog_path, workspaces: int, queued: int):
        from router_queue.store import keys

        self.label, self.services = label, core.services_for(redis_url, catalog_path)
        self.client, self.entry = self.services.redis, self.services.catalog.by_id(core.MODEL_ID)
        self.client.flushdb()
        self.granted: list[str] = []  # no broker: the grants reach this list (the Dispatcher's place)
        self.services.store.grants.publish = lambda provider, ids: self.granted.extend(ids)
        names = [core.new_workspace(self.services, f"bench-cost-{n}") for n in range(workspaces)]
        seed_spread(self.services, names, self.entry, queued, '{"prompt": "bench"}')
        head = self.client.zrange(f"{keys.schedule(self.entry.provider)}:granted", 0, -1)
        counts = core.schedule_counts(self.client, self.entry.provider)
        if len(head) != 1 or counts["running"] != 1 or counts["queued"] != queued:
            raise MeasurementError(f"dispatch_cost {label}: after seeding {counts}, granted {len(head)}")
        self.current = head[0].decode()

    def run(self, cycles: int) -> tuple[float, float]:
        """``cycles`` x (load, claim, complete): (wall s, Redis CPU s)."""
        store, lease = self.services.store, bench_lease()
        cpu0, began = core.redis_cpu(self.client), time.perf_counter()
        for _ in range(cycles):
            record, _ = store.load(self.current)
            if (code := store.claim(record, lease)) != "CLAIMED":
                raise MeasurementError(f"dispatch_cost {self.label}: claim answered {code}")
            self.granted.clear()
            code = store.complete(record, output=b"{}", content_type="application/json")
            if code != "COMPLETED" or len(self.granted) != 1:
                raise MeasurementError(f"dispatch_cost {self.label}: complete answered {code}, "
                                       f"granted {self.granted} (the queue ran dry?)")
            self.current = self.granted[0]
        return time.perf_counter() - began, core.redis_cpu(self.client) - cpu0


@phase("dispatch_cost", "store", 10)
def measure_dispatch_cost(ctx: Context) -> None:
    catalog_path = core.capped_catalog(ctx.tmp, {"bfl": 1})
    queued = COST_QUEUE + COST_ROUNDS * CYCLES + 1  # at the end, COST_QUEUE less the warm-up still wait
    sides = [CycleSide(f"{n} workspace(s)", ctx.db_url(db), catalog_path, n, queued)
             for n, db in zip((1, COST_WORKSPACES), core.SIDE_DBS)]
    for side in sides:
        side.run(COST_WARMUP)
    rounds = [tuple(side.run(CYCLES) for side in sides) for _ in range(COST_ROUNDS)]
    for index, name in enumerate(("dispatch_cost", "dispatch_redis_cpu")):
        base, subject = core.median_round(name, [(b[index], s[index]) for b, s in rounds],
                                          lambda b, s: s / b if b else float("inf"))
        emit(f"{name}_1000_workspaces", 1000 * subject / CYCLES, "ms", 1000 * base / CYCLES)


@phase("waiting_memory", "store", 20)
def measure_waiting_memory(ctx: Context) -> None:
    """Redis ``used_memory`` per request waiting behind a cap, admitted as a submit is (bench/README.md)."""
    services = core.services_for(ctx.db_url(core.SIDE_DBS[0]), core.capped_catalog(ctx.tmp, {"bfl": 1}))
    client = services.redis
    client.flushdb()
    workspace = core.new_workspace(services, "memory", max_queued=10**9)
    body = json.dumps({"prompt": "a red teapot on a windowsill, morning light, " + "x" * 60})

    def admit(n: int) -> None:
        outcome = services.store.admit(Submission(
            request_id=services.ids.mint(workspace, core.MODEL_ID), workspace=workspace, model=core.MODEL_ID,
            provider="bfl", body=body, price=60, fingerprint=f"{n:064x}", idempotency_key_hash=f"{n:064x}"))
        if outcome.outcome != "ADMITTED":
            raise MeasurementError(f"waiting_memory: admission answered {outcome.outcome}")

    admit(0)  # takes the one slot: everything after waits
    before = client.info("memory")["used_memory"]
    for n in range(1, WAITING_COUNT + 1):
        admit(n)
    per_request = (client.info("memory")["used_memory"] - before) / WAITING_COUNT
    log(f"waiting_memory: one GiB holds about {2**30 / per_request:,.0f} such waiting requests")
    client.flushdb()
    emit("memory_per_waiting_request", per_request, "bytes", len(body) + WAITING_OVERHEAD_BUDGET)
