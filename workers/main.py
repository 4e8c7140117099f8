"""Worker and beat entry point: ``celery -A workers.main worker|beat``."""

from router_queue.settings import Settings
from workers.celery_app import make_celery

app = make_celery(Settings.from_env(), include=("workers.tasks",))
