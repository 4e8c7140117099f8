"""WSGI entry point: ``gunicorn router_queue.wsgi:app``."""

from router_queue.app import create_app

app = create_app()
