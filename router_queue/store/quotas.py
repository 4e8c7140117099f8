"""Per-workspace quotas and their defaults.

Four quotas keep one workspace from taking what the others share, each a
field of the workspace's hash (``router-queue workspace set-limits``; the
defaults below apply until it is set): ``max_held`` (synchronous calls and
event streams held open, leased slots: ``held.py``), ``max_queued_bytes``
(bodies of requests not yet completed), ``max_stored_bytes`` (bytes kept for
it wherever stored: kept bodies, once each, and results, until they expire) and
``max_pending_webhooks`` (requests admitted with a webhook whose last event
has not ended: this bounds a submit-and-cancel flood). Who counts each in and
out: ``docs/ARCHITECTURE.md``, "The store's parts"; ``docs/KEYS.md``.
"""

from __future__ import annotations

#: Synchronous calls and event streams a workspace may hold open at once.
DEFAULT_MAX_HELD = 100
#: Body bytes a workspace may have stored for requests not yet completed (256 MiB).
DEFAULT_MAX_QUEUED_BYTES = 256 * 1024 * 1024
#: Bytes a workspace may have kept (kept bodies and results, until they expire; 10 GiB).
DEFAULT_MAX_STORED_BYTES = 10 * 1024 * 1024 * 1024
#: Webhook events a workspace may have pending.
DEFAULT_MAX_PENDING_WEBHOOKS = 1000
