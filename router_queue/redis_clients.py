"""Redis clients for side work that must not wait as long as the store does."""

from __future__ import annotations

import redis


def bounded(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """The same server through a pool of its own whose socket waits are
    ``timeout_s``: a stalled Redis costs such a caller that long at most."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    return redis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))
