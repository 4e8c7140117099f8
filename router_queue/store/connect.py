"""How every process reaches Redis: one URL, plain or through Sentinel, and
clients for side work that must not wait as long as the store does.

``REDIS_URL`` and ``CELERY_BROKER_URL`` take either form:

* ``redis://[:PASSWORD@]HOST:PORT/DB``: one server;
* ``sentinel://[:PASSWORD@]HOST:PORT;sentinel://HOST:PORT;.../DB?master_name=NAME``:
  the primary that the sentinels at those addresses name ``NAME``, found anew
  after every failover. This is kombu's Sentinel syntax (sentinels separated
  by ``;``) with the master name carried in the URL, so one string serves the
  store (redis-py's ``Sentinel``) and the Celery broker (kombu's ``sentinel``
  transport) alike. ``PASSWORD`` is the primary's; sentinels without a password
  are assumed;
* ``redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT…]``: a Redis Cluster,
  through its seed nodes (redis-py's ``RedisCluster``, which follows MOVED and
  a failover's new primary). Every key carries the ``{rq}`` hash tag
  (``keys.PREFIX``), so each script's keys share a slot. Celery's broker is
  then RabbitMQ or a Redis of its own (``settings.py`` refuses the cluster).
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, LoadBalancingStrategy, RedisCluster
from redis.commands.core import Script
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..redis_urls import SENTINEL_SCHEME, ClusterAddress, RedisUrlError, SentinelAddress  # noqa: F401 - the store's door names them

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

#: Times a cluster client sends a command again after a node failed to answer.
CLUSTER_RETRIES = 0
#: Nodes one call may wait on in a cluster: the one that did not answer, then,
#: as redis-py rebuilds its slot map on a failed connection, a seed that may be
#: the same stalled node. Each gets this share of the caller's wait.
CLUSTER_WAITS_PER_CALL = 2

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
        return _cluster(cluster, socket_connect_timeout=min(connect_s, node_wait_s), socket_timeout=node_wait_s,
                        health_check_interval=health_check_interval, replica=replica)
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
        return _cluster(ClusterAddress(seeds, kwargs.get("password")), socket_timeout=timeout_s,
                        socket_connect_timeout=timeout_s, health_check_interval=kwargs.get("health_check_interval", 0))
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if isinstance(pool, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the pool's own proxy, made anew below
        return redis.Redis(connection_pool=SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, connection_class=pool.connection_class, **kwargs))
    return redis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))


# A pipelined command that failed because its node did not answer is not sent
# again one by one: redis-py re-sends each such command on its own, each waiting
# the full socket timeout on the same node, so a stalled primary held a pipeline
# of n commands for n + 1 waits (a key lookup 2.4 s where the front door promises
# an answer within its one wait). MOVED, ASK and TRYAGAIN are still followed.
# Read by name in redis-py's ClusterPipeline, so it is set on the class: every
# cluster client in a router-queue process is the store's.
ClusterPipeline.ERRORS_ALLOW_RETRY = (redis.exceptions.MovedError, redis.exceptions.AskError,
                                      redis.exceptions.TryAgainError)


class SlotScript(Script):
    """A script on a cluster: on NOSCRIPT (a promoted replica has none of the
    scripts its primary was given), it is loaded on every node serving its
    first key's slot, where redis-py's ``Script`` loads it on the primaries its
    slot map names, which at a failover may not yet include the promoted one.
    A second NOSCRIPT is the slot still moving: raised as unreachable (503).
    On a client reading replicas it is sent as ``EVALSHA_RO``, which redis-py
    routes to a replica (a script sent so must not write)."""

    def __call__(self, keys=None, args=None, client=None):
        client = client or self.registered_client
        keys, args = list(keys or []), list(args or [])
        replica = client.load_balancing_strategy is not None  # a reader of replicas: read-only scripts
        for _ in range(2):
            try:
                if replica:
                    return client.evalsha_ro(self.sha, len(keys), *keys, *args)
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                # every node of the slot, the replicas a reader may pick included (the sha is the text's)
                serving = client.nodes_manager.slots_cache.get(client.keyslot(keys[0])) if keys else None
                for node in serving or ():
                    client.execute_command("SCRIPT LOAD", self.script, target_nodes=node)
                if not serving:
                    client.script_load(self.script)
        raise redis.ConnectionError("the node serving this script's slot keeps losing its scripts (failing over)")


def register_script(client: redis.Redis, text: str) -> Script:
    """``text`` as a script object for ``client`` (a :class:`SlotScript` on a cluster)."""
    if isinstance(client, RedisCluster):
        return SlotScript(client, text)
    return client.register_script(text)


def _cluster(address: ClusterAddress, *, replica: bool = False, **waits) -> redis.Redis:
    """A cluster client for ``address``. Typed as ``redis.Redis``: the store
    uses the commands both answer alike (a script's keys share one slot).
    It asks again only after a redirect (``MOVED``, followed at once), never
    after a node failed to answer: redis-py's three retries would turn the
    front door's one wait on a stalled node into four."""
    if replica:
        waits["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN_REPLICAS
    client = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in address.seeds],
                          password=address.password, retry=Retry(NoBackoff(), CLUSTER_RETRIES), **waits)
    return client


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
