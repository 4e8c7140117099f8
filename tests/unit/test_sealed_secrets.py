"""Webhook signing secrets sealed at rest with ``WEBHOOK_SECRETS_KEY``: Redis
holds no plaintext secret, signatures still verify with the standardwebhooks
library, no process starts without a key once a sealed secret exists, and
``router-queue ops migrate-keys`` seals plaintext secrets and those of an
older key after a rotation (fakeredis and real Redis)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from cryptography.fernet import Fernet
from standardwebhooks import Webhook

from router_queue.cli import main
from router_queue.services import Services
from router_queue.settings import Secret, Settings, SettingsError
from router_queue.store import keys
from router_queue.store.secret_box import SecretsKeyError
from router_queue.web.app import create_app
from router_queue.webhooks import event as webhook_event
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import ServicesCliRunner

OLD_KEY = Fernet.generate_key().decode()
NEW_KEY = Fernet.generate_key().decode()


def build(settings: Settings, client, *fernet_keys: str) -> Services:
    """The services of a process started with ``fernet_keys`` as WEBHOOK_SECRETS_KEY (none: unset)."""
    keyed = dataclasses.replace(settings, webhook_secrets_keys=tuple(Secret(k) for k in fernet_keys))
    return Services.build(keyed, client, dispatcher=RecordingDispatcher())


def stored(services: Services, workspace: str, field: str = "webhook_secret") -> bytes:
    return services.redis.hget(keys.workspace(workspace), field)


def test_redis_holds_the_secret_sealed_and_webhooks_still_verify(client, settings):
    services = build(settings, client, NEW_KEY)
    ws = services.accounts.create_workspace("sealed")
    secret = webhook_event.new_secret()
    services.accounts.webhook_secret(ws, secret)
    raw = stored(services, ws)
    assert raw.startswith(b"fernet:") and secret.encode() not in raw
    assert webhook_event._key(secret) not in raw  # nor its key bytes
    body = b'{"status": "COMPLETED"}'
    headers = webhook_event.signed_headers("msg_1", body, services.accounts.signing_secrets(ws), int(time.time()))
    assert Webhook(secret).verify(body, headers) is not None


def test_no_process_starts_without_a_key_that_opens_a_sealed_secret(client, settings):
    ws = build(settings, client, OLD_KEY).accounts.create_workspace("sealed")
    build(settings, client, OLD_KEY).accounts.webhook_secret(ws, webhook_event.new_secret())
    with pytest.raises(SecretsKeyError, match="WEBHOOK_SECRETS_KEY must be set"):
        build(settings, client)
    with pytest.raises(SecretsKeyError, match="opens none"):
        build(settings, client, NEW_KEY)
    assert build(settings, client, NEW_KEY, OLD_KEY).accounts.signing_secrets(ws)


def test_the_web_app_refuses_to_start_without_the_key(real_redis, real_redis_url, settings):
    sealing = build(settings, real_redis, OLD_KEY)
    sealing.accounts.webhook_secret(sealing.accounts.create_workspace("sealed"), webhook_event.new_secret())
    with pytest.raises(SecretsKeyError, match="WEBHOOK_SECRETS_KEY must be set"):
        create_app(dataclasses.replace(settings, redis_url=real_redis_url, webhook_secrets_keys=()))
    assert create_app(dataclasses.replace(settings, redis_url=real_redis_url,
                                          webhook_secrets_keys=(Secret(OLD_KEY),)))  # a key that opens them


def test_the_cli_makes_no_plaintext_secret(client, settings):
    services = build(settings, client)
    ws = services.accounts.create_workspace("unkeyed")
    refused = ServicesCliRunner(services).invoke(main, ["workspace", "webhook-secret", ws])
    assert refused.exit_code == 1 and "WEBHOOK_SECRETS_KEY is not set" in refused.output
    assert stored(services, ws) is None


def test_migrate_keys_seals_a_plaintext_secret(client, settings):
    before = build(settings, client)  # a store from before encryption: no key, plaintext
    ws = before.accounts.create_workspace("old")
    secret = webhook_event.new_secret()
    before.accounts.webhook_secret(ws, secret)
    assert stored(before, ws) == secret.encode()
    keyed = build(settings, client, NEW_KEY)
    assert keyed.accounts.signing_secrets(ws) == [secret]  # plaintext signs until migrated
    migrated = ServicesCliRunner(keyed).invoke(main, ["ops", "migrate-keys"])
    assert migrated.exit_code == 0 and "sealed 1 webhook secrets" in migrated.output, migrated.output
    assert stored(keyed, ws).startswith(b"fernet:") and secret.encode() not in stored(keyed, ws)
    assert build(settings, client, NEW_KEY).accounts.signing_secrets(ws) == [secret]
    with pytest.raises(SecretsKeyError):
        build(settings, client)


def test_a_rotation_to_a_new_key_with_the_old_one_listed_then_migrated(client, settings):
    old = build(settings, client, OLD_KEY)
    ws = old.accounts.create_workspace("rotating")
    first, second = webhook_event.new_secret(), webhook_event.new_secret()
    old.accounts.webhook_secret(ws, first)
    old.accounts.webhook_secret(ws, second, rotate=True)  # both sealed with OLD_KEY, both signing
    both = build(settings, client, NEW_KEY, OLD_KEY)
    assert both.accounts.signing_secrets(ws) == [second, first]
    migrated = ServicesCliRunner(both).invoke(main, ["ops", "migrate-keys"])
    assert "sealed 2 webhook secrets" in migrated.output, migrated.output
    again = ServicesCliRunner(both).invoke(main, ["ops", "migrate-keys"])
    assert "sealed 0 webhook secrets" in again.output
    new_only = build(settings, client, NEW_KEY)  # the old key dropped after the migration
    assert new_only.accounts.signing_secrets(ws) == [second, first]
    with pytest.raises(SecretsKeyError):
        build(settings, client, OLD_KEY)


def test_the_key_setting_names_itself_when_it_is_not_a_fernet_key():
    assert Settings.from_env({"WEBHOOK_SECRETS_KEY": f"{NEW_KEY}, {OLD_KEY}"}).webhook_secrets_keys == (
        NEW_KEY, OLD_KEY)
    assert "***" in repr(Settings.from_env({"WEBHOOK_SECRETS_KEY": NEW_KEY})) and NEW_KEY not in repr(
        Settings.from_env({"WEBHOOK_SECRETS_KEY": NEW_KEY}))
    with pytest.raises(SettingsError, match="WEBHOOK_SECRETS_KEY must be Fernet keys"):
        Settings.from_env({"WEBHOOK_SECRETS_KEY": "hunter2"})
