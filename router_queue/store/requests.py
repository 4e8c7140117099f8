"""The request store: every read and write of request state in Redis, one
object with three parts by who calls them: the front door
(``requests_front.py``), delivery (``requests_delivery.py``) and maintenance
(``requests_maintenance.py``), over what they share (``requests_base.py``).
Its values are in ``requests_values.py``; the key layout in ``keys.py``."""

from __future__ import annotations

from .requests_delivery import DeliveryRequests
from .requests_front import FrontDoorRequests
from .requests_maintenance import MaintenanceRequests


class RequestStore(FrontDoorRequests, DeliveryRequests, MaintenanceRequests):
    """The whole store, as ``Services`` builds it; a caller may name the part it uses."""
