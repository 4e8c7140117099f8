"""The front door: the Flask app (``app.py``) and its routes.

``paths.py`` declares every route once, ``envelope.py`` is what every call
goes through (Flask's or the lane's, ``lane.py``), ``routes.py`` serves the
queued and synchronous routes, ``admission.py`` validates and admits a submit,
``auth.py`` and ``ratelimit.py`` say who calls
and how often, ``bodies.py``, ``pacing.py`` and ``openapi.py`` shape what is
answered, ``waiting.py`` holds a synchronous call until its request completes,
``catalog_routes.py`` serves discovery, ``operations.py`` the ops page and
``/metrics``, and ``gunicorn_worker.py`` is the worker class that serves it all.
"""
