"""A script's arguments are named once in Python and read by name in Lua
(``scripts.argv``, ``lua_arg_names``)."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from router_queue.store import apikeys, requests, webhooks
from router_queue.store.scripts import argv, lua_arg_names

#: Every script that takes its ARGV by name, with the names it declares.
NAMED = {
    "admit": requests.ADMIT_ARGS, "claim": requests.CLAIM_ARGS, "complete": requests.COMPLETE_ARGS,
    "cancel": requests.CANCEL_ARGS, "expire_queued": requests.EXPIRE_QUEUED_ARGS, "webhook_take": webhooks.TAKE_ARGS,
    "webhook_record": webhooks.RECORD_ARGS, "key_mint": apikeys.MINT_ARGS, "key_rotate": apikeys.ROTATE_ARGS,
}


def test_arguments_go_in_their_declared_order_whatever_order_they_are_given():
    assert argv(("id", "now", "cap"), cap=3, id="r1", now="1.5") == ["r1", "1.5", 3]


@pytest.mark.parametrize("values", [{"id": "r1"}, {"id": "r1", "now": "1", "cap": 3, "extra": 1},
                                    {"id": "r1", "now": "1", "cpa": 3}])
def test_a_missing_or_undeclared_argument_is_refused(values):
    with pytest.raises(KeyError):
        argv(("id", "now", "cap"), **values)


def test_the_lua_names_are_each_arguments_position_and_the_first_after_them():
    assert lua_arg_names(("id", "now")).splitlines()[1:] == [
        "local ARG_ID = 1", "local ARG_NOW = 2", "local ARG_REST = 3"]
    assert lua_arg_names(()) == ""


@pytest.mark.parametrize("script", sorted(NAMED))
def test_a_named_script_reads_only_declared_names_and_no_bare_position(script):
    source = resources.files("router_queue.store").joinpath("lua", f"{script}.lua").read_text()
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("--"))
    read = set(re.findall(r"\bARG_(\w+)", code)) - {"REST"}
    assert read == {name.upper() for name in NAMED[script]}
    assert not re.search(r"ARGV\[\d", code)
