"""WSGI entry point: ``gunicorn router_queue.wsgi:app``."""

from . import logs, tracing
from .settings import Settings
from .web.app import create_app

settings = Settings.from_env()
logs.configure(settings.log_level)
settings.require_public_origin()
settings.require_ops_token(settings.ops_port)  # OPS_HOST beyond loopback: never an open operator listener
tracing.configure(settings, "router-queue-web")  # before the app: it decides whether the lane serves
app = create_app(settings)
