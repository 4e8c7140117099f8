"""Signed webhooks: which URLs we POST to (``safety``), what we POST and how
it is signed (``event``), and when a failed delivery is tried again
(``schedule``). The store keeps the events (``store/webhooks.py``), the
workers deliver them (``workers/webhooks.py``)."""
