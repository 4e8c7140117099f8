"""The store's consistency model is chosen once (``Services.build``) and every
store is handed it; a script that owes workspace effects is handed where they
go (``lua/effects/``), never a flag, and cannot load without it."""

from __future__ import annotations

import dataclasses

import pytest

from router_queue.services import Services
from router_queue.store import keys, requests_delivery, requests_front, requests_maintenance, webhooks
from router_queue.store.admission import OneStepAdmission, TwoStepAdmission
from router_queue.store.consistency import ONE_STEP, SPLIT_STEPS
from router_queue.store.effects import AppliedEffects
from router_queue.store.owed import OwedEffects
from router_queue.store.scripts import LuaLinkError, assemble
from tests.unit.conftest import RecordingDispatcher

#: The scripts whose steps owe workspace effects (a request's start and end, its last webhook's
#: end), with their arguments' names.
OWING = {"cancel": requests_front.CANCEL_ARGS, "claim": requests_delivery.CLAIM_ARGS,
         "complete": requests_delivery.COMPLETE_ARGS, "expire_queued": requests_maintenance.EXPIRE_QUEUED_ARGS,
         "webhook_take": webhooks.TAKE_ARGS, "webhook_record": webhooks.RECORD_ARGS}


@pytest.mark.parametrize("url, model, effects, admission",
                         [("redis://unused", ONE_STEP, AppliedEffects, OneStepAdmission),
                          ("redis+cluster://unused:7000", SPLIT_STEPS, OwedEffects, TwoStepAdmission)],
                         ids=["one Redis", "a cluster"])
def test_the_model_follows_the_store_and_every_store_is_handed_the_same_one(client, settings, url, model, effects,
                                                                            admission):
    settings = dataclasses.replace(settings, redis_url=url, broker_url="redis://unused-broker")
    services = Services.build(settings, client, dispatcher=RecordingDispatcher())
    assert services.consistency is model
    assert services.store.consistency is model and services.accounts.epoch.consistency is model
    assert isinstance(services.store.effects, effects)
    assert services.webhooks.effects is services.store.effects
    assert isinstance(services.store.admission, admission)


@pytest.mark.parametrize("script", OWING)
def test_a_script_that_owes_workspace_effects_does_not_load_without_their_target(script):
    with pytest.raises(LuaLinkError, match="ws_target"):
        assemble(script, OWING[script])


@pytest.mark.parametrize("script", OWING)
def test_each_target_links_its_own_ws_target_and_no_script_reads_a_split_argument(script):
    applied, owed = (assemble(script, OWING[script], target).text for target in ("applied", "owed"))
    assert "k.ws, k.ledger = ws_key, ledger_key" in applied and "k.owed =" not in applied
    assert "k.owed = owed_key" in owed and "k.ws, k.ledger =" not in owed
    assert "ARG_SPLIT" not in applied and "ARG_SPLIT" not in owed


def test_a_split_store_is_marked_with_its_first_workspace_and_one_redis_is_not(client, settings):
    Services.build(settings, client, dispatcher=RecordingDispatcher()).accounts.create_workspace("one")
    assert not client.exists(keys.split_steps())
    client.flushall()
    Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True).accounts.create_workspace("two")
    assert client.exists(keys.split_steps())
