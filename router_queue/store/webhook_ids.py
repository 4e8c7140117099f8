"""A webhook event's ``webhook-id``, declared once: the Python below and the
Lua ``webhook_id`` the scripts build it with (:func:`lua_webhook_id`,
offered beside ``lua/lib/`` by ``scripts.lib_for``) come from these templates.
It is stable across an event's attempts: a receiver dedupes on it."""

from __future__ import annotations

import re

#: The id of each event kind that has its own form; ``{id}`` the request's, ``{n}``
#: the progress event's number (1, 2, ...). "completed" is plain, as it was before there were others.
WEBHOOK_IDS = {"completed": "msg_{id}", "progress": "msg_{id}_progress_{n}"}
#: The id of any other kind (``{event}``: "started").
OTHER_WEBHOOK_ID = "msg_{id}_{event}"


def webhook_id(request_id: str, event: str = "completed", n: int = 0) -> str:
    """The ``webhook-id`` of the ``event`` of ``request_id`` (its ``n``-th, for progress)."""
    return WEBHOOK_IDS.get(event, OTHER_WEBHOOK_ID).format(id=request_id, event=event, n=n)


def _lua_concat(template: str) -> str:
    """``template`` as a Lua expression over the locals ``id``, ``event`` and ``n``."""
    parts = re.split(r"\{(id|event|n)\}", template)
    terms = [f'"{text}"' if i % 2 == 0 else text for i, text in enumerate(parts) if text]
    return " .. ".join(terms)


def lua_webhook_id() -> str:
    """Lua ``webhook_id(id, event, n)``: :func:`webhook_id`, from the same templates
    (``event`` nil: "completed"). ``tests/unit/test_webhook_ids.py`` runs both."""
    lines = ["local function webhook_id(id, event, n)\n", '  event = event or "completed"\n']
    for kind, template in WEBHOOK_IDS.items():
        lines.append(f'  if event == "{kind}" then\n    return {_lua_concat(template)}\n  end\n')
    lines.append(f"  return {_lua_concat(OTHER_WEBHOOK_ID)}\nend\n")
    return "".join(lines)
