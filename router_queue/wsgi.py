"""WSGI entry point: ``gunicorn router_queue.wsgi:app``."""

from . import logs
from .settings import Settings
from .web.app import create_app

settings = Settings.from_env()
logs.configure(settings.log_level)
settings.require_public_origin()
app = create_app(settings)
