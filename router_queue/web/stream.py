"""The event stream: ``GET …/requests/{id}/events`` as server-sent events.

One event per change, each carrying a status read's body and an ``id`` that
names the state shown, so a client reconnecting with ``Last-Event-ID`` is
sent only what it has not seen; a comment every ``HEARTBEAT_S``; the stream
ends after ``COMPLETED``, after ``MAX_STREAM_S`` or once its key stopped
working (``auth.HeldKey``). Waiting costs nothing: one :class:`EventHub` per
process holds the only pub/sub subscription (requests, queues, API keys),
and a stream sleeps on a local event until its request or its provider's
queue moved (a waiting position read at most once per ``POSITION_REFRESH_S``)
or its key's channel spoke. ``docs/ARCHITECTURE.md``, "Following it".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Iterator

import redis

from ..errors import Unauthorized
from ..states import COMPLETED, IN_QUEUE
from ..store.requests_front import FrontDoorRequests, event_source, key_event_source
from ..store.requests_values import StatusView
from .auth import HeldKey
from .bodies import status_body

log = logging.getLogger(__name__)

#: Seconds between two heartbeat comments on an idle stream.
HEARTBEAT_S = 15.0
#: A waiting request's position is read again at most this often.
POSITION_REFRESH_S = 1.0
#: A stream ends after this long; the client resumes with Last-Event-ID.
MAX_STREAM_S = 3600.0
#: Seconds the hub waits before it subscribes again after losing Redis.
RESUBSCRIBE_S = 1.0
#: Seconds the hub waits on its subscription at a time; with nobody left to
#: follow, it then lets the subscription go (the next stream starts it again).
LISTEN_S = 1.0


class Follower:
    """One stream's (or held synchronous call's) wake-up call: its request
    changed, or its provider's queue moved (only a waiting request's position
    can have; ``provider`` None: not woken for that); and the key it was
    opened with, checked while it waits (``key`` None: never)."""

    def __init__(self, request_id: str, provider: str | None, key: HeldKey | None = None):
        self.request_id = request_id
        self.provider = provider
        self.key = key
        self.event = threading.Event()
        self.changed = False
        self.woken = False

    def wake(self, changed: bool) -> None:
        self.changed = self.changed or changed
        self.woken = True
        self.event.set()

    def notice_key(self) -> None:
        """Its key's channel spoke, or the hub may have missed that: check it now."""
        if self.key is not None:
            self.key.noticed = True
            self.event.set()

    def wait(self, timeout: float) -> bool:
        """True when woken within ``timeout``; clears the call for the next wait.
        Its key is checked when due meanwhile: ``Unauthorized`` once it stopped."""
        ends = time.monotonic() + timeout
        while True:
            due = self.key.due_in() if self.key is not None else None
            left = ends - time.monotonic()
            self.event.wait(max(0.0, left if due is None else min(left, due)))
            self.event.clear()
            if self.key is not None and self.key.due_in() == 0.0:
                self.key.check()
            woken, self.woken = self.woken, False
            if woken or time.monotonic() >= ends:
                return woken


class EventHub:
    """The process's one subscription to every change notice, fanned out to the
    event streams and held synchronous calls that follow a request (or its
    provider). Started by the first follower, let go when the last one ends."""

    def __init__(self, store: FrontDoorRequests):
        self.store = store
        self._lock = threading.Lock()
        self._by_request: dict[str, set[Follower]] = defaultdict(set)
        self._by_provider: dict[str, set[Follower]] = defaultdict(set)
        self._by_key: dict[str, set[Follower]] = defaultdict(set)
        self._thread: threading.Thread | None = None

    def follow(self, request_id: str, provider: str | None = None, key: HeldKey | None = None) -> Follower:
        """Wake on the request's changes, with ``provider`` on its queue's moves
        too, and with ``key`` on that key's revocation or rotation."""
        follower = Follower(request_id, provider, key)
        with self._lock:
            self._by_request[request_id].add(follower)
            if provider is not None:
                self._by_provider[provider].add(follower)
            if key is not None:
                self._by_key[key.id].add(follower)
                key.followed()
            if self._thread is None:
                self._thread = threading.Thread(target=self._listen, name="event-hub", daemon=True)
                self._thread.start()
        return follower

    def unfollow(self, follower: Follower) -> None:
        with self._lock:
            key_id = follower.key.id if follower.key is not None else None
            for index, key in ((self._by_request, follower.request_id), (self._by_provider, follower.provider),
                               (self._by_key, key_id)):
                if key is None:  # followed without a provider: in no provider's set
                    continue
                followers = index.get(key)
                if followers is not None:
                    followers.discard(follower)
                    if not followers:
                        del index[key]

    def following(self) -> int:
        with self._lock:
            return sum(len(f) for f in self._by_request.values())

    def _dispatch(self, channel: str) -> None:
        key_id = key_event_source(channel)
        if key_id is not None:
            with self._lock:
                noticed = list(self._by_key.get(key_id, ()))
            for follower in noticed:
                follower.notice_key()
            return
        provider, request_id = event_source(channel)
        with self._lock:
            if provider:
                woken = list(self._by_provider.get(provider, ()))
            else:  # a request's channel; no request id only on a provider channel naming no provider
                woken = list(self._by_request.get(request_id, ())) if request_id is not None else []
        for follower in woken:
            follower.wake(changed=provider is None)

    def _wake_everyone(self) -> None:
        """After a gap in the subscription: every stream reads its status and
        checks its key again (either may have changed unannounced)."""
        with self._lock:
            woken = [f for followers in self._by_request.values() for f in followers]
        for follower in woken:
            follower.notice_key()
            follower.wake(changed=True)

    def _idle(self) -> bool:
        """With nobody following, the listener ends (under the lock, so a
        stream that follows meanwhile starts a new one)."""
        with self._lock:
            if self._by_request:
                return False
            self._thread = None
            return True

    def _listen(self) -> None:
        while True:
            feed = None
            try:
                feed = self.store.event_feed()
                self._wake_everyone()  # what was announced while we were not subscribed
                while True:
                    message = feed.get_message(timeout=LISTEN_S)
                    if message and message.get("type") == "pmessage":
                        self._dispatch(message["channel"])
                    elif message is None and self._idle():
                        return
            except redis.RedisError as exc:
                if self._idle():
                    return
                log.warning("event hub lost Redis (%s); subscribing again in %.0f s", exc, RESUBSCRIBE_S)
                time.sleep(RESUBSCRIBE_S)
            except Exception:  # the hub must outlive any one bad message (logged, so not a blind except)
                log.exception("event hub failed; subscribing again")
                time.sleep(RESUBSCRIBE_S)
            finally:
                if feed is not None:
                    feed.close()


def event_id(view: StatusView) -> str:
    """The state an event shows, as its ``id``: what a resuming client has seen."""
    record = view.record
    assert record is not None  # stream() ends on a view without one before it asks
    if record.status == COMPLETED:
        return f"{COMPLETED}:{record.error_type or 'success'}"
    if record.status == IN_QUEUE:
        return f"{IN_QUEUE}:{view.position or 0}"
    return f"{record.status}:{record.progress if record.progress is not None else ''}"


def _event_name(before: str | None, view: StatusView) -> str:
    record = view.record
    assert record is not None  # stream() ends on a view without one before it asks
    status = before.split(":", 1)[0] if before else None
    if record.status != status:
        return record.status.lower()
    return "queue_position" if record.status == IN_QUEUE else "progress"


def _frame(name: str, ident: str, body: dict) -> str:
    return f"id: {ident}\nevent: {name}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


def stream(store: FrontDoorRequests, hub: EventHub, view: StatusView, *, base: str, retention_s: int,
           last_event_id: str | None, key: HeldKey | None = None,
           clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """The frames of one stream, from ``view`` (the request as this caller may
    see it, read by the route) until COMPLETED, or until ``key`` (the one it
    was opened with) stops working."""
    record = view.record
    assert record is not None  # the route's view is one visible_view found
    request_id, provider = record.id, record.provider
    follower = hub.follow(request_id, provider, key)
    seen = last_event_id or None
    ends = clock() + MAX_STREAM_S
    read_at = clock()
    try:
        while True:
            if view.record is None:  # dropped past retention while followed
                return
            ident = event_id(view)
            if ident != seen:
                body = status_body(view.record, view.position, base, retention_s)
                yield _frame(_event_name(seen, view), ident, body)
                seen = ident
            if view.record.status == COMPLETED or clock() >= ends:
                return
            waiting = view.record.status == IN_QUEUE
            woken = follower.wait(min(HEARTBEAT_S, max(0.0, ends - clock())))
            if not woken:
                yield ": heartbeat\n\n"
                if not waiting:
                    continue  # a running request's changes all come with a notice
                # A position can also grow without one (another workspace's
                # arrivals): an idle waiting stream reads it at each heartbeat.
            elif not follower.changed:
                if not waiting:
                    continue  # its provider's queue moved; a running request has no position
                pause = read_at + POSITION_REFRESH_S - clock()
                if pause > 0:
                    time.sleep(pause)
            # Its own change is read on the primary that announced it; a
            # waiting request's position (its queue moved, or a heartbeat) on
            # the read replica. Only a waiting request reads there, and a
            # replica's lag can show no status earlier than IN_QUEUE, so a
            # stream never shows an earlier status than it has.
            own_change, follower.changed = follower.changed, False
            read_at = clock()
            view = store.status_view(request_id, provider, replica=not own_change)
    except Unauthorized:  # its key was revoked, or its overlap ended: reconnecting is refused
        log.info("event stream ended: its key stopped working", extra={"request_id": request_id})
        return
    finally:
        hub.unfollow(follower)
