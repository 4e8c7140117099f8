"""How every process reaches Redis: one URL, plain or through Sentinel, and
clients for side work that must not wait as long as the store does.

``REDIS_URL`` and ``CELERY_BROKER_URL`` take ``redis://[:PASSWORD@]HOST:PORT/DB``
(one server), ``sentinel://[:PASSWORD@]HOST:PORT;sentinel://HOST:PORT;.../DB?master_name=NAME``
(kombu's Sentinel syntax with the master name in the URL, so one string serves
the store and the broker) or, the store only,
``redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT…]`` (``cluster.py``). Each
form in full: ``docs/ARCHITECTURE.md``, "The store's parts".
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..redis_urls import SENTINEL_SCHEME, ClusterAddress, RedisUrlError, SentinelAddress  # noqa: F401 - the store's door names them
from .cluster import CLUSTER_WAITS_PER_CALL, cluster_client

#: What a Redis that cannot be reached raises: refused or restarting
#: (connection), stalled (timeout), or mid-failover. The front door answers it
#: 503; a worker rides it out.
#: On a cluster, also a slot whose primary failed and has no successor yet.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
               redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError)
#: What a Redis at ``maxmemory`` under ``noeviction`` raises for a write, a
#: script's included (refused at its first write, so it wrote nothing). The
#: front door answers it 503 like an outage; a worker rides it out likewise.
FULL = (redis.exceptions.OutOfMemoryError,)


class Unsent(redis.ConnectionError):
    """A store fault known to have come before the write it stopped reached
    Redis (admission's steps before the one that writes the record): the
    write changed nothing. Answered 503 like any outage."""


class NotAdmitted(Unsent):
    """An admission known to have changed nothing, its Idempotency-Key (if
    it has one) read free: no earlier send of the key holds it. The one
    store fault a submit with a key answers 503 (``web/envelope.py``)."""


def never_sent(exc: BaseException) -> bool:
    """Whether ``exc`` (one of :data:`UNREACHABLE`) came before its command
    left this process: connecting failed (redis-py says "connecting" then,
    and only then), or :class:`Unsent`. Any other fault may have come after
    Redis ran the command, with its reply lost."""
    return isinstance(exc, Unsent) or (isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
                                       and "connecting" in str(exc))


#: Seconds a process waits on one sentinel when asking where the primary is.
SENTINEL_WAIT_S = 0.5


def connect(url: str, *, wait_s: float, connect_s: float | None = None,
            health_check_interval: int = 30, replica: bool = False) -> redis.Redis:
    """A client for ``url`` whose socket waits are ``wait_s`` (connecting:
    ``connect_s``, default the same). Through Sentinel, the client asks the
    sentinels for the primary on every new connection, so after a failover
    the next command reaches the promoted replica; with ``replica``, for one
    of its replicas instead (the primary when none is up). A cluster client
    with ``replica`` reads each slot's replicas (read-only commands and
    scripts: :class:`SlotScript` sends ``EVALSHA_RO``)."""
    connect_s = wait_s if connect_s is None else connect_s
    cluster = ClusterAddress.parse(url)
    if cluster is not None:
        node_wait_s = wait_s / CLUSTER_WAITS_PER_CALL
        return cluster_client(cluster, socket_connect_timeout=min(connect_s, node_wait_s),
                              socket_timeout=node_wait_s, health_check_interval=health_check_interval,
                              replica=replica)
    address = SentinelAddress.parse(url)
    if address is None:
        return redis.Redis.from_url(url, socket_connect_timeout=connect_s, socket_timeout=wait_s,
                                    health_check_interval=health_check_interval)
    sentinel = Sentinel(
        list(address.sentinels),
        sentinel_kwargs={"socket_timeout": SENTINEL_WAIT_S, "socket_connect_timeout": SENTINEL_WAIT_S},
        socket_timeout=wait_s, socket_connect_timeout=connect_s, health_check_interval=health_check_interval,
        db=address.db, password=address.password,
    )
    if replica:
        return sentinel.slave_for(address.master_name)
    return sentinel.master_for(address.master_name)


#: Seconds a Redis broker's socket waits, connecting or for a reply. Without it
#: a hung broker (SIGSTOP, a stalled host) holds every publish, and the submit
#: or completion that granted it, for good. The consumer's BRPOP is answered
#: within kombu's 1 s brpop timeout, so it never waits this long on a live one.
BROKER_WAIT_S = 2.0


def celery_broker(url: str, wait_s: float = BROKER_WAIT_S) -> tuple[str, dict]:
    """(URL, extra transport options) for Celery's broker at ``url``; a Redis
    broker's sockets wait ``wait_s`` at most."""
    waits = {"socket_timeout": wait_s, "socket_connect_timeout": wait_s}
    address = SentinelAddress.parse(url)
    if address is None:
        return url, (waits if url.startswith(("redis://", "rediss://")) else {})
    return address.kombu_url(), {"master_name": address.master_name, **waits}


def bounded(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """The same server through a pool of its own whose socket waits are
    ``timeout_s``: a stalled Redis costs such a caller that long at most."""
    if isinstance(client, RedisCluster):
        seeds = tuple((node.host, node.port) for node in client.nodes_manager.startup_nodes.values())
        kwargs = client.nodes_manager.connection_kwargs
        node_wait_s = timeout_s / CLUSTER_WAITS_PER_CALL
        return cluster_client(ClusterAddress(seeds, kwargs.get("password")), socket_timeout=node_wait_s,
                              socket_connect_timeout=node_wait_s,
                              health_check_interval=kwargs.get("health_check_interval", 0))
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if isinstance(pool, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the pool's own proxy, made anew below
        return redis.Redis(connection_pool=SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, connection_class=pool.connection_class, **kwargs))
    return redis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))


def primaries_info(client: redis.Redis, section: str) -> list[dict]:
    """``INFO section`` of every primary: the one server, or each of a
    cluster's (where plain INFO asks whichever node the client picks)."""
    if isinstance(client, RedisCluster):
        return list(client.info(section, target_nodes=RedisCluster.PRIMARIES).values())
    return [client.info(section)]


def queue_script(pipe, script, keys: list, args: list) -> None:
    """Queue ``script`` on ``pipe`` as a bare EVALSHA: no ``SCRIPT EXISTS``
    round trip first, and the form a cluster's pipeline accepts (it refuses
    ``evalsha()`` and script objects). A server without the script (restarted,
    flushed, a promoted replica) answers NOSCRIPT; the caller then runs the
    script plainly, which loads it."""
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
