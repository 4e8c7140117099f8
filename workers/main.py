"""Worker and beat entry point: ``celery -A workers.main worker|beat``."""

from celery.signals import setup_logging

from router_queue import logs, tracing
from router_queue.broker.celery_app import make_celery
from router_queue.settings import Settings
from workers.consumer import Heartbeat

settings = Settings.from_env()
tracing.configure(settings, "router-queue-worker")
app = make_celery(settings, include=("workers.tasks",))
app.steps["consumer"].add(Heartbeat)


@setup_logging.connect
def _json_logs(**_: object) -> None:
    """Celery's own lines and ours, as JSON through one handler."""
    logs.configure(settings.log_level)
