"""What Redis keeps about a result held in the object store, and the objects' names.

A result's object is named ``results/<hour>/<request id>-<nonce>``: the hour
it was written (UTC, ``YYYYMMDDHH``) lets the sweeper find objects whose
pointer was never recorded (a crash between the put and complete.lua) by
listing only the hours past retention, never the whole bucket; the nonce
keeps two deliveries of one request (a takeover) from writing one object.
"""

from __future__ import annotations

import calendar
import hashlib
import secrets
import time
from dataclasses import dataclass

#: The prefix under which every result object lives (inside OBJECT_STORE_URL's own).
RESULTS = "results"
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
