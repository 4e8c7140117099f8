"""A workspace's region pin: the regions its generations may run in.

Kept on the workspace's hash (``regions``, comma-separated) by the operator
(``router-queue workspace set-regions``); read by the worker at each
delivery, so a pin set or cleared applies to every generation sent after
it, queued or not. The members a pinned request may use are those of its
regions and those the catalog marks ``any_region`` (``Member.serves``).
``docs/POOLS.md``, "Region pins".
"""

from __future__ import annotations

import re

import redis

from . import keys
from .scripts import argv, load_script

SET_ARGS = ("regions",)
#: A region's name, as clouds spell them (us-central1, europe-west4, eu).
REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


def parse(raw: str) -> tuple[str, ...]:
    """``us-central1,europe-west4`` as a pin; ValueError naming what is wrong."""
    regions = tuple(part.strip() for part in raw.split(","))
    bad = [region for region in regions if not REGION.fullmatch(region)]
    if bad:
        raise ValueError(f"a region is lowercase letters, digits and '-' (such as us-central1); got {bad}")
    return tuple(dict.fromkeys(regions))


class WorkspaceRegions:
    def __init__(self, client: redis.Redis):
        self.client = client
        self._set = load_script(client, "ws_regions", SET_ARGS)

    def set(self, workspace: str, regions: tuple[str, ...]) -> None:
        """Pin ``workspace`` to ``regions`` (none: unpin it); LookupError if there is no such workspace."""
        if not self._set(keys=[keys.workspace(workspace)], args=argv(SET_ARGS, regions=",".join(regions))):
            raise LookupError(f"no workspace {workspace}")

    def of(self, workspace: str) -> tuple[str, ...]:
        """The regions ``workspace`` is pinned to; () when it is not."""
        raw = self.client.hget(keys.workspace(workspace), "regions")
        return tuple(raw.decode().split(",")) if raw else ()
