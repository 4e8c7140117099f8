"""Per-workspace quotas and their defaults.

Three quotas keep one workspace from taking what the others share (each is a
field of the workspace's hash, set with ``router-queue workspace set-limits``;
the defaults below apply until it is):

* ``max_held``: synchronous calls and event streams held open at once, across
  every front-door process. Each takes a slot in ``rq:held:{workspace}``
  (``held.py``, ``held_take.lua``) for as long as it is held; slots are
  leased and renewed by the process holding them, so a process that is
  killed frees its slots when their leases lapse.
* ``max_queued_bytes``: the bodies stored for its requests not yet completed
  (``admit.lua`` counts a body in, ``give_back_body`` in ``lib.lua`` out).
* ``max_pending_webhooks``: webhook events owed, or to be owed by a request
  admitted with a webhook, not yet delivered or given up (``admit.lua`` counts
  one in, ``webhook_record.lua`` out). A request cancelled at once still owes
  its event, so this bounds a submit-and-cancel flood.
"""

from __future__ import annotations

#: Synchronous calls and event streams a workspace may hold open at once.
DEFAULT_MAX_HELD = 100
#: Body bytes a workspace may have stored for requests not yet completed (256 MiB).
DEFAULT_MAX_QUEUED_BYTES = 256 * 1024 * 1024
#: Webhook events a workspace may have pending.
DEFAULT_MAX_PENDING_WEBHOOKS = 1000
