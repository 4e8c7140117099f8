"""The webhook retry policy: when a delivery that failed is tried again.

An attempt that gets no 2xx (a timeout, a refused connection, a 5xx, a 3xx:
redirects are not followed, a 4xx other than 410) is tried again after the
next delay in the list below, each delay jittered by ±20 % so that the events a
receiver's outage failed together do not come back together:

    attempt    1    2     3      4       5       6      7, 8, ...
    after      -    5 s   30 s   2 min   10 min  30 min  1 h, then every 2 h

until 24 h after the first attempt: an attempt that would start later is not
made, and the event is given up (about 17 attempts in all). A 410 Gone stops
at once. The delays and the window are settings
(``WEBHOOK_RETRY_SCHEDULE``, ``WEBHOOK_RETRY_FOR_SECONDS``) so the tests can
run it in seconds. Attempts start when beat's sweeper publishes the due event
(every ``SWEEP_INTERVAL_SECONDS``), so each delay may run up to that much longer.
"""

from __future__ import annotations

import random

#: Seconds before attempt 2, 3, ...; the last repeats.
DEFAULT_DELAYS_S = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0)
#: Seconds after the first attempt past which no attempt is made.
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
    would be past the window that began at ``first_attempt_at``: give up."""
    at = now + delay_after(attempt, delays_s, rand)
    return at if at <= first_attempt_at + window_s else None
