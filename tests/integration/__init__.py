"""Integration tests: real redis-server, Celery worker and beat, gunicorn, stub provider."""
