"""The operator's surfaces and the pages: /metrics and /ops only on the
operator listener, the Host never echoed unchecked, security headers."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from router_queue.settings import Settings, SettingsError
from router_queue.web.app import create_app
from tests.unit import route_support
from tests.unit.route_support import FLUX, submit

served_by_flask = route_support.served_by_flask  # a fixture (route_support)

OPERATOR_PATHS = ("/metrics", "/ops", "/ops/summary.json")


@pytest.mark.parametrize("path", OPERATOR_PATHS)
def test_operator_surfaces_are_not_found_on_the_public_port(http, ops_http, auth, settings, served_by_flask, path):
    ops_port = settings.ops_port
    for headers in ({}, auth, {"Host": f"localhost:{ops_port}"}, {"X-Forwarded-Port": str(ops_port)}):
        refused = http.get(path, headers=headers)
        assert refused.status_code == 404, (path, headers)
        assert refused.headers["X-Comfy-Error-Type"] == refused.json["error_type"] == "model_not_found"
    # The lane never answers them: every one of those calls reached Flask.
    assert served_by_flask.count(path) == 4
    assert ops_http.get(path).status_code == 200


def test_operator_surfaces_are_nowhere_with_no_operator_port(settings, services, dispatcher):
    services.settings = dataclasses.replace(settings, ops_port=0)
    client = create_app(services.settings, services=services).test_client()
    for path in OPERATOR_PATHS:
        for base in ("http://localhost", "http://localhost:0", "http://localhost:8900"):
            assert client.get(path, base_url=base).status_code == 404, (path, base)
    assert client.get("/healthz").status_code == 200


def test_probes_answer_on_both_ports(http, ops_http):
    assert http.get("/healthz").status_code == ops_http.get("/healthz").status_code == 200


def test_every_answer_says_nosniff(http, auth, ops_http):
    created = submit(http, auth, {"prompt": "nosniff"})  # the lane's answer
    status = http.get(created.json["status_url"].removeprefix("http://router.test"), headers=auth)
    for response in (created, status, http.get("/healthz"), http.get("/nope"), http.get("/v2/models", headers=auth),
                     ops_http.get("/metrics")):
        assert response.headers["X-Content-Type-Options"] == "nosniff", response.request.path


def test_gunicorns_own_refusals_say_nosniff_too():
    from gunicorn.http.errors import InvalidHeader

    from router_queue.web.gunicorn_worker import refusal

    head = refusal(InvalidHeader("No-Colon-Here")).partition(b"\r\n\r\n")[0].decode()
    assert "\r\nX-Content-Type-Options: nosniff" in head


@pytest.mark.parametrize("page", ["/v2/docs", "/ops"])
def test_the_pages_allow_only_their_own_nonced_inline_code(http, ops_http, page):
    response = (ops_http if page == "/ops" else http).get(page)
    assert response.status_code == 200 and response.mimetype == "text/html"
    policy = dict(part.strip().split(" ", 1) for part in response.headers["Content-Security-Policy"].split(";"))
    nonce = re.fullmatch(r"'nonce-([A-Za-z0-9_-]{16,})'", policy["style-src"]).group(1)
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert policy["script-src"] == f"'nonce-{nonce}'" and "unsafe" not in response.headers["Content-Security-Policy"]
    html = response.get_data(as_text=True)
    tags = re.findall(r"<(script|style)\b([^>]*)>", html)
    assert tags and all(attrs == f' nonce="{nonce}"' for _, attrs in tags), tags
    assert not re.search(r"\son[a-z]+=|\sstyle=|javascript:", html)
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["Referrer-Policy"] == "no-referrer"
    again = (ops_http if page == "/ops" else http).get(page)
    assert again.headers["Content-Security-Policy"] != response.headers["Content-Security-Policy"]  # fresh nonce


# -- absolute URLs: PUBLIC_BASE_URL, or a Host from TRUSTED_HOSTS ---------------------------------


def test_the_web_process_needs_a_public_origin():
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({}).require_public_origin()
    assert "PUBLIC_BASE_URL" in str(refused.value) and "TRUSTED_HOSTS" in str(refused.value)
    Settings.from_env({"PUBLIC_BASE_URL": "https://router.example.com"}).require_public_origin()
    assert Settings.from_env({"TRUSTED_HOSTS": "Router.Example.com, .example.org"}).trusted_hosts == (
        "router.example.com", ".example.org")
    with pytest.raises(SettingsError, match="TRUSTED_HOSTS"):
        Settings.from_env({"TRUSTED_HOSTS": "a.example,,b.example"})
    with pytest.raises(SettingsError, match="OPS_PORT"):
        Settings.from_env({"OPS_PORT": "70000"})


def test_wsgi_refuses_to_start_without_one(monkeypatch):
    import importlib
    import sys

    for name in ("PUBLIC_BASE_URL", "TRUSTED_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delitem(sys.modules, "router_queue.wsgi", raising=False)
    monkeypatch.setattr("router_queue.logs.configure", lambda level: None)
    with pytest.raises(SettingsError, match="PUBLIC_BASE_URL"):
        importlib.import_module("router_queue.wsgi")


@pytest.fixture
def trusting(settings, services, dispatcher):
    """The app with no PUBLIC_BASE_URL, trusting router.test and its subdomains."""
    services.settings = dataclasses.replace(settings, public_base_url="", trusted_hosts=(".router.test",))
    return create_app(services.settings, services=services).test_client()


def test_a_trusted_host_builds_the_urls_and_a_forged_one_is_refused(trusting, auth, services, workspace):
    body = json.dumps({"prompt": "host"})
    headers = {**auth, "Content-Type": "application/json"}
    created = trusting.post(f"{FLUX}/requests", data=body, headers=headers, base_url="https://eu.router.test:8443")
    assert created.status_code == 201, created.json
    assert created.json["status_url"].startswith(f"https://eu.router.test:8443{FLUX}/requests/")
    request_id = created.json["request_id"]
    for base in ("http://evil.example", "http://router.test.evil.example"):
        refused = trusting.post(f"{FLUX}/requests", data=body, headers=headers, base_url=base)
        assert refused.status_code == 400 and refused.json["error_type"] == "invalid_input", refused.json
        assert "evil" not in refused.get_data(as_text=True)
        status = trusting.get(f"{FLUX}/requests/{request_id}/status", headers=auth, base_url=base)
        assert status.status_code == 400
        cancel = trusting.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth, base_url=base)
        assert cancel.status_code == 400
    assert services.store.queue_depth("bfl") == 1  # nothing more admitted, nothing cancelled
    assert trusting.get(f"{FLUX}/requests/{request_id}/status", headers=auth,
                        base_url="http://router.test").json["status"] == "IN_QUEUE"
