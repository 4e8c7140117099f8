"""The webhook retry policy: when a delivery that failed is tried again.

A failed attempt (no 2xx; a 410 stops at once) is tried again after the next
delay, jittered by ±20 %: 5 s, 30 s, 2 min, 10 min, 30 min, 1 h, then every
2 h. The window is counted from when the event was owed (the caller passes
the earlier of ``owed_at`` and ``first_attempt_at``): once the next attempt
would start past it, :func:`next_attempt_at` answers None and the event is
given up then (about 17 attempts in 24 h). Both are settings
(``WEBHOOK_RETRY_SCHEDULE``, ``WEBHOOK_RETRY_FOR_SECONDS``). In full:
``docs/ARCHITECTURE.md``, "Webhook delivery".
"""

from __future__ import annotations

import random

#: Seconds before attempt 2, 3, ...; the last repeats.
DEFAULT_DELAYS_S = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0)
#: Seconds after the window's start (when the event was owed) past which no attempt is made.
DEFAULT_WINDOW_S = 86_400.0
#: Each delay is multiplied by a random factor in [1 - JITTER, 1 + JITTER].
JITTER = 0.2


def delay_after(attempt: int, delays_s: tuple[float, ...] = DEFAULT_DELAYS_S,
                rand: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based), jittered."""
    base = delays_s[min(max(attempt, 1), len(delays_s)) - 1]
    return base * (rand or random).uniform(1 - JITTER, 1 + JITTER)


def next_attempt_at(attempt: int, now: float, first_attempt_at: float, *,
                    delays_s: tuple[float, ...] = DEFAULT_DELAYS_S, window_s: float = DEFAULT_WINDOW_S,
                    rand: random.Random | None = None) -> float | None:
    """When to try again after failed attempt ``attempt``; None once that
    would be past the window that began at ``first_attempt_at`` (the caller
    passes when the event was owed, if earlier): give up."""
    at = now + delay_after(attempt, delays_s, rand)
    return at if at <= first_attempt_at + window_s else None
