"""Batches of requests (``POST /v2/batches``) past the front door: their
lines admitted in the background (``drain.py``), read back (``reading.py``),
finished and announced (``finish.py``)."""
