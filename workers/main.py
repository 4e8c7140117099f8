"""Worker and beat entry point: ``celery -A workers.main worker|beat``."""

import logging

from celery.signals import setup_logging, worker_init

from router_queue import logs, metrics, tracing
from router_queue.broker.celery_app import make_celery
from router_queue.ops_token import serve_metrics
from router_queue.settings import Settings, SettingsError
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
