"""What a provider's schedule holds of its region pins (``lua/lib/pins.lua``),
for the operator: each group of regions with requests waiting, how many
wait and how many of the group's requests hold a slot. Reads only, in one
round trip per provider that has a group waiting (the provider's slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from . import keys


@dataclass(frozen=True)
class PinGroup:
    provider: str
    #: The pin's regions that have members, sorted, "*" for the any_region members ("europe-west4,*").
    group: str
    waiting: int
    in_flight: int


def pin_groups(client: redis.Redis, provider: str) -> list[PinGroup]:
    """``provider``'s groups with requests waiting, by name."""
    base = keys.schedule(provider)
    groups = sorted(g.decode() for g in client.smembers(f"{base}:pins"))
    if not groups:
        return []
    pipe = client.pipeline(transaction=False)
    for group in groups:
        pipe.zcard(f"{base}:pslots:{group}")
    pipe.hmget(base, [f"pinrun|{group}" for group in groups])
    *waiting, running = pipe.execute()
    return [PinGroup(provider, group, int(w), int(r or 0))
            for group, w, r in zip(groups, waiting, running, strict=True)]
