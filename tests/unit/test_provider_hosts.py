"""Provider calls go only to allowed hosts, follow no redirect, and BFL's
``polling_url`` stays on BFL's site: our key never reaches anyone else."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
import requests

from router_queue import states
from router_queue.catalog import Catalog
from router_queue.settings import DEFAULT_CATALOG, Settings
from workers.providers import ADAPTERS, ProviderCall, ProviderFailure
from workers.providers.hosts import ProviderHosts, same_site

CATALOG = Catalog.load(DEFAULT_CATALOG)
KEY = "sk-secret-provider-key"
#: model -> the header that carries the key to that provider.
KEY_HEADERS = {"bfl/flux-2-pro": "x-key", "vertexai/gemini-3.1-flash-image": "Authorization",
               "openai/gpt-4o-mini-tts": "Authorization"}
BODIES = {"bfl/flux-2-pro": {"prompt": "a teapot"},
          "vertexai/gemini-3.1-flash-image": {"contents": [{"parts": [{"text": "a teapot"}]}]},
          "openai/gpt-4o-mini-tts": {"input": "hello", "voice": "alloy"}}


class Server:
    """A loopback HTTP server answering every request with ``answer(path)``
    (status, headers, JSON body) and remembering each request's headers."""

    def __init__(self, answer):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, dict(self.headers)))
                status, headers, body = answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {**headers, "Content-Type": "application/json",
                                    "Content-Length": str(len(data))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def elsewhere() -> Iterator[Server]:
    """Another loopback port: whoever a redirect or a polling_url points at."""
    server = Server(lambda path: (200, {}, {"status": "Ready", "result": {"sample": "stolen"}}))
    yield server
    server.close()


def _call(model: str, url: str, hosts: ProviderHosts, remembered: list | None = None) -> ProviderCall:
    entry = CATALOG.by_id(model)
    return ProviderCall(entry=entry, body=json.dumps(BODIES[model]).encode(), url=url, credential=lambda: KEY,
                        session=requests.Session(), interruption=lambda: None, hosts=hosts,
                        remember=(remembered if remembered is not None else []).append)


def _only(origin: str) -> ProviderHosts:
    """No provider host but ``origin`` (as PROVIDER_ORIGIN_OVERRIDE allows the stub)."""
    return ProviderHosts.of(Settings(provider_origin_override=origin, provider_hosts=()))


def _no_key_in(server: Server) -> None:
    for _, _, headers in server.seen:
        assert KEY not in json.dumps(headers), headers


@pytest.mark.parametrize("model", sorted(KEY_HEADERS))
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_provider_error_and_the_key_goes_nowhere(model, status, elsewhere):
    provider = Server(lambda path: (status, {"Location": f"{elsewhere.origin}/collect"}, {}))
    try:
        call = _call(model, CATALOG.by_id(model).upstream(provider.origin), _only(provider.origin))
        with pytest.raises(ProviderFailure) as failed:
            ADAPTERS[CATALOG.by_id(model).adapter](call)
    finally:
        provider.close()
    assert failed.value.error_type == states.PROVIDER_ERROR and not failed.value.retryable
    assert f"HTTP {status}" in failed.value.detail and "not followed" in failed.value.detail
    assert len(provider.seen) == 1 and provider.seen[0][2].get(KEY_HEADERS[model], "").endswith(KEY)
    assert elsewhere.seen == [], "the redirect was followed"


@pytest.mark.parametrize("model", sorted(KEY_HEADERS))
def test_a_catalog_url_off_the_allow_list_is_never_called(model, elsewhere):
    call = _call(model, CATALOG.by_id(model).upstream(elsewhere.origin), ProviderHosts(Settings().provider_hosts))
    with pytest.raises(ProviderFailure) as failed:
        ADAPTERS[CATALOG.by_id(model).adapter](call)
    assert failed.value.error_type == states.PROVIDER_ERROR and not failed.value.retryable
    assert "PROVIDER_HOSTS" in failed.value.detail or "https only" in failed.value.detail
    assert elsewhere.seen == []


def test_bfl_polling_url_is_pinned_to_bfls_site(elsewhere):
    """A submit answer naming a polling_url on another origin: refused before
    it is polled or remembered, so no later delivery polls it either."""
    bfl = Server(lambda path: (200, {}, {"id": "gen-1", "polling_url": f"{elsewhere.origin}/v1/get_result?id=1"}))
    remembered: list = []
    try:
        call = _call("bfl/flux-2-pro", CATALOG.by_id("bfl/flux-2-pro").upstream(bfl.origin), _only(bfl.origin),
                     remembered)
        with pytest.raises(ProviderFailure) as failed:
            ADAPTERS["bfl"](call)
    finally:
        bfl.close()
    assert failed.value.error_type == states.PROVIDER_ERROR and "polling_url" in failed.value.detail
    assert remembered == [] and elsewhere.seen == []
    _no_key_in(elsewhere)

    # A handle kept by an earlier delivery is checked the same way on resume.
    resumed = _call("bfl/flux-2-pro", CATALOG.by_id("bfl/flux-2-pro").upstream(bfl.origin), _only(bfl.origin))
    resumed = dataclasses.replace(resumed, upstream_ref={"id": "gen-1", "polling_url": f"{elsewhere.origin}/poll"})
    with pytest.raises(ProviderFailure, match="polling_url"):
        ADAPTERS["bfl"](resumed)
    assert elsewhere.seen == []


def test_bfl_polls_on_its_own_origin():
    """The stub's polling_url is on the stub's origin: allowed, and polled."""
    polled: list[str] = []

    def answer(path: str):
        if path.startswith("/v1/get_result"):
            polled.append(path)
            return 200, {}, {"status": "Ready", "result": {"sample": "ok"}}
        return 200, {}, {"id": "gen-2", "polling_url": f"{bfl.origin}/v1/get_result?id=gen-2"}

    bfl = Server(answer)
    try:
        output = ADAPTERS["bfl"](_call("bfl/flux-2-pro", CATALOG.by_id("bfl/flux-2-pro").upstream(bfl.origin),
                                       _only(bfl.origin)))
    finally:
        bfl.close()
    assert json.loads(output.content)["result"]["sample"] == "ok" and polled == ["/v1/get_result?id=gen-2"]


def test_the_shipped_providers_are_allowed_by_default():
    hosts = ProviderHosts(Settings().provider_hosts)
    for entry in (CATALOG.by_id(model) for model in CATALOG.ids()):
        assert hosts.refusal(entry.upstream_url) is None, entry.id
    for url in ("https://api.us1.bfl.ai/v1/get_result?id=1", "https://api.eu.bfl.ai/v1/flux-2-pro",
                "https://us-central1-aiplatform.googleapis.com/v1/projects/p/x:generateContent"):
        assert hosts.refusal(url) is None, url


@pytest.mark.parametrize("url", [
    "http://api.bfl.ai/v1/flux-2-pro",            # not https
    "https://api.bfl.ai.evil.example/v1/x",       # a suffix is not the host
    "https://evil.example/api.bfl.ai",            # nor a path
    "https://user:pw@api.bfl.ai/v1/x",            # credentials of its own
    "https://169.254.169.254/latest/meta-data",   # the metadata server
    "https://127.0.0.1:8300/v1/flux-2-pro",       # loopback, unless it is the override
    "ftp://api.bfl.ai/x", "not a url", "https://api.bfl.ai:notaport/x",
])
def test_other_urls_are_refused(url):
    assert ProviderHosts(Settings().provider_hosts).refusal(url) is not None


def test_the_override_origin_is_allowed_exactly():
    hosts = ProviderHosts.of(Settings(provider_origin_override="http://127.0.0.1:8300"))
    assert hosts.refusal("http://127.0.0.1:8300/v1/flux-2-pro") is None
    assert hosts.refusal("http://127.0.0.1:8301/v1/flux-2-pro") is not None
    assert hosts.refusal("https://api.openai.com/v1/audio/speech") is None


def test_provider_hosts_is_a_setting():
    settings = Settings.from_env({"PROVIDER_HOSTS": "API.example.com, *.example.net"})
    hosts = ProviderHosts.of(settings)
    assert settings.provider_hosts == ("api.example.com", "*.example.net")
    assert hosts.refusal("https://api.example.com/v1") is None and hosts.refusal("https://a.example.net/") is None
    assert hosts.refusal("https://api.bfl.ai/v1/flux-2-pro") is not None


@pytest.mark.parametrize("polling, same", [
    ("https://api.bfl.ai/v1/get_result?id=1", True),
    ("https://api.us1.bfl.ai/v1/get_result?id=1", True),
    ("https://bfl.ai/x", True),
    ("https://api.openai.com/v1/x", False),
    ("https://bfl.ai.evil.example/x", False),
    ("http://api.us1.bfl.ai/x", False),
])
def test_same_site(polling, same):
    assert same_site("https://api.bfl.ai/v1/flux-2-pro", polling) is same


def test_same_site_for_an_address_is_the_same_origin():
    assert same_site("http://127.0.0.1:8300/v1/flux-2-pro", "http://127.0.0.1:8300/v1/get_result")
    assert not same_site("http://127.0.0.1:8300/v1/flux-2-pro", "http://127.0.0.1:8301/v1/get_result")
    assert not same_site("http://stub:8300/v1/flux-2-pro", "http://other:8300/v1/get_result")
