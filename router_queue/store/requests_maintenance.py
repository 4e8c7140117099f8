"""The request store's maintenance side: what beat's sweeper, the operator's
commands and the operations page call (reaping, timeouts, deadlines,
draining, the queue's figures)."""

from __future__ import annotations

import time

import redis

from ..requests.outcomes import ExpireQueued
from ..requests.values import DeadlineDue, DeliveryTotals, QueuedRequest
from . import keys
from .connect import primaries_info
from .requests_base import RequestStoreBase, _int, _maybe_text, _seconds, _text
from .scripts import argv, load_script

#: complete.lua also counts, in rq:stats:{provider}, completions in windows
#: of this many seconds, in a ring of this many fields ("done|<window mod
#: ring>" = "<window>:<count>"): "per minute" is what ended in the last
#: minute, written in the write complete.lua already makes.
COMPLETIONS_WINDOW_S = 10
COMPLETIONS_RING = 6
_TOTALS_FIELDS = ("completed", "ran", "waited_s", *(f"done|{slot}" for slot in range(COMPLETIONS_RING)))

#: Each script's ARGV by name (``load_script``, ``argv``), in order: the Lua
#: reads ``ARGV[ARG_ID]`` and so on; the script's header says what each holds.
EXPIRE_QUEUED_ARGS = ("id", "now", "queue_timeout_s", "retention", "workspace", "cap", "low_headroom_pct",
                      "grant_until", "template")
GRANT_ARGS = ("cap", "low_headroom_pct", "now", "grant_until", "template")
REAP_ARGS = ("now", "again_at", "limit")


class MaintenanceRequests(RequestStoreBase):
    """What the sweeper, the operator's commands and the operations page call."""

    def _load_scripts(self, client: redis.Redis) -> None:
        super()._load_scripts(client)
        self._grant = load_script(client, "grant", GRANT_ARGS)
        self._expire_queued = self.effects.load_script(client, "expire_queued", EXPIRE_QUEUED_ARGS)
        self._reap = load_script(client, "reap", REAP_ARGS)
        self._purge = load_script(client, "purge")

    def grant(self, provider: str, now: float | None = None) -> None:
        """Give the provider's free slots to whom its schedule names (the
        sweeper's self-heal: a raised cap, a lost step)."""
        now = now or time.time()
        list_key, template, cap, grant_until = self._granting(provider, now)
        granted = self._grant(keys=[keys.schedule(provider), keys.running(provider), list_key],
                              args=argv(GRANT_ARGS, cap=cap, low_headroom_pct=self.low_headroom_pct,
                                        now=repr(now), grant_until=grant_until,
                                        template=template))
        self._publish_granted(provider, granted)

    def unready(self) -> str | None:
        """Why the store cannot take writes now (full: at ``maxmemory`` under
        ``noeviction``), else None; one INFO, which also proves it answers."""
        try:
            primaries = primaries_info(self.client, "memory")
        except redis.ResponseError:  # a server without INFO (fakeredis, the embedded default): no maxmemory
            self.client.ping()
            return None
        for memory in primaries:
            used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
            policy = memory.get("maxmemory_policy", "noeviction")
            if limit and policy == "noeviction" and used >= limit:
                return f"the request store is full: used_memory {used} of maxmemory {limit} (noeviction)"
        return None

    def dump(self, request_id: str) -> tuple[dict[str, str], int]:
        """Every field stored for a request and its TTL (the operator's inspect)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.request(request_id))
        pipe.ttl(keys.request(request_id))
        pipe.get(keys.body(request_id))
        raw, ttl, body = pipe.execute()
        record = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        if body is None and "body_of" in record:
            body = self.client.get(keys.body(record["body_of"]))
        if body is not None:
            record["body"] = body.decode(errors="replace")
        return record, int(ttl)

    def delivery_totals(self, provider: str, now: float | None = None) -> DeliveryTotals:
        completed, ran, waited_s, *ring = self.client.hmget(keys.stats(provider), _TOTALS_FIELDS)
        current = int((now or time.time()) // COMPLETIONS_WINDOW_S)
        last_minute = 0
        for entry in ring:
            window, _, count = (_maybe_text(entry) or "").partition(":")
            if window and current - int(window) < COMPLETIONS_RING:
                last_minute += int(count)
        ran_n = _int(ran)
        return DeliveryTotals(_int(completed), last_minute, (_seconds(waited_s) or 0.0) / ran_n if ran_n else 0.0)

    def reap(self, provider: str, now: float, again_at: float, limit: int = 500) -> list[tuple[str, bool]]:
        """Take the slots whose lease ran out (``reap.lua``), each to be looked
        at again at ``again_at``: (id, started); a started one's worker died
        (or hung), a granted one's message was lost. The caller publishes them."""
        reply = self._reap(keys=[keys.running(provider)],
                           args=argv(REAP_ARGS, now=repr(now), again_at=repr(again_at), limit=limit))
        return [(_text(reply[i]), reply[i + 1] == b"1") for i in range(0, len(reply), 2)]

    def purge_expired(self, providers: list[str]) -> int:
        """Drop queue and running entries whose request record has expired
        (``purge.lua``), one call per provider (each its own slot on a cluster)."""
        return sum(int(self._purge(keys=[keys.queue(provider), keys.running(provider)], args=[]))
                   for provider in providers)

    def queue_head(self, provider: str, count: int = 100) -> list[QueuedRequest]:
        """The ``count`` longest-waiting requests of a provider's queue, oldest first."""
        ids = [_text(i) for i in self.client.zrange(keys.queue(provider), 0, count - 1)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), ("model", "workspace", "created_at"))
        return [QueuedRequest(request_id, _text(model), _text(workspace), float(created))
                for request_id, (model, workspace, created) in zip(ids, pipe.execute())
                if model and workspace and created]

    def expire_queued(self, request_id: str, provider: str, workspace: str, queue_timeout_s: float,
                      now: float) -> bool:
        """End a request that waited past its queue timeout; True when it did."""
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self._expire_queued(
            keys=[keys.request(request_id), keys.queue(provider), keys.schedule(provider),
                  *self.effects.workspace_keys(provider, workspace), running, list_key, keys.deadlines(provider),
                  keys.body(request_id)],
            args=argv(EXPIRE_QUEUED_ARGS, id=request_id, now=repr(now), queue_timeout_s=queue_timeout_s,
                      retention=self.retention_s, workspace=workspace, cap=cap,
                      low_headroom_pct=self.low_headroom_pct, grant_until=grant_until,
                      template=template),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return ExpireQueued(_text(reply[0])) is ExpireQueued.TIMED_OUT

    def deadlines_due(self, provider: str, now: float, limit: int = 500) -> list[DeadlineDue]:
        """The caller deadlines of ``provider`` that have passed by ``now``,
        earliest first, with each request's workspace and model (none: its
        record expired). The scripts that act on them drop them from the index."""
        members = [_text(m) for m in self.client.zrangebyscore(keys.deadlines(provider), "-inf", repr(now),
                                                               start=0, num=limit)]
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            pipe.hmget(keys.request(member.split("|", 1)[1]), ("workspace", "model"))
        return [DeadlineDue(kind, request_id, _maybe_text(workspace), _maybe_text(model))
                for (kind, request_id), (workspace, model) in zip((m.split("|", 1) for m in members), pipe.execute())]

    def forget_deadline(self, provider: str, due: "DeadlineDue") -> None:
        """Drop a deadline whose request expired (nothing is left to end)."""
        self.client.zrem(keys.deadlines(provider), f"{due.kind}|{due.request_id}")

    def set_draining(self, provider: str, draining: bool) -> None:
        """Stop (or resume) admitting requests for ``provider``; in-flight work
        goes on. The mark is the provider's schedule's, so admission reads it
        among the provider's own keys."""
        if draining:
            self.client.hset(keys.schedule(provider), "draining", "1")
        else:
            self.client.hdel(keys.schedule(provider), "draining")

    def draining(self, providers: list[str]) -> set[str]:
        """Which of ``providers`` are draining."""
        pipe = self.client.pipeline(transaction=False)
        for provider in providers:
            pipe.hexists(keys.schedule(provider), "draining")
        return {provider for provider, marked in zip(providers, pipe.execute()) if marked}

    def queue_depth(self, provider: str) -> int:
        return int(self.client.zcard(keys.queue(provider)))

    def waiting_workspaces(self, provider: str, largest: int = 5) -> tuple[int, list[tuple[str, int]]]:
        """How many workspaces have requests waiting on ``provider``, and the
        ``largest`` of them with their counts, most first."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(keys.schedule_workspaces(provider))
        pipe.zrevrange(keys.schedule_workspaces(provider), 0, largest - 1, withscores=True)
        count, top = pipe.execute()
        return int(count), [(_text(ws), int(n)) for ws, n in top]

    def in_flight(self, provider: str) -> int:
        return int(self.client.zcard(keys.running(provider)))
