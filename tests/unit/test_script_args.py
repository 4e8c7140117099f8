"""A script's arguments are named once in Python and read by name in Lua
(``scripts.argv``, ``lua_arg_names``)."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from router_queue.requests.record import ADMITTED
from router_queue.store import (
    accounts,
    admission,
    apikeys,
    batches,
    budgets,
    bulk,
    fallback,
    held,
    members,
    migrate,
    model_fallback,
    owed,
    regions,
    requests_base,
    requests_delivery,
    requests_front,
    requests_maintenance,
    webhooks,
)
from router_queue.store.scripts import argv, lib_for, lua_arg_names

#: Every script that takes its ARGV by name, with the names it declares.
NAMED = {
    "admit": admission.ADMIT_ARGS, "admitted": admission.ADMITTED_ARGS, "admit_ws": admission.SPLIT_ADMIT_ARGS, "admit_place": admission.SPLIT_ADMIT_ARGS,
    "claim": requests_delivery.CLAIM_ARGS, "complete": requests_delivery.COMPLETE_ARGS,
    "cancel": requests_front.CANCEL_ARGS, "expire_queued": requests_maintenance.EXPIRE_QUEUED_ARGS, "webhook_take": webhooks.TAKE_ARGS,
    "webhook_record": webhooks.RECORD_ARGS, "webhook_turn": webhooks.TURN_ARGS,
    "webhook_turn_end": webhooks.TURN_END_ARGS, "key_mint": apikeys.MINT_ARGS, "key_rotate": apikeys.ROTATE_ARGS,
    "move_result": fallback.MOVE_ARGS, "admit_undo": admission.UNDO_ARGS, "grant": requests_maintenance.GRANT_ARGS,
    "grant_unsent": requests_base.GRANT_UNSENT_ARGS, "held_take": held.TAKE_ARGS, "history": requests_front.HISTORY_ARGS,
    "key_adopt": apikeys.ADOPT_ARGS, "key_resolve": apikeys.RESOLVE_ARGS, "key_revoke": apikeys.REVOKE_ARGS,
    "positions": requests_front.POSITIONS_ARGS, "progress": requests_delivery.PROGRESS_ARGS, "reap": requests_maintenance.REAP_ARGS,
    "renew": requests_delivery.RENEW_ARGS, "schedule_limits": accounts.LIMITS_ARGS, "status": requests_front.STATUS_ARGS,
    "webhook_due": webhooks.DUE_ARGS, "webhook_secret": accounts.SECRET_ARGS,
    "webhook_secret_reseal": migrate.RESEAL_ARGS, "ws_settle": owed.SETTLE_ARGS,
    "batch_commit": batches.COMMIT_ARGS, "batch_take": batches.TAKE_ARGS, "batch_progress": batches.PROGRESS_ARGS,
    "batch_finish": batches.FINISH_ARGS,
    "bulk_create": bulk.CREATE_ARGS, "bulk_note": bulk.NOTE_ARGS, "bulk_lease": bulk.LEASE_ARGS,
    "budget_sent": budgets.SENT_ARGS, "budget_take": budgets.TAKE_ARGS, "budget_publish": budgets.PUBLISH_ARGS,
    "member_take": members.TAKE_ARGS, "member_release": members.RELEASE_ARGS, "member_limited": members.LIMITED_ARGS,
    "fallback_turn": model_fallback.TURN_ARGS, "ws_regions": regions.SET_ARGS,
}
#: The scripts whose ARGV is one list of like items, not arguments: (calls or limit, window) pairs.
LISTS = {"rate", "rate_add"}
SCRIPTS = sorted(p.name[:-4] for p in resources.files("router_queue.store").joinpath("lua").iterdir()
                 if p.name.endswith(".lua"))


def test_every_script_takes_its_arguments_by_name():
    takes = {s for s in SCRIPTS if "ARGV" in _read(s)[1]}
    assert takes - LISTS == set(NAMED)


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
    read, code = _read(script)
    if script in SPLIT_STEPS:  # each reads its part of the names both declare
        assert read <= {name.upper() for name in NAMED[script]}
    else:
        assert read == {name.upper() for name in NAMED[script]}
    assert not re.search(r"ARGV\[\d", code)


#: Admission's two steps on a split store: one list of names for both.
SPLIT_STEPS = ("admit_ws", "admit_place")


def test_admissions_split_steps_read_every_name_they_declare_between_them():
    assert set().union(*(_read(script)[0] for script in SPLIT_STEPS)) \
        == {name.upper() for name in admission.SPLIT_ADMIT_ARGS}


def _read(script: str) -> tuple[set[str], str]:
    """The ARG_ names a script reads, itself or through the part of lua/lib/ it carries, and that code."""
    source = resources.files("router_queue.store").joinpath("lua", f"{script}.lua").read_text()
    source += lib_for(source)
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("--"))
    read = set(re.findall(r"\bARG_(\w+)", code)) - {"REST"}
    if re.search(r"ipairs\(ADMITTED_FIELDS\)", code):  # place_admission reads those by the generated list
        read |= {f.name.upper() for f in ADMITTED}
    return read, code
