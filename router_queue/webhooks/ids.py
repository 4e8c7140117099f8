"""A webhook event's ``webhook-id``, declared once: the Python below and the
Lua ``webhook_id`` the scripts build it with (``store/lua_declared.py``,
offered beside ``lua/lib/`` by ``scripts.lib_for``) come from these templates.
It is stable across an event's attempts: a receiver dedupes on it."""

from __future__ import annotations

#: The id of each event kind that has its own form; ``{id}`` the request's, ``{n}``
#: the progress event's number (1, 2, ...). "completed" is plain, as it was before there were others.
WEBHOOK_IDS = {"completed": "msg_{id}", "progress": "msg_{id}_progress_{n}"}
#: The id of any other kind (``{event}``: "started").
OTHER_WEBHOOK_ID = "msg_{id}_{event}"


def webhook_id(request_id: str, event: str = "completed", n: int = 0) -> str:
    """The ``webhook-id`` of the ``event`` of ``request_id`` (its ``n``-th, for progress)."""
    return WEBHOOK_IDS.get(event, OTHER_WEBHOOK_ID).format(id=request_id, event=event, n=n)
