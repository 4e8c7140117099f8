"""A workspace's region pin: the regions its generations may run in.

Kept on the workspace's hash (``regions``, comma-separated) by the operator
(``router-queue workspace set-regions``); read by the worker at a delivery
and reused for ``REGION_PIN_CACHE_SECONDS`` in its process (every delivery
asks, pinned or not: the round trip is off its path), so a pin set or
cleared applies within those seconds to every generation sent after it,
queued or not, and at once in the process that set it. The members a pinned request may use are those of its
regions and those the catalog marks ``any_region`` (``Member.serves``).
``docs/POOLS.md``, "Region pins".
"""

from __future__ import annotations

import re
import time
from typing import Callable

import redis

from ..ttl_cache import TtlCache
from . import keys
from .scripts import argv, load_script

SET_ARGS = ("regions",)
#: A region's name, as clouds spell them (us-central1, europe-west4, eu).
REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
#: Workspaces whose pin a process keeps at most; when full, it starts afresh (``ttl_cache.TtlCache``).
CACHE_MAX_ENTRIES = 10_000


def parse(raw: str) -> tuple[str, ...]:
    """``us-central1,europe-west4`` as a pin; ValueError naming what is wrong."""
    regions = tuple(part.strip() for part in raw.split(","))
    bad = [region for region in regions if not REGION.fullmatch(region)]
    if bad:
        raise ValueError(f"a region is lowercase letters, digits and '-' (such as us-central1); got {bad}")
    return tuple(dict.fromkeys(regions))


class WorkspaceRegions:
    def __init__(self, client: redis.Redis, *, cache_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.cache_s = cache_s
        self.clock = clock
        #: workspace -> its pin, until ``cache_s`` after it was read (``self.clock``'s times)
        self._cache: TtlCache[str, tuple[str, ...]] = TtlCache(CACHE_MAX_ENTRIES)
        self._set = load_script(client, "ws_regions", SET_ARGS)

    def set(self, workspace: str, regions: tuple[str, ...]) -> None:
        """Pin ``workspace`` to ``regions`` (none: unpin it); LookupError if there is no such workspace."""
        if not self._set(keys=[keys.workspace(workspace)], args=argv(SET_ARGS, regions=",".join(regions))):
            raise LookupError(f"no workspace {workspace}")
        self._cache.drop(workspace)

    def of(self, workspace: str) -> tuple[str, ...]:
        """The regions ``workspace`` is pinned to; () when it is not. Read
        at most once per ``cache_s`` per workspace in this process."""
        now = self.clock()
        cached = self._cache.fresh(workspace, now)
        if cached is not None:
            return cached
        raw = self.client.hget(keys.workspace(workspace), "regions")
        pinned = tuple(raw.decode().split(",")) if raw else ()
        if self.cache_s > 0:
            self._cache.put(workspace, pinned, now + self.cache_s)
        return pinned
