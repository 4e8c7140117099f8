"""Writes a caller is told about, held until a replica has them (Redis ``WAIT``).

Redis replicates asynchronously: a primary that dies before its replica
received a write takes the write with it when its replica is promoted (by
the sentinels, or by the cluster itself). ``WAIT`` counts the writes of its
own connection, so the write and its ``WAIT`` go in one pipeline: on one
Redis, one connection; on a cluster, both sent to the node serving the
script's slot, which redis-py's cluster pipeline sends on one connection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from .cluster import load_on_slot
from .scripts import explain

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replication:
    """How many replicas a write the caller is told about waits for, and for
    how long at most. Waiting closes the failover window for the writes that
    matter (an admission answered 201, a cancel, a completion with its
    settlement) at the price of one replication round trip each; past
    ``timeout_ms`` the write is answered anyway (it is on the primary and
    cannot be taken back), logged and counted."""

    replicas: int = 0
    timeout_ms: int = 100


#: Answer as soon as the primary has a write (``REDIS_WAIT_REPLICAS`` 0).
NO_REPLICATION = Replication()


class ReplicatedWrites:
    """Runs the writes a caller is told about under ``replication``."""

    def __init__(self, client: redis.Redis, replication: Replication = NO_REPLICATION):
        self.client = client
        self.replication = replication
        #: Writes answered before ``replication.replicas`` replicas had them.
        self.unreplicated = 0

    def run(self, script, *, keys: list, args: list) -> Any:
        """``script`` run, then, with replication on, ``WAIT``ed for on its connection."""
        wanted = self.replication.replicas
        if not wanted:
            return script(keys=keys, args=args)
        try:
            if isinstance(self.client, RedisCluster):
                reply, replicas = self._on_cluster(script, keys, args)
            else:
                pipe = self.client.pipeline(transaction=False)
                script(keys=keys, args=args, client=pipe)
                pipe.wait(wanted, self.replication.timeout_ms)
                reply, replicas = pipe.execute()
        except redis.exceptions.ResponseError as error:  # pipelined: raised here, not by the script
            raise explain(script, error) from None
        if replicas < wanted:
            self.unreplicated += 1
            log.warning("write answered with %d of %d replicas after %d ms (%d so far): a failover now could lose it",
                        replicas, wanted, self.replication.timeout_ms, self.unreplicated)
        return reply

    def _on_cluster(self, script, keys: list, args: list) -> tuple[Any, int]:
        """The script and ``WAIT`` to the primary serving its slot, in one
        cluster pipeline (``EVALSHA`` by name: redis-py blocks its pipelined
        ``evalsha`` method, not the command). A script the node has not got
        (a promoted replica) is loaded on the slot's nodes and sent again:
        it did not run. Redirected (``MOVED``: the slot moved as it was sent),
        the script ran on the new primary and the ``WAIT`` on the old one,
        so it counts as answered with no replica."""
        cluster = self.client
        assert isinstance(cluster, RedisCluster)
        for _ in range(2):
            node = cluster.get_node_from_key(keys[0])
            pipe = cluster.pipeline()
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.replication.replicas, self.replication.timeout_ms, target_nodes=node)
            try:
                reply, replicas = pipe.execute()
            except redis.exceptions.NoScriptError:
                load_on_slot(cluster, script.script, keys[0])
                continue
            moved = cluster.get_node_from_key(keys[0]).name != node.name
            return reply, 0 if moved else int(replicas)
        raise redis.ConnectionError("the node serving this script's slot keeps losing its scripts (failing over)")

