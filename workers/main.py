"""Worker and beat entry point: ``celery -A workers.main worker|beat``."""

import logging

from celery.signals import beat_init, setup_logging, worker_init

from router_queue import logs, metrics, tracing
from router_queue.broker.celery_app import make_celery
from router_queue.ops_token import serve_metrics
from router_queue.services import WORKER_REDIS_WAIT_S, require_secrets_key, secret_box
from router_queue.settings import Settings, SettingsError
from router_queue.store.connect import UNREACHABLE, connect
from router_queue.store.secret_box import SecretsKeyError
from workers.consumer import Heartbeat

settings = Settings.from_env()
tracing.configure(settings, "router-queue-worker")
app = make_celery(settings, include=("workers.tasks",))
app.steps["consumer"].add(Heartbeat)


@setup_logging.connect
def _json_logs(**_: object) -> None:
    """Celery's own lines and ours, as JSON through one handler."""
    logs.configure(settings.log_level)


@worker_init.connect
def _serve_metrics(**_: object) -> None:
    """This worker's counters on ``WORKER_METRICS_PORT`` (none when 0). A
    port already taken (two workers on one machine) is logged, never fatal:
    the worker serves requests, the metrics are for watching it."""
    if not settings.worker_metrics_port:
        return
    try:
        settings.require_ops_token(settings.worker_metrics_port)
    except SettingsError as exc:  # Celery logs an Exception from a signal handler and runs on; this stops it
        raise SystemExit(f"router-queue worker: {exc}") from None
    try:
        serve_metrics(settings.worker_metrics_port, settings.ops_host, metrics.exposed(), settings.ops_token)
    except OSError as exc:
        logging.getLogger(__name__).error("metrics not served on %s:%d: %s", settings.ops_host,
                                          settings.worker_metrics_port, exc)


@worker_init.connect
@beat_init.connect
def _refuse_without_secrets_key(**_: object) -> None:
    """Refuse to start, as the front door does, without a WEBHOOK_SECRETS_KEY
    that opens the store's sealed webhook secrets (``SystemExit``: Celery logs
    and swallows a signal handler's ``Exception``)."""
    try:
        require_secrets_key(connect(settings.redis_url, wait_s=WORKER_REDIS_WAIT_S), secret_box(settings))
    except SecretsKeyError as exc:
        raise SystemExit(f"router-queue: {exc}") from None
    except UNREACHABLE:
        pass  # the worker waits for Redis as it always has
