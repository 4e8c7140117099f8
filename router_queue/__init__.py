"""router-queue: queued delivery of AI model runs.

The core: the Flask front door (``web/``), the store, the broker wiring and
webhooks, and what the Celery workers (``workers/``) share with them.
"""
