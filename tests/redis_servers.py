"""redis-server processes of the tests' own, on free loopback ports.

Every suite runs on servers it starts: two suites on one machine (or a suite
beside a developer's own Redis) never flush each other's data. ``TEST_REDIS_URL``
names a server to use instead; the tests then flush its databases 13, 14 and 15.
A private server that can be killed and restarted with its data, and a primary
with a replica and three sentinels, serve the fault tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import pytest

from router_queue.dev.stack import cluster_port, free_port, redis_answers, wait_for_port

#: A Redis server the tests may use (databases 13 to 15 are flushed), instead of private ones.
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "")
#: The databases each kind of test owns on the session's server.
UNIT_DB, CHAOS_DB, STACK_DB = 13, 14, 15


def with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def terminate(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """Stop a process the tests started: SIGTERM, and SIGKILL if it is still
    there after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class PrivateRedis:
    """``redis-server`` on a port of its own. With ``persist`` (the default), its
    append-only file is on (fsync always), so killing it and starting it again
    on the same port keeps every write."""

    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    #: More redis-server arguments (a replica's ``--replicaof``).
    extra: tuple[str, ...] = ()
    persist: bool = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("no redis-server binary on PATH")
        log = open(self.directory / "redis.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 *(("--appendonly", "yes", "--appendfsync", "always") if self.persist else ("--appendonly", "no")),
                 "--dir", str(self.directory), *self.extra],
                stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        wait_for_port(self.port, proc=self.proc)
        wait_for(self.answers, timeout_s=10, what=f"redis-server on {self.port} answering PING")

    def answers(self) -> bool:
        return redis_answers(self.url)

    def kill(self) -> None:
        """SIGKILL: a crash. Connections are reset and new ones refused until ``start``."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a hung server. Connections are accepted (by the kernel) and never answered."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
        terminate(self.proc)


class SentinelGroup:
    """A primary, its replica and three sentinels (quorum 2) on ports of their
    own, as an ops team runs Redis for high availability; :attr:`url` is the
    ``sentinel://`` URL the stack is given."""

    MASTER = "rq"
    #: How long the sentinels wait before they call a silent primary down.
    DOWN_AFTER_MS = 1000

    def __init__(self, directory: Path):
        self.directory = directory
        self.primary = PrivateRedis(self._dir("primary"))
        self.replica = PrivateRedis(self._dir("replica"), extra=("--replicaof", "127.0.0.1", str(self.primary.port)))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []

    def _dir(self, name: str) -> Path:
        path = self.directory / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports) + (
            f"/0?master_name={self.MASTER}")

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        wait_for(lambda: self._role(self.replica.port).get("master_link_status") == "up", timeout_s=10,
                 what="the replica in sync with the primary")
        for port in self.sentinel_ports:
            directory = self._dir(f"sentinel-{port}")
            conf = directory / "sentinel.conf"  # a sentinel rewrites its file: one each
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {directory}",
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {self.MASTER} {self.DOWN_AFTER_MS}",
                f"sentinel failover-timeout {self.MASTER} 10000",
                f"sentinel parallel-syncs {self.MASTER} 1", ""]))
            with open(directory / "sentinel.log", "ab") as log:
                self.sentinels.append(subprocess.Popen([shutil.which("redis-server"), str(conf), "--sentinel"],
                                                       stdout=log, stderr=subprocess.STDOUT))
            wait_for_port(port, proc=self.sentinels[-1])
        wait_for(lambda: all(self.master_port(p) == self.primary.port for p in self.sentinel_ports), timeout_s=10,
                 what="every sentinel naming the primary")
        # a sentinel learns of the replica and its peers from the primary's hello channel
        wait_for(lambda: all(self._peers(p) == 2 for p in self.sentinel_ports), timeout_s=15,
                 what="the sentinels knowing each other")

    def _role(self, port: int) -> dict:
        import redis

        with redis.Redis(port=port, socket_timeout=1) as client:
            return client.info("replication")

    def _sentinel(self, port: int):
        import redis

        return redis.Redis(port=port, socket_timeout=1, decode_responses=True)

    def _peers(self, sentinel_port: int) -> int:
        """The other sentinels this one knows (redis-py's parse of SENTINEL MASTER breaks)."""
        with self._sentinel(sentinel_port) as client:
            fields = client.execute_command("SENTINEL", "MASTER", self.MASTER)
        return int(dict(zip(fields[::2], fields[1::2]))["num-other-sentinels"])

    def master_port(self, sentinel_port: int) -> int | None:
        with self._sentinel(sentinel_port) as client:
            address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)
        return int(address[1]) if address else None

    def kill_primary(self) -> None:
        """SIGKILL the primary: the sentinels promote the replica."""
        self.primary.kill()

    def promoted(self) -> bool:
        """Whether a sentinel names the replica the primary (a sentinel switches
        only once the replica has taken the role, and never switches back)."""
        return any(self.master_port(p) == self.replica.port for p in self.sentinel_ports)

    def stop(self) -> None:
        for proc in self.sentinels:
            terminate(proc)
        self.replica.stop()
        self.primary.stop()


def redis_errors() -> type[Exception]:
    import redis

    return redis.RedisError


class ClusterGroup:
    """A Redis Cluster of our own: three primaries and a replica of each
    (``redis-cli --cluster create``), a node called down after 1 s; :attr:`url`
    is the ``redis+cluster://`` URL the stack is given."""

    NODE_TIMEOUT_MS = 1000
    PRIMARIES = 3

    def __init__(self, directory: Path, size: int = 6):
        self.directory = directory
        self.nodes = []
        for n in range(size):
            node_dir = directory / f"node-{n}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(PrivateRedis(node_dir, port=cluster_port(), extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS))))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:3])

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run([shutil.which("redis-cli"), "--cluster", "create",
                        *(f"127.0.0.1:{node.port}" for node in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_for(lambda: all(self._info(node.port).get("cluster_state") == "ok" for node in self.nodes),
                 timeout_s=30, what="every cluster node reporting cluster_state:ok")
        wait_for(lambda: all(self._role(node.port).get("master_link_status", "up") == "up" for node in self.nodes),
                 timeout_s=30, what="every replica in sync")
        # a client learns the replicas from CLUSTER SLOTS, which lists one once the cluster agrees on it
        wait_for(lambda: all(len(nodes) == len(self.nodes) // self.PRIMARIES
                             for node in self.nodes for nodes in self._slot_ranges(node.port)),
                 timeout_s=30, what="every node listing each slot range's replica")

    def _client(self, port: int):
        import redis

        # a node mid-failover on a loaded machine can take a while to answer
        return redis.Redis(port=port, socket_timeout=3, decode_responses=True)

    def _info(self, port: int) -> dict:
        with self._client(port) as client:
            text = client.execute_command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)

    def _role(self, port: int) -> dict:
        with self._client(port) as client:
            return client.info("replication")

    def _slot_ranges(self, port: int) -> list[list]:
        """Each slot range's nodes (primary first), as the node at ``port`` lists them."""
        with self._client(port) as client:
            return [nodes for _, _, *nodes in client.execute_command("CLUSTER", "SLOTS")]

    def serving(self, key: str) -> list[PrivateRedis]:
        """The nodes of ``key``'s slot, its primary first, as a live node sees them."""
        live = next(node for node in self.nodes if node.proc is not None and node.proc.poll() is None)
        with self._client(live.port) as client:
            slot = client.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, *nodes in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    ports = [int(node[1]) for node in nodes]
                    return [next(node for node in self.nodes if node.port == port) for port in ports]
        raise AssertionError(f"no node serves {key}'s slot")

    def owner(self, key: str) -> PrivateRedis:
        """The node serving ``key``'s slot as its primary."""
        return self.serving(key)[0]

    def moved_from(self, node: PrivateRedis, key: str) -> bool:
        """Whether some live node names another primary for ``key``'s slot: the
        replica promoted (the first to know is the promoted one itself)."""
        for other in self.nodes:
            if other is node or other.proc is None or other.proc.poll() is not None:
                continue
            try:
                with self._client(other.port) as client:
                    slot = client.execute_command("CLUSTER", "KEYSLOT", key)
                    owners = [int(primary[1]) for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS")
                              if start <= slot <= end]
            except (OSError, redis_errors()):
                continue  # stalled, or mid-failover
            if owners and owners[0] != node.port:
                return True
        return False

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
