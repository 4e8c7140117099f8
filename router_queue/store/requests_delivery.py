"""The request store's delivery side: what a worker calls to load, claim,
renew, report on and complete the request it runs (``workers/delivery.py``)."""

from __future__ import annotations

import time

import redis

from ..blobs.pointers import ResultPointer
from ..requests.outcomes import Claim, Complete
from ..requests.record import RequestRecord
from ..requests.values import Lease
from . import keys
from .connect import queue_script
from .requests_base import _FIELDS, RequestStoreBase, _text
from .scripts import argv, explain, load_script

#: Each script's ARGV by name (``load_script``, ``argv``), in order: the Lua
#: reads ``ARGV[ARG_ID]`` and so on; the script's header says what each holds.
CLAIM_ARGS = ("id", "now", "lease_s", "cap", "low_headroom_pct", "queue_timeout_s", "retention", "token",
              "max_takeovers", "resume_key", "grant_until", "template")
COMPLETE_ARGS = ("id", "now", "retention", "error_type", "detail", "content_type", "output", "billable", "cap",
                 "low_headroom_pct", "grant_until", "template", "blob_key", "blob_size", "blob_sha256",
                 "fallback_max")
RENEW_ARGS = ("id", "token", "now", "lease_s", "successor", "hand_back")
PROGRESS_ARGS = ("id", "token", "progress", "now", "every_s")


class DeliveryRequests(RequestStoreBase):
    """What a worker calls for the request it delivers, from its load to its completion."""

    def _load_scripts(self, client: redis.Redis) -> None:
        super()._load_scripts(client)
        self._claim = self.effects.load_script(client, "claim", CLAIM_ARGS)
        self._renew = load_script(client, "renew", RENEW_ARGS)
        self._complete = self.effects.load_script(client, "complete", COMPLETE_ARGS)
        self._progress = load_script(client, "progress", PROGRESS_ARGS)

    def traceparent(self, request_id: str) -> str:
        """The W3C trace context its submit left on the record ("" if none)."""
        value = self.client.hget(keys.request(request_id), "traceparent")
        return value.decode() if value else ""

    def load(self, request_id: str) -> tuple[RequestRecord | None, bytes | None]:
        """A request's record and its native body, in one round trip. A retry's
        body is its chain's first request's (``body_of``); a record admitted
        before bodies had a key of their own (an older version's, still
        waiting) holds its body in its ``body`` field: either read in a second
        trip, only when the body's key has none."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.request(request_id), _FIELDS)
        pipe.get(keys.body(request_id))
        values, body = pipe.execute()
        record = RequestRecord.from_values(values)
        if body is None and record is not None:
            owner, body = self.client.hmget(keys.request(request_id), ("body_of", "body"))
            if owner is not None:
                body = self.client.get(keys.body(owner.decode()))
        return record, body

    def claim(self, record: RequestRecord, lease: Lease, now: float | None = None) -> Claim:
        """Take the request to run it (see :class:`~router_queue.requests.outcomes.Claim`)."""
        request_id, provider = record.id, record.provider
        now = now or time.time()
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self._claim(
            keys=[keys.request(request_id), keys.queue(provider), keys.schedule(provider), running,
                  *self.effects.workspace_keys(provider, record.workspace), list_key,
                  keys.deadlines(provider), keys.body(request_id)],
            args=argv(CLAIM_ARGS, id=request_id, now=repr(now), lease_s=lease.lease_s, cap=cap,
                      low_headroom_pct=self.low_headroom_pct,
                      queue_timeout_s=lease.queue_timeout_s, retention=self.retention_s, token=lease.token,
                      max_takeovers=lease.max_takeovers, resume_key=lease.resume_key, grant_until=grant_until,
                      template=template),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Claim(_text(reply[0]))

    def renew(self, request_id: str, provider: str, token: str, lease_s: float, *, successor: str = "",
              hand_back: bool = False) -> bool:
        """Extend the lease ``token`` holds. ``successor``: keep it for that retry
        alone; ``hand_back``: end it now for another worker to resume."""
        return bool(self._renew(keys=[keys.request(request_id), keys.running(provider)],
                                args=argv(RENEW_ARGS, id=request_id, token=token, now=repr(time.time()),
                                          lease_s=lease_s, successor=successor, hand_back="1" if hand_back else "")))

    def renew_many(self, held: list[tuple[str, str, str]], lease_s: float) -> None:
        """Heartbeat: extend every (id, provider, token) lease in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        now = repr(time.time())
        calls = [([keys.request(request_id), keys.running(provider)],
                  argv(RENEW_ARGS, id=request_id, token=token, now=now, lease_s=lease_s, successor="", hand_back=""))
                 for request_id, provider, token in held]
        for call_keys, args in calls:
            queue_script(pipe, self._renew, call_keys, args)
        try:
            pipe.execute()
        except redis.exceptions.NoScriptError:
            for call_keys, args in calls:
                self._renew(keys=call_keys, args=args)
        except redis.exceptions.ResponseError as error:  # pipelined: raised here, not by the script
            raise explain(self._renew, error) from None

    def record_attempt(self, request_id: str) -> int:
        """Count one failed provider call worth retrying; returns the count so far."""
        return int(self.client.hincrby(keys.request(request_id), "attempts", 1))

    def remember_upstream(self, request_id: str, ref: str) -> None:
        """Keep the provider's handle on a submitted generation, to resume it."""
        self.client.hset(keys.request(request_id), "upstream_ref", ref)

    def record_progress(self, request_id: str, token: str, progress: float, now: float | None = None) -> int:
        """Keep how far a running generation is (``progress.lua``: only growing,
        only from the lease's holder), and owe its webhook's progress event:
        0 when it was no news, 1 when kept, :data:`WEBHOOK_DUE` when kept and
        a webhook event of the request is due now (publish it)."""
        return int(self._progress(keys=[keys.request(request_id)],
                                  args=argv(PROGRESS_ARGS, id=request_id, token=token, progress=repr(progress),
                                            now=repr(now or time.time()), every_s=self.progress_event_every_s)))

    def cancel_requested(self, request_id: str) -> bool:
        return bool(self.client.hexists(keys.request(request_id), "cancel_requested"))

    def complete(
        self,
        record: RequestRecord,
        *,
        output: bytes = b"",
        content_type: str = "",
        error_type: str = "",
        detail: str = "",
        billable: bool | None = None,
        pointer: ResultPointer | None = None,
        fallback_max: int | None = None,
    ) -> Complete:
        """Finish the request and settle its credits, once; a request already
        COMPLETED keeps its first outcome. ``billable`` defaults to "a success".
        ``pointer``: the output is that object (already written), not ``output``.
        ``fallback_max``: ``output`` is kept for an unanswering object store,
        within that many bytes of the provider's fallback (else FALLBACK_FULL)."""
        request_id, provider = record.id, record.provider
        billable = (not error_type) if billable is None else billable
        now = time.time()
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self.acknowledged.run(
            self._complete,
            keys=[
                keys.request(request_id), keys.result(request_id), keys.queue(provider),
                keys.stats(provider), keys.schedule(provider), running,
                *self.effects.workspace_keys(provider, record.workspace), list_key,
                keys.deadlines(provider), keys.body(request_id), keys.result_objects(provider),
                keys.fallback_results(provider), keys.fallback_bytes(provider),
            ],
            args=argv(COMPLETE_ARGS, id=request_id, now=repr(now), retention=self.retention_s, error_type=error_type,
                      detail=detail, content_type=pointer.content_type if pointer else content_type, output=output,
                      billable="1" if billable else "0", cap=cap,
                      low_headroom_pct=self.low_headroom_pct, grant_until=grant_until, template=template,
                      blob_key=pointer.key if pointer else "",
                      blob_size=pointer.size if pointer else 0, blob_sha256=pointer.sha256 if pointer else "",
                      fallback_max="" if fallback_max is None else fallback_max),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Complete(_text(reply[0]))
