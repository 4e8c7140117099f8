"""Request ids, settings parsing and Retry-After pacing."""

from __future__ import annotations

import fakeredis
import pytest

from router_queue.settings import Settings, SettingsError
from router_queue.states import COMPLETED, IN_PROGRESS, IN_QUEUE
from router_queue.store.ids import RequestIds, well_formed
from router_queue.store.record import RequestRecord
from router_queue.store.requests_values import Pace
from router_queue.web.pacing import retry_after


def test_ids_verify_only_for_the_workspace_and_model_they_were_minted_for():
    ids = RequestIds(fakeredis.FakeRedis())
    minted = {ids.mint("ws_a", "bfl/flux-2-pro") for _ in range(200)}
    assert len(minted) == 200
    for request_id in minted:
        assert well_formed(request_id)
        assert ids.is_ours(request_id, "ws_a", "bfl/flux-2-pro")
        assert not ids.is_ours(request_id, "ws_b", "bfl/flux-2-pro")
        assert not ids.is_ours(request_id, "ws_a", "vertexai/gemini-3.1-flash-image")
    assert not ids.is_ours("00000000-0000-9000-8000-000000000001", "ws_a", "bfl/flux-2-pro")
    assert not well_formed("../etc") and not well_formed("A" * 36)


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\x00", " ", "0"])
def test_an_id_is_matched_whole_so_no_trailing_byte_passes(tail):
    """``$`` alone lets a trailing newline through; ``uuid.UUID`` then raised (a 500)."""
    ids = RequestIds(fakeredis.FakeRedis())
    request_id = ids.mint("ws_a", "bfl/flux-2-pro")
    assert not well_formed(request_id + tail) and not well_formed(tail + request_id)
    assert not ids.is_ours(request_id + tail, "ws_a", "bfl/flux-2-pro")


def test_every_process_of_a_deployment_shares_the_id_secret():
    server = fakeredis.FakeServer()
    first = RequestIds(fakeredis.FakeRedis(server=server))
    second = RequestIds(fakeredis.FakeRedis(server=server))
    assert second.is_ours(first.mint("ws_a", "m/x"), "ws_a", "m/x")


def test_settings_come_from_the_environment_with_typed_defaults():
    settings = Settings.from_env({"REDIS_URL": "redis://r:6379/2", "RESULT_RETENTION_SECONDS": "60",
                                  "BFL_API_KEY": "secret-value"})
    assert settings.redis_url == "redis://r:6379/2"
    assert settings.effective_broker_url == "redis://r:6379/2"
    assert settings.result_retention_s == 60
    assert settings.max_body_bytes == 20_000_000
    assert "secret-value" not in repr(settings)
    assert settings.provider_credentials == {"BFL_API_KEY": "secret-value"}


@pytest.mark.parametrize("env,name", [({"RESULT_RETENTION_SECONDS": "a day"}, "RESULT_RETENTION_SECONDS"),
                                      ({"MAX_BODY_BYTES": "-1"}, "MAX_BODY_BYTES"),
                                      ({"REDIS_URL": "localhost"}, "REDIS_URL")])
def test_a_bad_setting_names_its_variable(env, name):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env(env)


def _record(status, started_at=None):
    return RequestRecord(id="r", workspace="w", model="m/x", provider="m", status=status, created_at=0.0,
                         started_at=started_at)


def test_the_back_of_the_queue_is_told_to_wait_longer_than_a_running_request():
    pace = Pace(avg_run_s=8.0, avg_gap_s=2.0)
    running = retry_after(_record(IN_PROGRESS, started_at=100.0), None, pace, now=102.0)
    front = retry_after(_record(IN_QUEUE), 0, pace, now=102.0)
    back = retry_after(_record(IN_QUEUE), 20, pace, now=102.0)
    assert running == 6
    assert 1 <= front < back
    assert back > running
    assert back <= 60


def test_retry_after_is_always_a_whole_second_or_more_and_zero_once_completed():
    for pace in (Pace(None, None), Pace(0.01, 0.001), Pace(10_000.0, 5_000.0)):
        for record, position in [(_record(IN_QUEUE), 0), (_record(IN_PROGRESS, started_at=0.0), None)]:
            assert retry_after(record, position, pace, now=1e6) >= 1
        assert retry_after(_record(COMPLETED), None, pace, now=1e6) == 0
