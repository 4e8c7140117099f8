"""Structured JSON logs, one object per line, with the request's context.

Context (request id, workspace id, model, outcome) is bound with ``bound()``
where work on a request starts and cleared when it ends, and every line
logged meanwhile carries it. The API key is never part of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from typing import Iterator

from pythonjsonlogger.json import JsonFormatter

_context: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("router_queue_log_context", default={})  # noqa: B039 - never mutated: bound() sets a new dict


@contextlib.contextmanager
def bound(**fields: str | None) -> Iterator[None]:
    """Add ``fields`` to every log line inside the block."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _context.get().items():
            setattr(record, name, value)
        return True


#: gunicorn's loggers keep handlers of their own (formatted with
#: ``%(process)d``, which records no longer carry); they are given ours.
GUNICORN_LOGGERS = ("gunicorn.error", "gunicorn.access")


def configure(level: str = "INFO") -> None:
    """Route every logger (ours, Celery's, gunicorn's) through one JSON handler.

    Our lines carry no source location, thread or process, so the record does
    not collect them (the logging HOWTO's "Optimization"): finding the caller
    alone walks the stack and was a third of a submit's log line.
    """
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                       rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in GUNICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False


#: The logger of operator changes (keys minted, revoked, rotated).
AUDIT_LOGGER = "router_queue.audit"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_audit() -> None:
    """For a CLI command that changes something: its audit lines go to stderr
    as JSON even though the command configures no other logging (idempotent;
    the lines still propagate to whatever else is configured)."""
    logger = logging.getLogger(AUDIT_LOGGER)
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level",
                                                          "name": "logger"}))
        logger.addHandler(handler)
