"""The broker wiring, imported by both sides: the Celery app factory, queue
and task names (``celery_app.py``), and how the front door and the granting
scripts publish a delivery (``dispatch.py``). Nothing here imports ``workers``."""
