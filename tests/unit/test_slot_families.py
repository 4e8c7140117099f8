"""Which scripts a Redis Cluster still cannot spread: on a split store every
script call's keys must belong to one family, a provider's (its requests and
schedule: ``{rq-<code>}``), a workspace's (its accounts, quotas and history:
``{ws:<id>}``) or the global one (API keys, configuration: ``{rq}``), each a
hash tag of its own, so that every call runs in one slot
(``docs/ARCHITECTURE.md``, "Redis Cluster").

A request's life runs here on a split store with every script call recorded:
a call whose keys (given, or built by the script from an id it read) mix
families, or span hash slots, fails this test."""

from __future__ import annotations

import re
import time

import pytest
from redis.crc import key_slot

from router_queue.requests.record import Submission
from router_queue.requests.values import Lease
from router_queue.services import Services
from router_queue.store import keys, scripts
from router_queue.web import ratelimit
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import record_of

MODEL = "bfl/flux-2-pro"
PROVIDER = "bfl"

#: The family of the keys a script builds itself from an id it read
#: (``keys.lua_layout``'s functions; the event channels are no keys).
BUILT = {"key_request": "provider", "key_webhook": "provider", "key_webhooks_due": "provider",
         "key_workspace": "workspace"}

def _family(key: str) -> str:
    """A key's family, by its hash tag."""
    if key.startswith(keys.PREFIX + ":"):
        return "global"
    if key.startswith("{rq-"):
        return "provider"
    if key.startswith("{ws:"):
        return "workspace"
    raise AssertionError(f"{key}: no family")


def _built_families(text: str) -> set[str]:
    """The families of the keys a script's text builds itself. ws_limits'
    read of a workspace's own hash is left out: it serves only a workspace
    waiting since before the schedule kept a copy of its limits, which a
    store split per slot never has (its schedules were written by this version)."""
    fallback = {d.name: d.text for d in scripts.all_definitions()}["ws_limits"]
    layout = {d.name for d in scripts._definitions(keys.lua_layout(), "layout")}
    code = "\n".join(line for line in text.replace(fallback, "").splitlines()
                     if not line.startswith("local ") or not any(f" {name}" in line for name in layout)
                     if not line.lstrip().startswith("--"))
    return {family for name, family in BUILT.items() if re.search(rf"\b{name}\b", code)}


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, set[str], set[int]]]:
    """Every script call of the services built after it: (script, the
    families of the keys it was given and of those it builds, the hash slots
    of the keys it was given)."""
    recorded: list[tuple[str, set[str], set[int]]] = []
    register = scripts.register_script

    def recording(client, text):
        script = register(client, text)
        name = re.search(r"^-- (\w+)\.lua:", text, re.M).group(1)
        built = _built_families(text)

        class Recorded:
            sha = script.sha

            def __call__(self, keys=(), args=(), client=None):
                names = [k.decode() if isinstance(k, bytes) else k for k in keys]
                recorded.append((name, {_family(k) for k in names} | built, {key_slot(k.encode()) for k in names}))
                return script(keys=keys, args=args, client=client)

        return Recorded()

    monkeypatch.setattr(scripts, "register_script", recording)
    return recorded


def test_on_a_split_store_every_script_call_keeps_to_one_family_and_one_slot(calls, client, settings):
    services = Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)
    ws = services.accounts.create_workspace("w", queue_enabled=True, credits=10**6)
    services.accounts.set_limits(ws, max_queued=100, weight=2, max_in_flight=3)
    services.accounts.webhook_secret(ws, "whsec_" + "a" * 32)
    minted = services.accounts.mint_key(ws)
    services.accounts.keys.resolve(minted)
    services.accounts.keys.revoke(services.accounts.keys.rotate(minted, overlap_s=60)[0])
    store = services.store

    def admit(**more) -> str:
        request_id = services.ids.mint(ws, MODEL)
        assert store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                           price=10, **more)).outcome.value == "ADMITTED"
        return request_id

    done = admit(fingerprint="f", idempotency_key_hash="k", webhook_url="https://hooks.example.com/h")
    store.claim(record_of(services, done, PROVIDER), Lease("t", 30, 3600, 3))
    store.record_progress(done, "t", 0.5)
    store.renew(done, PROVIDER, "t", 30)
    rate = ratelimit.Meter(ratelimit._allowance(f"ws:{ws}", "1000/minute"))
    store.status_view(done, PROVIDER, rate)
    store.complete(record_of(services, done, PROVIDER), output=b"{}", content_type="application/json")
    taken = services.webhooks.take(done, now=time.time(), lease_s=30, token="w1")
    services.webhooks.record(taken.event, token="w1", now=time.time(), outcome="delivered", status=200, error="",
                             seconds=0.1, next_at=None)
    failed = admit()
    store.claim(record_of(services, failed, PROVIDER), Lease("t2", 30, 3600, 3))
    store.complete(record_of(services, failed, PROVIDER), error_type="provider_error", detail="x")
    admit(retry_of=failed)
    store.cancel(request_id=admit(), workspace=ws, model=MODEL, provider=PROVIDER)
    store.expire_queued(admit(), PROVIDER, ws, queue_timeout_s=0, now=time.time() + 5)
    store.history(ws, since=0, rate=rate)
    store.history(ws, since=0, status="IN_QUEUE", model=MODEL)
    store.grant(PROVIDER)
    store.effects.reconcile(PROVIDER, time.time() + 60)
    store.admission.abandon(PROVIDER, time.time() + 60)

    mixed = {name for name, families, _ in calls if len(families) > 1}
    ran = {name for name, _, _ in calls}
    assert {"admit_ws", "admit_place", "claim", "complete", "ws_settle", "cancel", "expire_queued", "status", "rate",
            "webhook_take", "webhook_record", "history", "positions",
            "webhook_turn", "webhook_turn_end"} <= ran
    assert not mixed, f"calls mixing key families: {sorted(mixed)}"
    spread = {name for name, _, slots in calls if len(slots) > 1}
    assert not spread, f"calls whose keys span hash slots: {sorted(spread)}"
