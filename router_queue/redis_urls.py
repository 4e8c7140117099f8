"""Redis URLs as the settings and the store read them: ``redis://`` for one
server, ``sentinel://`` for a primary found through Sentinel (``store/connect.py``
says how each is reached). Parsed here, below the settings, so a bad URL is an
error at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SENTINEL_SCHEME = "sentinel"


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
