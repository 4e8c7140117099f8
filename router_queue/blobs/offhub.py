"""Run blocking native calls where they cannot stall a gevent hub.

obstore's calls hold the GIL-free Rust runtime but block the calling OS
thread; on a monkey-patched gevent worker that thread is the hub's, so one
slow object-store read would stall every greenlet of the process. There they
run on gevent's threadpool, which parks only the calling greenlet. In a plain
process (Celery workers, the CLI, tests) they are called directly.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def on_hub() -> bool:
    """Whether gevent has patched this process's sockets (a gevent web worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched("socket"))


def call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``, on gevent's threadpool when on a hub."""
    if not on_hub():
        return function(*args, **kwargs)
    import gevent  # only reached in a gevent process

    return gevent.get_hub().threadpool.apply(function, args, kwargs)
