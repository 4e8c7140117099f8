"""What the public and operator listeners cost and admit: /readyz reused for a
second, the operator listener behind OPS_TOKEN, keyless callers counted by
their forwarded address from a trusted proxy only."""

from __future__ import annotations

import base64
import dataclasses
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter

from router_queue.dev.stack import free_port
from router_queue.ops_token import serve_metrics
from router_queue.services import Services
from router_queue.settings import Settings, SettingsError
from router_queue.web.app import create_app
from router_queue.web.readiness import READINESS, Readiness
from tests.unit.conftest import OperatorClient, RecordingDispatcher
from tests.unit.route_support import FLUX, assert_error

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "an operator's long random token"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _front_door(settings: Settings, client, **changes):
    settings = dataclasses.replace(settings, **changes)
    services = Services.build(settings, client, dispatcher=RecordingDispatcher())
    return create_app(settings, services=services), services


# --- /readyz: one check a second -------------------------------------------


def test_readyz_checks_redis_once_a_second_whatever_the_call_rate(settings, client, monkeypatch):
    app, services = _front_door(settings, client, readyz_cache_s=1.0)
    clock = app.extensions[READINESS].clock = FakeClock()
    sent: list[str] = []
    down = False
    execute = services.store.client.execute_command

    def counted(*args, **kwargs):
        sent.append(str(args[0]).upper())
        if down:
            raise redis.ConnectionError("Redis went away")
        return execute(*args, **kwargs)

    monkeypatch.setattr(services.store.client, "execute_command", counted)
    http = app.test_client()
    assert http.get("/readyz").status_code == 200
    one_check = list(sent)
    assert [http.get("/readyz").status_code for _ in range(50)] == [200] * 50
    assert sent == one_check and sent.count("INFO") == 1, sent  # one INFO (per primary): 51 calls, one check

    down = True
    assert http.get("/readyz").status_code == 200  # within the second: the answer already given
    clock.now += 1.0
    gone = http.get("/readyz")
    assert_error(gone, 503, "service_unavailable")
    checks = len(sent)
    assert [http.get("/readyz").status_code for _ in range(20)] == [503] * 20
    assert len(sent) == checks  # the refusal is reused too: a Redis in trouble is not asked 20 times

    down = False
    clock.now += 1.0
    assert http.get("/readyz").status_code == 200


def test_callers_arriving_during_a_check_share_it():
    readiness = Readiness(1.0)
    started, release = threading.Event(), threading.Event()
    checks = []

    def check() -> None:
        checks.append(1)
        started.set()
        release.wait(5)

    answered = []
    callers = [threading.Thread(target=lambda: answered.append(readiness.answer(check))) for _ in range(8)]
    callers[0].start()
    started.wait(5)
    for caller in callers[1:]:
        caller.start()
    release.set()
    for caller in callers:
        caller.join(5)
    assert len(answered) == 8 and len(checks) == 1


# --- the operator listener: OPS_TOKEN ---------------------------------------


@pytest.fixture
def guarded(settings, client) -> OperatorClient:
    app, _ = _front_door(settings, client, ops_token=TOKEN, ops_host="0.0.0.0")
    return OperatorClient(app, settings.ops_port)


@pytest.mark.parametrize("path", ["/metrics", "/ops", "/ops/summary.json"])
def test_the_operator_listener_asks_for_its_token(guarded, path):
    refused = guarded.get(path)
    assert_error(refused, 401, "unauthorized")
    assert refused.headers["WWW-Authenticate"].startswith("Basic ")  # a browser asks its user
    assert "OPS_TOKEN" in refused.json["detail"]
    assert guarded.get(path, headers={"Authorization": "Bearer not-the-token"}).status_code == 401
    assert guarded.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    basic = base64.b64encode(f"me:{TOKEN}".encode()).decode()
    assert guarded.get(path, headers={"Authorization": f"Basic {basic}"}).status_code == 200


def test_probes_on_the_operator_listener_need_no_token(guarded):
    assert guarded.get("/healthz").status_code == 200
    assert guarded.get("/readyz").status_code == 200


def test_the_token_opens_nothing_on_the_public_port(settings, client):
    app, _ = _front_door(settings, client, ops_token=TOKEN, ops_host="0.0.0.0")
    found = app.test_client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert found.status_code == 404


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "web"])
def test_an_operator_listener_beyond_loopback_needs_a_token(host):
    settings = Settings(ops_host=host)
    with pytest.raises(SettingsError, match="OPS_TOKEN must be set"):
        settings.require_ops_token(settings.ops_port)
    dataclasses.replace(settings, ops_token=TOKEN).require_ops_token(settings.ops_port)
    settings.require_ops_token(0)  # nothing bound


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_on_loopback_the_operator_listener_may_stay_open(host):
    Settings(ops_host=host).require_ops_token(8900)


def test_the_web_process_refuses_to_start_with_an_open_listener_beyond_loopback():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPS_", "REDIS_", "PUBLIC_", "TRUSTED_"))}
    env.update(PYTHONPATH=str(ROOT), PUBLIC_BASE_URL="https://router.test", OPS_HOST="0.0.0.0",
               REDIS_URL="redis://127.0.0.1:1/0")
    started = subprocess.run([sys.executable, "-c", "import router_queue.wsgi"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert started.returncode != 0
    assert "OPS_TOKEN must be set" in started.stderr


def test_a_workers_metrics_endpoint_asks_for_the_token_too():
    registry = CollectorRegistry()
    Counter("router_queue_probe", "a counter", registry=registry).inc()
    port = free_port()
    server = serve_metrics(port, "127.0.0.1", registry, TOKEN)
    assert server is not None
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        refused.value.close()
        assert refused.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert b"router_queue_probe_total 1.0" in answer.read()
    finally:
        server.shutdown()
        server.server_close()


# --- keyless callers behind a proxy -----------------------------------------


def _keyless(http, peer: str, forwarded: str | None = None):
    headers = {"X-API-Key": "rq_no_such_key"}
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    return http.get(f"{FLUX}/requests/00000000-0000-4000-8000-000000000000/status", headers=headers,
                    environ_base={"REMOTE_ADDR": peer})


@pytest.fixture
def limited(settings, client):
    app, _ = _front_door(settings, client, default_rate_limit="3/minute",
                         forwarded_allow_ips=("127.0.0.1", "::1", "10.244.7.0/24"))
    return app.test_client()


def test_keyless_callers_behind_a_trusted_proxy_have_a_bucket_each(limited):
    for _ in range(3):
        assert _keyless(limited, "127.0.0.1", "198.51.100.1, 10.244.7.9").status_code == 401
    assert_error(_keyless(limited, "127.0.0.1", "198.51.100.1, 10.244.7.9"), 429, "rate_limited")
    # another caller through the same ingress and nginx: its own bucket
    assert _keyless(limited, "127.0.0.1", "198.51.100.2, 10.244.7.9").status_code == 401
    # what the first caller writes to the left of what the proxies saw changes nothing
    assert_error(_keyless(limited, "127.0.0.1", "203.0.113.77, 198.51.100.1, 10.244.7.9"), 429, "rate_limited")


def test_a_forwarded_address_from_an_untrusted_peer_is_not_believed(limited):
    for n in range(3):
        assert _keyless(limited, "203.0.113.9", f"198.51.100.{n}").status_code == 401
    assert_error(_keyless(limited, "203.0.113.9", "198.51.100.200"), 429, "rate_limited")
    # a peer outside the trusted range, forwarded by a trusted one, is the caller itself
    for _ in range(3):
        assert _keyless(limited, "127.0.0.1", "198.51.100.9, 10.9.9.9").status_code == 401
    assert_error(_keyless(limited, "127.0.0.1", "198.51.100.10, 10.9.9.9"), 429, "rate_limited")
