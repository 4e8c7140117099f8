"""Each script carries what it uses of lib.lua (scripts.lib_for), and nothing
it does not: Redis runs a script's whole text on every call."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from router_queue.store import keys
from router_queue.store.record import lua_admitted_fields, lua_webhook_listed
from router_queue.store.scripts import lib_for
from router_queue.store.webhook_ids import lua_webhook_id

LUA = resources.files("router_queue.store").joinpath("lua")
SCRIPTS = sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua") and p.name != "lib.lua")
#: The key layout's definitions, the webhook id's, the record's fields', then lib.lua's: the order a
#: script gets them in.
LIB = (keys.lua_layout() + lua_webhook_id() + lua_admitted_fields() + lua_webhook_listed()
       + LUA.joinpath("lib.lua").read_text())
DEFINED = re.findall(r"^local (?:function )?(\w+)", LIB, re.M)


def _code(text: str) -> str:
    return re.sub(r"--.*$", "", text, flags=re.M)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_gets_every_lib_definition_it_names(script):
    body = LUA.joinpath(script).read_text()
    assembled = lib_for(body)
    kept = set(re.findall(r"^local (?:function )?(\w+)", assembled, re.M))
    named = {name for name in DEFINED if re.search(rf"\b{name}\b", _code(assembled + body))}
    assert named <= kept, f"{script} names {sorted(named - kept)} but lib_for left them out"
    assert [name for name in DEFINED if name in kept] == [n for n in re.findall(
        r"^local (?:function )?(\w+)", assembled, re.M)], "the layout's and lib.lua's order is kept"


def test_a_status_read_carries_two_of_lib_luas_definitions():
    kept = re.findall(r"^local (?:function )?(\w+)", lib_for(LUA.joinpath("status.lua").read_text()), re.M)
    assert kept == ["spend_rate", "position"]
    assert len(DEFINED) > 40
