"""Redis URLs as the settings and the store read them: ``redis://`` for one
server, ``sentinel://`` for a primary found through Sentinel, ``redis+cluster://``
for a Redis Cluster (``store/connect.py`` says how each is reached). Parsed here, below the settings, so a bad URL is an
error at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SENTINEL_SCHEME = "sentinel"
CLUSTER_SCHEME = "redis+cluster"


class RedisUrlError(ValueError):
    """A Redis URL we cannot use; the message says what is wrong."""


@dataclass(frozen=True)
class SentinelAddress:
    """A primary found through Sentinel: the parsed ``sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "SentinelAddress | None":
        """The address ``url`` names, or None when it is not a sentinel URL."""
        if not url.startswith(f"{SENTINEL_SCHEME}://"):
            return None
        sentinels, master_name, db, password = [], None, 0, None
        for part in url.split(";"):
            parsed = urlsplit(part.strip())
            if parsed.scheme != SENTINEL_SCHEME or not parsed.hostname:
                raise RedisUrlError(f"each part of a sentinel URL must be sentinel://HOST:PORT, got {part!r}")
            sentinels.append((parsed.hostname, parsed.port or 26379))
            password = unquote(parsed.password) if parsed.password else password
            if parsed.path.strip("/"):
                try:
                    db = int(parsed.path.strip("/"))
                except ValueError:
                    raise RedisUrlError("the database in a sentinel URL must be a number, "
                                        f"got {parsed.path!r}") from None
            master_name = parse_qs(parsed.query).get("master_name", [master_name])[0]
        if not master_name:
            raise RedisUrlError(f"a sentinel URL must name the primary: add ?master_name=NAME to {url!r}")
        return cls(tuple(sentinels), master_name, db, password)

    def kombu_url(self) -> str:
        """The URL kombu's ``sentinel`` transport reads (the master name goes
        in its transport options): every sentinel, each with the database."""
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"{SENTINEL_SCHEME}://{auth if i == 0 else ''}{host}:{port}/{self.db}"
                        for i, (host, port) in enumerate(self.sentinels))


@dataclass(frozen=True)
class ClusterAddress:
    """A Redis Cluster named by its seed nodes: ``redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT…]``.
    The client learns the rest of the cluster from whichever seed answers."""

    seeds: tuple[tuple[str, int], ...]
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "ClusterAddress | None":
        """The cluster ``url`` names, or None when it is not a cluster URL."""
        if not url.startswith(f"{CLUSTER_SCHEME}://"):
            return None
        rest = url[len(CLUSTER_SCHEME) + 3:]
        auth, _, hosts = rest.rpartition("@")
        hosts, _, path = hosts.partition("/")
        if path.strip("/") not in ("", "0"):
            raise RedisUrlError(f"a Redis Cluster has database 0 only, got /{path} in {url!r}")
        seeds = []
        for part in hosts.split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit():
                raise RedisUrlError(f"each seed of a cluster URL must be HOST:PORT, got {part!r}")
            seeds.append((host, int(port)))
        password = unquote(auth.partition(":")[2]) if auth else None
        return cls(tuple(seeds), password or None)
