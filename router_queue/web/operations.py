"""What operators read: liveness, readiness (``readiness.py``), Prometheus
metrics, and an operations page that refreshes itself.

Liveness and readiness answer on every port (probes, load balancers). The
metrics, the page and its JSON show every tenant's figures, so they answer
only on the operator listener: the port ``OPS_PORT`` names, which gunicorn
binds beside the public one (the Procfile's second ``--bind``, on
``OPS_HOST``) and which no proxy, Service or published port leads to. On any
other port they answer 404 (gunicorn sets ``SERVER_PORT`` from the socket,
not from ``Host``); there, with ``OPS_TOKEN`` set, they ask for it (``ops_token.py``).
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from werkzeug.exceptions import NotFound

from .. import metrics as process_metrics
from ..broker.celery_app import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE, queue_name
from ..errors import ServiceUnavailable, Unauthorized
from ..ops_token import CHALLENGE, admits
from ..services import Services
from ..store.fleet import FleetCollector
from ..store.gauges import QueueGauges
from ..store.members import rooms_by_place, serving_caps
from ..store.pin_groups import pin_groups
from ..store.webhooks import WebhookStore
from . import paths
from .bodies import json_response
from .front import front_door
from .headers import page
from .readiness import READINESS, Readiness
from .refusals import STORE_FULL_RETRY_S

operations = Blueprint("operations", __name__)

#: Answered on the operator listener only.
OPERATOR_ENDPOINTS = frozenset({"operations.metrics", "operations.ops_summary", "operations.ops_page"})
#: Failing webhook endpoints listed on the page, most failures first.
FAILING_SHOWN = 20
#: (model, error_type) rows of recent failures listed, most in the last hour first.
FAILURES_SHOWN = 50


def on_operator_listener(environ: dict, ops_port: int) -> bool:
    """Whether the server accepted this call on the operator port (0: none)."""
    return ops_port != 0 and environ.get("SERVER_PORT") == str(ops_port)


class OperatorUnauthorized(Unauthorized):
    """401 on the operator listener: no ``OPS_TOKEN``, or another one."""

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "WWW-Authenticate": CHALLENGE}


@operations.before_request
def _operators_only() -> None:
    if request.endpoint not in OPERATOR_ENDPOINTS:
        return
    settings = front_door().services.settings
    if not on_operator_listener(request.environ, settings.ops_port):
        raise NotFound()
    if not admits(request.headers.get("Authorization"), settings.ops_token):
        raise OperatorUnauthorized("the operator listener asks for OPS_TOKEN: send Authorization: Bearer <token> "
                                   "(in a browser: any user name, the token as password)")


@paths.HEALTHZ.view(operations)
def healthz() -> Response:
    """Liveness: the process answers. Touches no dependency on purpose."""
    return json_response({"status": "ok"})


@paths.READYZ.view(operations)
def readyz() -> Response:
    """Readiness: Redis answers, still holds the data this process served
    (``store/epoch.py``) and has room for writes, and the broker answers;
    else 503 service_unavailable saying which, within the front door's Redis
    wait (the broker is that Redis by default)."""
    readiness: Readiness = current_app.extensions[READINESS]
    readiness.answer(_check_ready)
    return json_response({"status": "ready"})


def _check_ready() -> None:
    front = front_door()
    front.services.accounts.epoch.check()
    unready = front.services.store.unready()
    if unready is not None:
        raise ServiceUnavailable(unready, retry_after=STORE_FULL_RETRY_S)
    if front.dispatcher.broker_is_store:
        return
    try:
        with front.dispatcher.celery.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:  # noqa: BLE001 - whatever the broker raised, it is not ready
        raise ServiceUnavailable(f"the broker cannot be reached: {exc}", retry_after=5) from None


@paths.METRICS.view(operations)
def metrics() -> Response:
    """The counters of every process sharing this one's directory (its
    gunicorn workers; in ``router-queue dev``, the whole stack), and the
    queue's state and the fleet's liveness read from Redis."""
    services = front_door().services
    queues = [queue_name(p) for p in services.catalog.providers()] + [WEBHOOKS_QUEUE, MAINTENANCE_QUEUE]
    text = generate_latest(process_metrics.exposed()) + generate_latest(_store_registry(services, queues))
    return Response(text, 200, content_type=CONTENT_TYPE_LATEST)


def _store_registry(services: Services, queues: list[str]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueGauges(services.redis, services.catalog))
    registry.register(FleetCollector(services.fleet, queues))
    return registry


def summary(services: Services) -> dict:
    """Per provider: waiting, in flight, cap, oldest wait, pace, the
    workspaces waiting (how many, the largest) and the live workers consuming
    its queue; the workers heard from; for the page and ``ops depths``."""
    store, catalog = services.store, services.catalog
    now = time.time()
    draining = store.draining(catalog.providers())
    fleet = services.fleet
    workers = fleet.workers()
    consuming = fleet.alive_per_queue([queue_name(p) for p in catalog.providers()], workers, now)
    rows = []
    for provider in catalog.providers():
        head = store.queue_head(provider, 1)
        pace = store.pace(provider)
        waiting_workspaces, largest = store.waiting_workspaces(provider)
        totals = store.delivery_totals(provider, now)
        rows.append({
            "provider": provider,
            "queued": store.queue_depth(provider),
            "in_flight": store.in_flight(provider),
            "cap": catalog.max_in_flight(provider),
            "oldest_wait_s": round(now - head[0].created_at, 1) if head else 0.0,
            "per_minute": totals.last_minute,
            "avg_run_s": round(pace.avg_run_s, 2) if pace.avg_run_s else 0.0,
            "avg_wait_s": round(totals.avg_wait_s, 2),
            "completed": totals.completed,
            "draining": provider in draining,
            "waiting_workspaces": waiting_workspaces,
            "largest": [{"workspace": ws, "waiting": n} for ws, n in largest],
            "workers": consuming[queue_name(provider)],
        })
    return {"providers": rows, "at": now, "webhooks": webhook_summary(services.webhooks, now),
            "members": pool_summary(services, now),
            "pins": pin_summary(services, now),
            "failures": recent_failures(services, now),
            "workers": [{"name": w.name, "queues": list(w.queues), "pid": w.pid,
                         "alive": w.alive(now, fleet.heartbeat_s), "last_heartbeat_s": round(now - w.beat_at, 1)}
                        for w in workers]}


def pool_summary(services: Services, now: float) -> list[dict]:
    """Each provider's pool members (``docs/POOLS.md``): slots held, the
    catalog's cap and the cap learned from 429s, seconds left paused or out,
    and their counts; for the page and ``ops members``."""
    rows = []
    for provider in services.catalog.providers():
        for state in services.members.states(provider, services.catalog.members(provider)):
            rows.append({"provider": provider, "member": state.member, "in_flight": state.in_flight,
                         "cap": state.cap, "learned_cap": state.learned_cap,
                         "paused_s": round(max(0.0, state.paused_until - now), 1),
                         "out_s": round(max(0.0, state.revoked_until - now), 1),
                         "taken": state.taken, "rate_limited": state.rate_limited, "revoked": state.revoked})
    return rows


def pin_summary(services: Services, now: float) -> list[dict]:
    """Each group of regions pinned workspaces wait in (``docs/POOLS.md``, "Region
    pins"): requests waiting, requests holding a slot and the room its members
    have now (their learned caps, a paused or out member's left out); for the
    page and ``ops pins``."""
    rows = []
    for provider in services.catalog.providers():
        groups = pin_groups(services.redis, provider)
        if not groups:
            continue
        members = services.catalog.members(provider)
        rooms = rooms_by_place(members, serving_caps(services.members.states(provider, members), now))
        rows += [{"provider": provider, "group": g.group, "waiting": g.waiting, "in_flight": g.in_flight,
                  "room": sum(rooms.get(place, 0) for place in g.group.split(","))} for g in groups]
    return rows


def recent_failures(services: Services, now: float) -> list[dict]:
    """Failures by model and error_type, in the last hour and day (``store/failures.py``):
    counts only, nothing that names a request, a workspace, a body or a URL."""
    if services.failures is None:
        return []
    rows = services.failures.recent(services.catalog.providers(), now)
    return [{"model": r.model, "error_type": r.error_type, "last_hour": r.last_hour, "last_24h": r.last_day}
            for r in rows[:FAILURES_SHOWN]]


def webhook_summary(webhooks: WebhookStore, now: float) -> dict:
    """Webhook deliveries for the page: pending, in flight, the failing
    endpoints (origins only: a URL's path and query may be its receiver's
    credential) and which of them have an open circuit."""
    failing = webhooks.failing()
    return {
        "pending": webhooks.pending(),
        "in_flight": webhooks.in_flight(now),
        "failing": [{"workspace": row.workspace, "origin": row.origin, "failures": row.failures,
                     "circuit": "closed" if row.open_until is None else "open",
                     "open_until": row.open_until} for row in failing[:FAILING_SHOWN]],
        "open_circuits": sum(1 for row in failing if row.open_until is not None),
    }


@paths.OPS_SUMMARY.view(operations)
def ops_summary() -> Response:
    return json_response(summary(front_door().services))


@paths.OPS_PAGE.view(operations)
def ops_page() -> Response:
    return page("ops.html", summary=summary(front_door().services))
