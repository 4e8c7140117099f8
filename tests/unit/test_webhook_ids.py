"""A webhook event's ``webhook-id`` is declared once (``webhooks/ids.py``):
the Lua the scripts build it with, run by a real script on fakeredis and on a
real Redis, gives what the Python gives, for every kind of event."""

from __future__ import annotations

import pytest

from router_queue.store.scripts import lib_for
from router_queue.webhooks.ids import webhook_id

#: Each kind of event, as the scripts build its id (lib/webhooks.lua's owe_webhook,
#: owe_started, owe_progress; webhook_record.lua's record without one).
BUILD = """
return {webhook_id(ARGV[1]), webhook_id(ARGV[1], "completed"), webhook_id(ARGV[1], "started"),
        webhook_id(ARGV[1], "progress", tonumber(ARGV[2]))}
"""
REQUEST_IDS = ("0f1e2d3c-4b5a-9987-a6b5-c4d3e2f1a03c", "0f1e2d3c-4b5a-9987-a6b5-c4d3e2f1a001")


@pytest.mark.parametrize("request_id", REQUEST_IDS)
@pytest.mark.parametrize("n", [1, 12])
def test_the_lua_webhook_id_is_the_pythons(client, request_id, n):
    script = client.register_script(lib_for(BUILD) + BUILD)
    built = [v.decode() for v in script(keys=[], args=[request_id, n])]
    assert built == [webhook_id(request_id), webhook_id(request_id, "completed"),
                     webhook_id(request_id, "started"), webhook_id(request_id, "progress", n)]


def test_the_ids_receivers_see_are_the_documented_ones():
    """docs/API.md: ``msg_<id>``, ``msg_<id>_started``, ``msg_<id>_progress_<n>``."""
    assert [webhook_id("r1"), webhook_id("r1", "started"), webhook_id("r1", "progress", 3)] \
        == ["msg_r1", "msg_r1_started", "msg_r1_progress_3"]
