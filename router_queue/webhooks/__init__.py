"""Signed webhooks, the whole feature but its Redis access: which URLs we POST
to (``safety``; its host's lookup bounded by ``lookup``), what we POST and how
it is signed (``event``), when a failed delivery is tried again
(``retry_policy``), delivering one attempt (``delivery``) and an endpoint's
origin (``endpoints``). The events a request owes are kept behind the store's
door (``store/webhooks.py``, the ``webhook_*.lua`` scripts);
``workers/tasks.py``'s ``deliver_webhook`` is the Celery shim."""
