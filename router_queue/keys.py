"""The Redis key layout, in one place. Every key is built by a function here.

=============================  ======  ==============================  ==================
key                            type    TTL                             written by
=============================  ======  ==============================  ==================
rq:req:{id}                    hash    none; retention once COMPLETED  admit/claim/cancel/
                                                                       complete.lua
rq:result:{id}                 string  retention                       complete.lua
rq:queue:{provider}            zset    none (members leave on claim,   admit/claim/cancel
                                       cancel or completion)           .lua
rq:seq:{provider}              string  none (INCR counter)             admit.lua
rq:due                         zset    none (members leave once        admit.lua, dispatch,
                                       published or claimed)           delivery (defer)
rq:running:{provider}          zset    none (members leave on          claim/renew/complete
                                       completion)                     .lua
rq:stats:{provider}            hash    none                            complete.lua
rq:idem:{workspace}:{keyhash}  string  IDEMPOTENCY_TTL_SECONDS         admit.lua
rq:ws:{workspace}              hash    none                            cli (accounts.py)
rq:workspaces                  set     none (all workspace ids)        cli (accounts.py)
rq:ledger:{workspace}          stream  none (append-only)              lua/lib.lua (settle),
                                                                       admit.lua (hold)
rq:apikey:{sha256(key)}        string  none (value: workspace id)      cli (accounts.py)
rq:config:id-secret            string  none                            ids.py (SET NX)
rq:metrics:{provider}          hash    none (counters)                 admit.lua, metrics.py
rq:metrics:sweeper             hash    none (counters)                 metrics.py
rq:draining                    set     none (providers not admitting)  cli (ops drain)
rq:done:{id}                   pubsub  (a channel, not a key)          lua/lib.lua
                                                                       (announce_completed)
=============================  ======  ==============================  ==================

Workspace hash fields: ``name queue_enabled credits held queued max_queued
rate_limit created_at`` (``credits`` is the balance; ``held`` the sum of
open holds; ``queued`` how many of its requests wait IN_QUEUE).

Request hash fields: ``id workspace model provider status body seq
created_at started_at completed_at error_type detail content_type
cancel_requested idem token holder successor handed_back lease_until takeovers
attempts upstream_ref
hold charged`` (``hold``: credits held at admission, zeroed when settled;
``charged``: what was charged)
(timestamps are Unix seconds as decimal strings; ``token`` is unique to the
execution holding the lease, ``holder`` its "{Celery task id}:{retries}";
``successor`` the resume key of the retry a holder kept its lease for; ``upstream_ref`` is the provider's own handle on a
submitted generation, JSON, so a new worker resumes instead of resubmitting).
``rq:queue:{provider}`` scores are the ``rq:seq`` sequence, so ``ZRANK`` is the
number of requests ahead: the queue position in O(log n).
``rq:due`` scores are the time by which a waiting request must have been
(re)published: admission + ``REPUBLISH_AFTER_SECONDS``, or the end of a
deferral; the sweeper publishes members past due (their message was lost).
``rq:running:{provider}`` scores are lease expiries; its size is the
provider's count of generations in flight (the fleet-wide cap), and members
past expiry are requests whose worker died: the reaper re-publishes them.
"""

from __future__ import annotations

PREFIX = "rq"


def request(request_id: str) -> str:
    return f"{PREFIX}:req:{request_id}"


def result(request_id: str) -> str:
    return f"{PREFIX}:result:{request_id}"


def queue(provider: str) -> str:
    return f"{PREFIX}:queue:{provider}"


def sequence(provider: str) -> str:
    return f"{PREFIX}:seq:{provider}"


def due() -> str:
    return f"{PREFIX}:due"


def running(provider: str) -> str:
    return f"{PREFIX}:running:{provider}"


def stats(provider: str) -> str:
    return f"{PREFIX}:stats:{provider}"


def idempotency(workspace: str, key_hash: str) -> str:
    return f"{PREFIX}:idem:{workspace}:{key_hash}"


def workspace(workspace_id: str) -> str:
    return f"{PREFIX}:ws:{workspace_id}"


def ledger(workspace_id: str) -> str:
    return f"{PREFIX}:ledger:{workspace_id}"


def workspaces() -> str:
    return f"{PREFIX}:workspaces"


def api_key(key_hash: str) -> str:
    return f"{PREFIX}:apikey:{key_hash}"


def id_secret() -> str:
    return f"{PREFIX}:config:id-secret"


def done_channel(request_id: str) -> str:
    """Pub/sub channel announcing a request is COMPLETED (lua/lib.lua spells it too)."""
    return f"{PREFIX}:done:{request_id}"


def metrics(provider: str) -> str:
    return f"{PREFIX}:metrics:{provider}"


def sweeper_metrics() -> str:
    return f"{PREFIX}:metrics:sweeper"


def draining() -> str:
    return f"{PREFIX}:draining"
