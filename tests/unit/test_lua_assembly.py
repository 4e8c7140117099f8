"""Each script carries what it uses of lua/lib/ (scripts.lib_for), and nothing
it does not: Redis runs a script's whole text on every call."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from router_queue.store.scripts import all_definitions, lib_for

LUA = resources.files("router_queue.store").joinpath("lua")
SCRIPTS = sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua"))
#: The key layout's definitions, the webhook id's, the record's fields', then the lib files', each
#: after those it requires: the order a script gets them in.
LIB = "".join(d.text for d in all_definitions())
DEFINED = re.findall(r"^local (?:function )?(\w+)", LIB, re.M)


def _code(text: str) -> str:
    """``text`` without its comments and strings (a name in a string is no use of it)."""
    return re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', '""', re.sub(r"--.*$", "", text, flags=re.M))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_gets_every_lib_definition_it_names(script):
    body = LUA.joinpath(script).read_text()
    assembled = lib_for(body)
    kept = set(re.findall(r"^local (?:function )?(\w+)", assembled, re.M))
    named = {name for name in DEFINED if re.search(rf"\b{name}\b", _code(assembled + body))}
    assert named <= kept, f"{script} names {sorted(named - kept)} but lib_for left them out"
    assert [name for name in DEFINED if name in kept] == [n for n in re.findall(
        r"^local (?:function )?(\w+)", assembled, re.M)], "the layout's and the lib files' order is kept"


def test_a_status_read_carries_only_the_lib_definitions_it_calls():
    kept = re.findall(r"^local (?:function )?(\w+)", lib_for(LUA.joinpath("status.lua").read_text()), re.M)
    assert kept == ["rate_windows", "spend_rate", "PIN_TIES", "copy_group", "apart", "pin_apart", "position"]
    assert len(DEFINED) > 40
