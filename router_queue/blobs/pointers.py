"""What Redis keeps about a result or a body held in the object store, and the objects' names.

A result's object is named ``results/<hour>/<request id>-<nonce>``: the hour
it was written (UTC, ``YYYYMMDDHH``) lets the sweeper find objects whose
pointer was never recorded (a crash between the put and complete.lua) by
listing only the hours past retention, never the whole bucket; the nonce
keeps two deliveries of one request (a takeover) from writing one object.
A request body's is ``bodies/<hour>/<request id>-<nonce>`` (:class:`BodyPointer`).
"""

from __future__ import annotations

import calendar
import hashlib
import secrets
import time
from dataclasses import dataclass

#: The prefix under which every result object lives (inside OBJECT_STORE_URL's own).
RESULTS = "results"
#: The prefix under which every request body object lives.
BODIES = "bodies"
#: strftime of the hour segment of an object's name.
HOUR_FORMAT = "%Y%m%d%H"


@dataclass(frozen=True)
class ResultPointer:
    """An output held in the object store: the record's ``blob_*`` fields."""

    key: str
    size: int  # bytes
    sha256: str  # hex
    content_type: str

    @classmethod
    def of(cls, key: str, output: bytes, content_type: str) -> "ResultPointer":
        return cls(key, len(output), hashlib.sha256(output).hexdigest(), content_type)


@dataclass(frozen=True)
class BodyPointer:
    """A request body held in the object store. Its text stands in for the
    body in ``P:body:{id}`` (``lua/lib/body.lua``, ``BODY_POINTER``, reads its size):
    ``"\\0obj {size} {sha256} {object key}"``; a JSON body never begins with NUL."""

    key: str
    size: int  # bytes
    sha256: str  # hex

    PREFIX = "\0obj "

    @classmethod
    def of(cls, request_id: str, body: bytes, now: float | None = None) -> "BodyPointer":
        """A fresh object name for ``request_id``'s body, and its size and digest."""
        key = f"{BODIES}/{hour(time.time() if now is None else now)}/{request_id}-{secrets.token_hex(4)}"
        return cls(key, len(body), hashlib.sha256(body).hexdigest())

    def text(self) -> str:
        return f"{self.PREFIX}{self.size} {self.sha256} {self.key}"

    @classmethod
    def parse(cls, stored: bytes | str | None) -> "BodyPointer | None":
        """The pointer a stored body is, or None when it is the body itself."""
        if stored is None:
            return None
        text = stored.decode(errors="replace") if isinstance(stored, bytes) else stored
        if not text.startswith(cls.PREFIX):
            return None
        size, sha256, key = text[len(cls.PREFIX):].split(" ", 2)
        return cls(key, int(size), sha256)


def body_size(stored: bytes | str) -> int:
    """The bytes a stored body stands for: a pointer's size, else its length."""
    pointer = BodyPointer.parse(stored)
    if pointer is not None:
        return pointer.size
    return len(stored.encode()) if isinstance(stored, str) else len(stored)


def id_of(key: str) -> str:
    """The request id in an object's name (``…/<id>-<nonce>``)."""
    return key.rpartition("/")[2].rpartition("-")[0]


def hour(at: float) -> str:
    """The hour segment for a Unix time."""
    return time.strftime(HOUR_FORMAT, time.gmtime(at))


def result_key(request_id: str, now: float | None = None) -> str:
    """A fresh object name for ``request_id``'s output."""
    return f"{RESULTS}/{hour(time.time() if now is None else now)}/{request_id}-{secrets.token_hex(4)}"


def hour_of(prefix: str) -> float | None:
    """The Unix time an hour segment (``results/2026120601``) starts at, or
    None for a name this module did not make."""
    segment = prefix.rstrip("/").rpartition("/")[2]
    try:
        return float(calendar.timegm(time.strptime(segment, HOUR_FORMAT)))
    except ValueError:
        return None
