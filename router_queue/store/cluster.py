"""The store on a Redis Cluster (``redis+cluster://``, ``connect.py``): the
client, and where redis-py's cluster client needs steering to keep the store's
promises (a bounded wait on a stalled node, scripts on a promoted replica,
reads on replicas). Every key carries its family's hash tag (``keys.py``), so
each script's keys share one slot.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, LoadBalancingStrategy, RedisCluster
from redis.commands.core import Script
from redis.retry import Retry

from ..redis_urls import ClusterAddress

#: Times a cluster client sends a command again after a node failed to answer.
CLUSTER_RETRIES = 0
#: Nodes one call may wait on in a cluster: the one that did not answer, then,
#: as redis-py rebuilds its slot map on a failed connection, a seed that may be
#: the same stalled node. Each gets this share of the caller's wait.
CLUSTER_WAITS_PER_CALL = 2


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
                load_on_slot(client, self.script, keys[0] if keys else None)
        raise redis.ConnectionError("the node serving this script's slot keeps losing its scripts (failing over)")


def load_on_slot(client: RedisCluster, text: str, key: str | None) -> None:
    """``text`` loaded on every node serving ``key``'s slot, the replicas a
    reader may pick included (the sha is the text's); with no key, on the
    primaries."""
    serving = client.nodes_manager.slots_cache.get(client.keyslot(key)) if key is not None else None
    for node in serving or ():
        client.execute_command("SCRIPT LOAD", text, target_nodes=node)
    if not serving:
        client.script_load(text)


def register_script(client: redis.Redis, text: str) -> Script:
    """``text`` as a script object for ``client`` (a :class:`SlotScript` on a cluster)."""
    if isinstance(client, RedisCluster):
        return SlotScript(client, text)
    return client.register_script(text)


def cluster_client(address: ClusterAddress, *, replica: bool = False, **waits) -> redis.Redis:
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
