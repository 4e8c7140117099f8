"""The key layout: each family under a hash tag of its own, so that a script's
keys share one Redis Cluster slot, and the Lua that builds keys from an id it
read (``keys.lua_layout``) builds what the Python does."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from router_queue.catalog import Catalog
from router_queue.services import Services
from router_queue.store import keys
from router_queue.store.ids import RequestIds, well_formed
from router_queue.store.scripts import lib_for
from tests import earlier_store as earlier
from tests.unit.conftest import RecordingDispatcher

BUILD = """
return {key_request(ARGV[1]), key_webhook(ARGV[1]), key_webhook(ARGV[1]) .. KEY_WEBHOOK_NEXT,
        key_webhooks_due(ARGV[1], ARGV[2]), key_workspace(ARGV[3]), key_body(ARGV[1]), key_body_refs(ARGV[1]),
        key_stored(ARGV[3]), key_objects(ARGV[1], ARGV[2])}
"""


@pytest.mark.parametrize("provider", ["bfl", "openai", "vertexai"])
def test_a_requests_keys_share_its_providers_slot(client, provider):
    request_id = RequestIds(client).mint("ws_1", f"{provider}/some-model")
    slots = {key_slot(name.encode()) for name in (
        keys.request(request_id), keys.result(request_id), keys.body(request_id), keys.body_refs(request_id),
        keys.webhook_event(request_id),
        keys.webhook_next(request_id), keys.schedule(provider), keys.queue(provider), keys.running(provider),
        keys.deadlines(provider), keys.stats(provider), keys.owed(provider), keys.admitting(provider),
        keys.webhooks_due(provider), keys.webhooks_due(provider, request_id))}
    assert slots == {key_slot(keys.code_tag(keys.provider_code(provider)).encode())}


def test_a_workspaces_keys_share_one_slot_apart_from_the_global_ones():
    ws = "ws_0123456789abcdef"
    slots = {key_slot(name.encode()) for name in (
        keys.workspace(ws), keys.ledger(ws), keys.idempotency(ws, "h"), keys.open_requests(ws), keys.history(ws),
        keys.model_history(ws, "bfl/flux-2-pro"), keys.held(ws), keys.rate_window("LIMITER/ws:x/10/1/minute", ws),
        keys.webhook_log(ws), keys.webhook_in_flight(ws), keys.stored(ws), keys.webhook_circuit(ws, "https://a.example"))}
    assert len(slots) == 1
    assert slots != {key_slot(keys.workspaces().encode())}
    assert key_slot(keys.rate_window("LIMITER/unknown:1.2.3.4/10/1/minute").encode()) \
        == key_slot(keys.workspaces().encode())


def test_an_id_verifies_only_with_its_providers_code_and_one_minted_before_codes_not_at_all(client):
    ids = RequestIds(client)
    new = ids.mint("ws_1", "bfl/flux-2-pro")
    assert new[14] == "9" and new[-2:] == keys.provider_code("bfl") and ids.is_ours(new, "ws_1", "bfl/flux-2-pro")
    forged = new[:-2] + format((int(new[-2:], 16) + 1) % 256, "02x")  # moved to another provider's slot
    assert not ids.is_ours(forged, "ws_1", "bfl/flux-2-pro")
    old = earlier.version_8_id(client, "ws_1", "bfl/flux-2-pro")  # an earlier version's, with the same secret
    assert not well_formed(old) and not ids.is_ours(old, "ws_1", "bfl/flux-2-pro")


def test_the_lua_builds_the_keys_the_python_does(client):
    request_id = "5b0c8e2a-9d41-9f3e-b2c4-7a1e0d9c3f0e"
    script = client.register_script(lib_for(BUILD) + BUILD)
    built = [v.decode() for v in script(args=[request_id, "bfl", "ws_9"])]
    assert built == [keys.request(request_id), keys.webhook_event(request_id), keys.webhook_next(request_id),
                     keys.webhooks_due("bfl", request_id), keys.workspace("ws_9"), keys.body(request_id),
                     keys.body_refs(request_id), keys.stored("ws_9"), keys.result_objects("bfl", request_id)]


def test_each_catalog_provider_has_a_code_of_its_own_and_a_third_of_an_even_cluster(settings):
    providers = Catalog.load(settings.catalog_path).providers()
    assert set(providers) <= set(keys.PROVIDER_CODES)
    thirds = {key_slot(keys.provider_prefix(provider).encode()) * 3 // 16384 for provider in providers}
    assert thirds == {0, 1, 2}


def test_an_id_is_read_only_under_its_own_provider(client, settings):
    one_redis = Services.build(settings, client, dispatcher=RecordingDispatcher())
    split = Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)
    minted = one_redis.ids.mint("ws_1", "openai/gpt-4o-mini-tts")
    for services in (one_redis, split):
        assert services.store.addressable(minted, "openai")
        assert not services.store.addressable(minted, "bfl")  # its keys are in openai's slot
        assert not services.store.addressable(minted.upper(), "openai")
        # minted before ids carried codes (version 8), on one Redis too: no longer read
        assert not services.store.addressable(earlier.version_8_id(client, "ws_1", "bfl/flux-2-pro"), "bfl")
