"""Every route of the app, thrown arbitrary path segments, ids, headers and
bodies (hypothesis), answers in the contract and never 5xx.

The routes are read from ``app.url_map``, so a route added later is fuzzed
without touching this file; the calls go through the whole WSGI stack, the
lane's fast paths (status reads and submits) included. Redis is fakeredis and
up, so ``503 service_unavailable`` is not expected either.
"""

from __future__ import annotations

import json
from io import BytesIO
from urllib.parse import quote

import fakeredis
import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st
from werkzeug.routing import Rule

from router_queue.services import Services
from router_queue.settings import Settings
from router_queue.states import COMPLETED
from router_queue.store.requests_values import Lease
from router_queue.web import routes
from router_queue.web.app import create_app
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import record_of

#: Examples per route (each its own budget); fewer for routes with no arguments.
EXAMPLES, EXAMPLES_PLAIN = 200, 60
LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
#: Ids of the right shape that no request holds (one with each bad tail too).
WELL_FORMED_UNKNOWN = "0123abcd-0123-9123-8123-012345678901"
HEADERS = ("X-API-Key", "Authorization", "Idempotency-Key", "X-Comfy-Priority", "X-Comfy-Webhook-Url",
           "Last-Event-ID", "Content-Type", "Accept", "Host", "X-Forwarded-For", "X-Forwarded-Proto",
           "Transfer-Encoding", "X-Comfy-Provider-Key")
#: A body each model accepts.
VALID_BODIES = {"bfl/flux-2-pro": {"prompt": "a red teapot"},
                "openai/gpt-4o-mini-tts": {"input": "hello", "voice": "alloy"},
                "vertexai/gemini-3.1-flash-image": {"contents": [{"role": "user", "parts": [{"text": "a cat"}]}]},
                "vertexai/gemini-2.5-flash-image": {"contents": [{"role": "user", "parts": [{"text": "a cat"}]}]}}
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def _build():
    settings = Settings(redis_url="redis://unused", public_base_url="http://router.test", republish_after_s=0,
                        default_rate_limit="100000/second")
    services = Services.build(settings, fakeredis.FakeRedis(server=fakeredis.FakeServer()),
                              dispatcher=RecordingDispatcher())
    return create_app(settings, services=services), services


def _rules() -> list[Rule]:
    app, _ = _build()
    return sorted(app.url_map.iter_rules(), key=lambda rule: rule.rule)


@pytest.fixture(scope="module")
def world():
    """One app on fakeredis for every example: a workspace and a legacy key,
    and a finished request per model family, so valid ids reach the store."""
    app, services = _build()
    workspace = services.accounts.create_workspace("acme", queue_enabled=True, credits=10**9)
    keys = [services.accounts.mint_key(workspace), services.accounts.mint_legacy_key()]
    client = app.test_client()
    ids = [WELL_FORMED_UNKNOWN]
    for model, body in (("bfl/flux-2-pro", {"prompt": "a red teapot"}),):
        answer = client.post(f"/v2/models/{model}/requests", json=body, headers={"X-API-Key": keys[0]})
        assert answer.status_code == 201, answer.get_data(as_text=True)
        request_id = answer.json["request_id"]
        services.store.claim(record_of(services, request_id, "bfl"), LEASE)
        services.store.complete(record_of(services, request_id, "bfl"), output=b"x", content_type="image/png",
                                error_type="", detail="")
        ids.append(request_id)
    return {"services": services, "client": client, "keys": keys, "ids": ids, "models": services.catalog.ids()}


def _text(max_size: int = 80) -> st.SearchStrategy[str]:
    """Anything a path segment or id can decode to: unicode, controls, slashes."""
    return st.one_of(
        st.text(max_size=max_size),
        st.text(alphabet=st.characters(max_codepoint=0x7f), max_size=max_size),
        st.sampled_from(["", ".", "..", "%", "\n", "\r\n", "\x00", "/", "a/b", " ", "%0A", "%2F", "\u2028",
                         "\U0001f600", "x" * 10_000]),
    )


def _id_like(ids: list[str]) -> st.SearchStrategy[str]:
    """Real and unknown ids, and each with a tail, a case change or a cut."""
    known = st.sampled_from(ids)
    return st.one_of(
        known,
        st.builds(lambda i, tail: i + tail, known, st.sampled_from(["\n", "\r\n", "\x00", "%0A"])),
        st.builds(lambda i, tail: i + tail, known, st.sampled_from(["\n", "\r", "\x00", " ", "\t", "%0A", "\u00a0",
                                                                   "/", "0", "x" * 5000])),
        st.builds(lambda i, head: head + i, known, st.sampled_from(["\n", " ", "0", "{"])),
        known.map(str.upper),
        known.map(lambda i: i[:-1]),
        _text(),
    )


def _header_value() -> st.SearchStrategy[str]:
    """What an HTTP server hands the app: latin-1 text without line breaks."""
    latin1 = st.characters(max_codepoint=0xff, blacklist_characters="\r\n\x00")
    return st.one_of(st.text(alphabet=latin1, max_size=64), st.text(alphabet=latin1, min_size=1000, max_size=9000),
                     st.sampled_from(["", " ", "high", "low", "-1", "0", "99999999999999999999", "https://example.com/h",
                                      "http://127.0.0.1/x", "https://[::1]/", "application/json", "text/plain",
                                      "chunked", "Bearer ", "1-IN_QUEUE", "COMPLETED:1", "\t"]))


def _body() -> st.SearchStrategy[bytes]:
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda children: st.lists(children, max_size=5)
                               | st.dictionaries(st.text(max_size=10), children, max_size=5), max_leaves=20)
    return st.one_of(
        st.just(b""),
        st.binary(max_size=256),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(["prompt", "width", "height", "seed", "contents", "input", "voice", "x"]),
                        json_values, max_size=4).map(lambda v: json.dumps(v).encode()),
        st.just(json.dumps({"prompt": "a red teapot"}).encode()),
        st.just(b"[" * 5000 + b"]" * 5000),
    )


@st.composite
def calls(draw, rule: Rule, world: dict) -> dict:
    """A call to ``rule``: valid but for what ``hostile`` names (or all of it),
    so most calls get past the checks before the one they stress."""
    hostile = draw(st.sampled_from(["path", "id", "headers", "body", "method", "everything"]))
    model_id = draw(st.sampled_from(world["models"]))
    provider, model = model_id.split("/", 1)
    real = {"provider": provider, "model": model}
    path = rule.rule
    for name in rule.arguments:
        if name == "request_id":
            value = draw(_id_like(world["ids"])) if hostile in ("id", "everything") else draw(st.sampled_from(world["ids"]))
        elif hostile in ("path", "everything") and draw(st.booleans()):
            value = draw(_text())
        else:
            value = real.get(name, "x")
        path = path.replace(f"<{name}>", quote(value, safe="") if draw(st.booleans()) else value)
    if hostile in ("path", "everything") and draw(st.integers(0, 3)) == 0:  # a piece no route expects
        path += "/" + quote(draw(_text(20)), safe="")
    method = sorted(rule.methods - {"OPTIONS", "HEAD"} or rule.methods)[0]
    if hostile in ("method", "everything"):
        method = draw(st.sampled_from(METHODS))
    headers = {"X-API-Key": world["keys"][0], "Content-Type": "application/json"}
    if hostile in ("headers", "everything"):
        key = draw(st.one_of(st.sampled_from(world["keys"]), st.none(), _header_value()))
        if key is None:
            del headers["X-API-Key"]
        else:
            headers["X-API-Key"] = key
        for name in draw(st.lists(st.sampled_from(HEADERS), min_size=1, max_size=4, unique=True)):
            headers[name] = draw(_header_value())
    body = draw(_body()) if hostile in ("body", "everything") else json.dumps(VALID_BODIES[model_id]).encode()
    chunked = draw(st.booleans())  # a body with no Content-Length, as a chunked upload arrives
    return {"path": path, "method": method, "headers": headers, "body": body, "chunked": chunked}


def _send(client, call: dict):
    if call["chunked"]:
        return client.open(call["path"], method=call["method"], headers=call["headers"],
                           input_stream=BytesIO(call["body"]),
                           environ_overrides={"wsgi.input_terminated": True})
    return client.open(call["path"], method=call["method"], headers=call["headers"], data=call["body"])


@pytest.fixture(autouse=True)
def _sync_calls_finish_at_once(monkeypatch, world):
    """No worker runs here: a synchronous call's request is finished as soon
    as the route starts to wait, as a worker would finish it."""
    services = world["services"]

    def finished(store, *args):
        if args and not isinstance(args[-1], (int, float)):
            args = args[:-1]  # the call's held key
        request_id, provider, _hold_s = args[-3:]  # (store, [events,] request_id, provider, hold_s[, key])
        record = record_of(services, request_id, provider)
        if record.status != COMPLETED:
            store.claim(record, LEASE)
            store.complete(record_of(services, request_id, provider), output=b"x", content_type="audio/mpeg",
                           error_type="", detail="")
        return store.status_view(request_id, provider)

    monkeypatch.setattr(routes, "wait_until_completed", finished)


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: f"{rule.endpoint}")
def test_no_route_answers_5xx_whatever_it_is_sent(world, rule):
    @hypothesis_settings(max_examples=EXAMPLES if rule.arguments else EXAMPLES_PLAIN, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(call=calls(rule, world))
    def check(call):
        response = _send(world["client"], call)
        data = response.get_data()  # an event stream's frames too: a fault there raises here
        assert response.status_code < 500, (call, response.status_code, data[:500])
        if response.status_code >= 400:  # in the contract's shape
            assert response.headers["X-Comfy-Error-Type"]
            if call["method"] != "HEAD":
                json.loads(data)

    check()


def test_a_newline_after_a_real_id_is_404_on_every_request_route(world):
    """The reported case: ``{id}%0A`` was a 500 (``$`` let the newline through)."""
    client, key, request_id = world["client"], world["keys"][0], world["ids"][1]
    base = f"/v2/models/bfl/flux-2-pro/requests/{request_id}%0A"
    for method, path in (("GET", f"{base}/status"), ("GET", base), ("PUT", f"{base}/cancel"),
                         ("GET", f"{base}/events")):
        response = client.open(path, method=method, headers={"X-API-Key": key})
        assert response.status_code == 404, (path, response.get_data(as_text=True))
        assert response.json == {"error_type": "request_not_found",
                                 "detail": "no such request for this caller and model"}
