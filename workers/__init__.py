"""Celery workers: one queue per provider, tasks that carry only a request id."""
