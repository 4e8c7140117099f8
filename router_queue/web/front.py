"""The front door's parts, as the app factory registers them on the Flask app
and as routes and operator commands reach them: through :func:`front_door`."""

from __future__ import annotations

from dataclasses import dataclass

from flask import current_app

from ..services import Publisher, Services
from ..store.held import HeldSlots
from .auth import KeyResolver
from .stream import EventHub

#: The app's ``extensions`` entry that holds the :class:`FrontDoor`.
EXTENSION = "router_queue"


@dataclass
class FrontDoor:
    services: Services
    dispatcher: Publisher
    keys: KeyResolver
    #: The process's one subscription to change notices, for event streams
    #: and held synchronous calls.
    events: EventHub
    #: This process's slots in its workspaces' caps on held connections.
    held: HeldSlots


def front_door() -> FrontDoor:
    """The current app's parts. Routes fetch them once and hand them on:
    every ``current_app`` lookup goes through a context-local proxy."""
    return current_app.extensions[EXTENSION]
