"""WSGI entry point: ``gunicorn router_queue.wsgi:app``."""

from router_queue import logs
from router_queue.app import create_app
from router_queue.settings import Settings

settings = Settings.from_env()
logs.configure(settings.log_level)
app = create_app(settings)
