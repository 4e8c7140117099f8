"""Every route of the front door, declared once.

Flask's blueprints register their views from these declarations
(:meth:`Route.view`), the lane matches its two routes with them
(:class:`Pattern`), the rate limits read which routes are exempt or carry
their allowance into their script, the error mapping reads which paths
address a request, and OpenAPI writes its paths from the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from operator import itemgetter
from typing import Callable

from flask import Blueprint


class Rate(Enum):
    """How a route's call is counted against its caller's rate (``ratelimit.py``)."""

    #: In its own round trip, before the route runs.
    SPENT = "spent"
    #: Inside the one script the route runs anyway; after it, if it ended before.
    CARRIED = "carried"
    #: Not at all: probes must always answer, and the operator listener's
    #: pages are the operators' own (elsewhere they answer 404 unread).
    EXEMPT = "exempt"


@dataclass(frozen=True)
class Route:
    #: ``blueprint.view``, as Flask names the endpoint.
    endpoint: str
    method: str
    #: werkzeug's rule: ``<name>`` is one non-empty path segment.
    rule: str
    rate: Rate = Rate.SPENT
    #: Answered by the lane in front of Flask when the call is a plain one.
    lane: bool = False

    def view(self, blueprint: Blueprint) -> Callable[[Callable], Callable]:
        """Register the decorated function on ``blueprint`` as this route."""
        name, view = self.endpoint.split(".")
        assert blueprint.name == name, f"{self.endpoint} is not a route of {blueprint.name}"

        def register(function: Callable) -> Callable:
            blueprint.add_url_rule(self.rule, endpoint=view, view_func=function, methods=[self.method])
            return function
        return register

    def openapi(self, model_id: str | None = None) -> str:
        """The rule as an OpenAPI path: a model's own when ``model_id`` is
        given (``provider/model``), and each other ``<name>`` as ``{name}``."""
        path = self.rule if model_id is None else self.rule.replace("<provider>/<model>", model_id)
        return re.sub(r"<(\w+)>", r"{\1}", path)


MODEL = "/v2/models/<provider>/<model>"
REQUESTS = f"{MODEL}/requests"
REQUEST = f"{REQUESTS}/<request_id>"

SUBMIT = Route("queue.submit", "POST", REQUESTS, Rate.CARRIED, lane=True)
STATUS = Route("queue.status", "GET", f"{REQUEST}/status", Rate.CARRIED, lane=True)
EVENTS = Route("queue.events", "GET", f"{REQUEST}/events")
RESULT = Route("queue.result", "GET", REQUEST, Rate.CARRIED)
LINK = Route("queue.link", "GET", f"{REQUEST}/link", Rate.CARRIED)
COST = Route("queue.cost", "GET", f"{MODEL}/cost")
RUN = Route("queue.run", "POST", MODEL, Rate.CARRIED)
RETRY = Route("queue.retry", "POST", f"{REQUEST}/retry")
CANCEL = Route("queue.cancel", "PUT", f"{REQUEST}/cancel")
HISTORY = Route("history.requests", "GET", "/v2/requests", Rate.CARRIED)
MODEL_HISTORY = Route("history.model_requests", "GET", REQUESTS, Rate.CARRIED)
BULK = Route("bulk.create", "POST", "/v2/requests/bulk")
BULK_PROGRESS = Route("bulk.progress", "GET", "/v2/requests/bulk/<bulk_id>")
USAGE = Route("usage.workspace_usage", "GET", "/v2/usage")
CATALOG = Route("discovery.list_models", "GET", "/v2/models")
MODEL_OPENAPI = Route("discovery.model_schema", "GET", f"{MODEL}/openapi.json")
API_OPENAPI = Route("discovery.openapi", "GET", "/v2/openapi.json")
DOCS = Route("discovery.docs", "GET", "/v2/docs")
HEALTHZ = Route("operations.healthz", "GET", "/healthz", Rate.EXEMPT)
READYZ = Route("operations.readyz", "GET", "/readyz", Rate.EXEMPT)
METRICS = Route("operations.metrics", "GET", "/metrics", Rate.EXEMPT)
OPS_SUMMARY = Route("operations.ops_summary", "GET", "/ops/summary.json", Rate.EXEMPT)
OPS_PAGE = Route("operations.ops_page", "GET", "/ops", Rate.EXEMPT)

# -- batches (issue 35: web/batches.py): each call counted once, as it opens --
BATCHES = "/v2/batches"
BATCH = f"{BATCHES}/<batch_id>"
BATCH_SUBMIT = Route("batches.submit", "POST", BATCHES)
BATCH_LIST = Route("batches.list_batches", "GET", BATCHES)
BATCH_STATUS = Route("batches.status", "GET", BATCH)
BATCH_RESULTS = Route("batches.results", "GET", f"{BATCH}/results")
BATCH_CANCEL = Route("batches.cancel", "PUT", f"{BATCH}/cancel")
BATCH_ROUTES = (BATCH_SUBMIT, BATCH_LIST, BATCH_STATUS, BATCH_RESULTS, BATCH_CANCEL)

ROUTES: tuple[Route, ...] = (
    SUBMIT, STATUS, EVENTS, RESULT, LINK, COST, RUN, RETRY, CANCEL, HISTORY, MODEL_HISTORY, CATALOG, MODEL_OPENAPI,
    API_OPENAPI, DOCS, HEALTHZ, READYZ, METRICS, OPS_SUMMARY, OPS_PAGE, *BATCH_ROUTES,
    BULK, BULK_PROGRESS, USAGE,
)


def endpoints(rate: Rate) -> frozenset[str]:
    """The endpoints whose calls are counted as ``rate`` says."""
    return frozenset(route.endpoint for route in ROUTES if route.rate is rate)


def prefix_pattern(rule: str) -> str:
    """A regular expression matching the paths that start with ``rule``."""
    return "^" + re.sub(r"<\w+>", "[^/]+", re.escape(rule).replace(r"\<", "<").replace(r"\>", ">"))


class Pattern:
    """A route's rule, matched as werkzeug's default converter would: the
    path split on ``/``, each literal segment equal, each ``<name>`` segment
    non-empty. (Compares by ``itemgetter``: the lane's matching runs no Python
    loop per segment.)"""

    def __init__(self, route: Route):
        segments = route.rule.split("/")
        variables = [i for i, s in enumerate(segments) if s.startswith("<")]
        literals = [i for i, s in enumerate(segments) if not s.startswith("<")]
        assert len(variables) > 1 and len(literals) > 1, "itemgetter of one index gives no tuple"
        self.route = route
        self.size = len(segments)
        self.literal_at = itemgetter(*literals)
        self.literals = tuple(segments[i] for i in literals)
        self.values_at = itemgetter(*variables)

    def match(self, parts: list[str]) -> tuple[str, ...] | None:
        """The rule's values in ``parts`` (a path split on ``/``), or None."""
        if len(parts) == self.size and self.literal_at(parts) == self.literals:
            values = self.values_at(parts)
            if all(values):
                return values
        return None
