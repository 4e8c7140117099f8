"""Which member of its provider's pool a generation is sent to, and what a
member's own failures do to the request: nothing it is charged for.

A 429 is the member's pace, not the request's failure: it pauses that
member for the model (``store/members.py``) and the request goes to another member at
once, or waits for the first pause to end, without counting an attempt. A
refused credential (401, 403) takes its member out while another remains,
and the operator is told in the log. Either wait ends at the model's
longest run, as a hung provider's would. ``docs/POOLS.md``.
"""

from __future__ import annotations

import logging
import math
import time

from router_queue import states
from router_queue.catalog import ModelEntry
from router_queue.provider_pools import Member
from router_queue.services import Services
from router_queue.store.members import DEFAULT_PAUSE_S, Taken

from .providers import ProviderFailure

log = logging.getLogger(__name__)

#: The answers that say our credential, not the request, was refused.
REFUSED_CREDENTIAL = (401, 403)


def take(services: Services, entry: ModelEntry, request_id: str, prefer: str = "",
         regions: tuple[str, ...] = ()) -> tuple[Member | None, float]:
    """The member to send the generation to, holding one of its slots, and
    else (None) the seconds to wait before asking again (inf: no member
    serves ``regions``). ``prefer``: the member holding the generation an
    earlier delivery submitted (kept whatever the pin: it runs there). A
    429's pause holds it only when it was this model's (another model's
    quota is its own). ``regions``: its workspace's pin; only members serving it are asked."""
    pool = services.catalog.members(entry.provider)
    if regions:
        pool = tuple(member for member in pool if member.serves(regions) or member.name == prefer)
        if not pool:
            return None, math.inf
    taken: Taken = services.members.take(entry.provider, pool, request_id, hold_s=entry.policy.hung_after_s,
                                         prefer=prefer, model=entry.id)
    if taken.member is None:
        return None, taken.wait_s
    services.metrics.member_event(entry.provider, taken.member, "taken")
    return next(member for member in pool if member.name == taken.member), 0.0


def wait_after(services: Services, entry: ModelEntry, member: Member, failure: ProviderFailure) -> float | None:
    """Seconds before the request tries its pool again, not counted as an
    attempt, when ``failure`` was ``member``'s and not the request's; None
    when it was the request's (the call policy's retries apply)."""
    pool = services.catalog.members(entry.provider)
    if failure.http_status == 429:
        cap = services.members.rate_limited(entry.provider, member, failure.retry_after_s, model=entry.id)
        services.metrics.member_event(entry.provider, member.name, "rate_limited")
        pause = failure.retry_after_s or DEFAULT_PAUSE_S
        log.warning("%s member %s answered 429: paused %.1f s, its learned cap now %d",
                    entry.provider, member.name, pause, cap, extra={"member": member.name})
        return 0.0 if len(pool) > 1 else pause
    if failure.http_status in REFUSED_CREDENTIAL and len(pool) > 1:
        services.members.revoked(entry.provider, member)
        services.metrics.member_event(entry.provider, member.name, "revoked")
        log.error("%s member %s refused our credential (HTTP %d): taken out of the pool for now; check its key",
                  entry.provider, member.name, failure.http_status, extra={"member": member.name})
        return 0.0
    return None


def outside_pin(entry: ModelEntry, workspace: str, regions: tuple[str, ...]) -> ProviderFailure:
    """The failure a request ends with, unbilled, when no member of its
    provider's pool serves its workspace's region pin."""
    return ProviderFailure(states.PROVIDER_ERROR, f"no member of {entry.provider}'s pool serves workspace "
                                                  f"{workspace}'s regions ({', '.join(regions)}); nothing was "
                                                  "sent outside them")


def past_longest_run(entry: ModelEntry, started_at: float) -> ProviderFailure | None:
    """The failure a request ends with when its pool kept it waiting past the
    model's longest run; None while it may wait on."""
    if time.time() - started_at < entry.policy.max_run_s:
        return None
    return ProviderFailure(states.PROVIDER_ERROR, f"every member of {entry.provider}'s pool was paused, out or full "
                                                  f"for longer than {entry.policy.max_run_s:.0f} s")
