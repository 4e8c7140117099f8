"""One route table and one envelope: every route is declared once
(``web/paths.py``) and every call, the lane's and Flask's, goes through the
same envelope steps (``web/envelope.py``), so a step added there holds on both."""

from __future__ import annotations

import uuid

import pytest

from router_queue.web import paths
from router_queue.web.envelope import ENVELOPE, STEPS, Envelope, fresh_call_id
from tests.unit.route_support import FLUX, submit


def test_every_flask_route_is_a_declared_one(app):
    registered = {(rule.endpoint, rule.rule, method) for rule in app.url_map.iter_rules()
                  for method in rule.methods - {"HEAD", "OPTIONS"}}
    declared = {(route.endpoint, route.rule, route.method) for route in paths.ROUTES}
    assert registered == declared


#: Every request hook the Flask app has, by blueprint (None: the app's own),
#: and why the lane's calls lose nothing by not running it. A hook added
#: straight to Flask (a CORS header, an audit line) would run for every call
#: but the lane's polls and submits: put it in the envelope (``STEPS``), which
#: both paths take, or list it here with the reason the lane needs none.
FLASK_ONLY_HOOKS = {
    ("before_request_funcs", None): ["_open_call"],  # the envelope's open, which the lane calls itself
    ("after_request_funcs", None): ["_close_call"],  # the envelope's settle and headers, likewise
    # 404 off the operator listener for /metrics and /ops; no lane route is an operator route
    ("before_request_funcs", "operations"): ["_operators_only"],
}
_HOOK_REGISTRIES = ("before_request_funcs", "after_request_funcs", "teardown_request_funcs",
                    "url_value_preprocessors", "url_default_functions", "template_context_processors")


def test_flask_has_no_request_hook_the_lane_would_skip(app):
    hooks = {(registry, blueprint): names for registry in _HOOK_REGISTRIES
             for blueprint, funcs in getattr(app, registry).items()
             # Flask's own context processor (request, session, g) runs for templates only
             if (names := [f.__name__ for f in funcs if f.__name__ != "_default_template_ctx_processor"])}
    assert hooks == FLASK_ONLY_HOOKS


def test_a_hook_added_to_flask_alone_is_caught(app):
    app.after_request(lambda response: response)
    with pytest.raises(AssertionError):
        test_flask_has_no_request_hook_the_lane_would_skip(app)


def test_the_lane_matches_only_its_declared_routes():
    status, submit_route = paths.Pattern(paths.STATUS), paths.Pattern(paths.SUBMIT)
    assert status.match(f"{FLUX}/requests/abc/status".split("/")) == ("bfl", "flux-2-pro", "abc")
    assert submit_route.match(f"{FLUX}/requests".split("/")) == ("bfl", "flux-2-pro")
    for path in (f"{FLUX}/requests//status", f"{FLUX}/requests/abc/events", f"{FLUX}/requests/abc",
                 "/v2/models//flux-2-pro/requests/abc/status", f"{FLUX}/requests/abc/status/"):
        assert status.match(path.split("/")) is None, path
    assert {route for route in paths.ROUTES if route.lane} == {paths.STATUS, paths.SUBMIT}


@pytest.fixture
def recorded(app, monkeypatch) -> list[str]:
    """The envelope steps each call takes, in order ("|" between calls)."""
    steps: list[str] = []
    envelope = app.extensions[ENVELOPE]
    for step in STEPS:
        original = getattr(envelope, step)

        def record(*args, _step=step, _original=original):
            steps.append(_step)
            return _original(*args)
        monkeypatch.setattr(envelope, step, record)
    return steps


@pytest.fixture
def reached_flask(app) -> list[str]:
    reached: list[str] = []
    app.before_request(lambda: reached.append("flask") and None)
    return reached


def _calls(http, auth, reached_flask, recorded) -> dict[str, tuple[bool, list[str], object]]:
    """Each kind of call: whether Flask answered it, its envelope steps, its answer."""
    max_body = http.application.config["MAX_CONTENT_LENGTH"]
    request_id = submit(http, auth).json["request_id"]
    calls = {
        "lane status": lambda: http.get(f"{FLUX}/requests/{request_id}/status", headers=auth),
        "flask status (malformed id)": lambda: http.get(f"{FLUX}/requests/not-an-id/status", headers=auth),
        "lane submit": lambda: http.post(f"{FLUX}/requests", json={"prompt": "x"}, headers=auth),
        "lane submit refused": lambda: http.post(f"{FLUX}/requests", data=b"{", headers=auth),
        "flask submit (over the limit)": lambda: http.post(f"{FLUX}/requests", data=b"x" * (max_body + 1),
                                                           headers=auth),
        "flask result": lambda: http.get(f"{FLUX}/requests/{request_id}", headers=auth),
        "flask cost": lambda: http.get(f"{FLUX}/cost", headers=auth),
        "flask 404": lambda: http.get("/v2/nowhere", headers=auth),
    }
    seen = {}
    for name, call in calls.items():
        reached_flask.clear()
        recorded.clear()
        response = call()
        seen[name] = (bool(reached_flask), list(recorded), response)
    return seen


def test_both_paths_take_the_same_envelope_steps(http, auth, reached_flask, recorded):
    seen = _calls(http, auth, reached_flask, recorded)
    assert [name for name, (flask, _, _) in seen.items() if not flask] == [
        "lane status", "lane submit", "lane submit refused"]
    for name, (_, steps, response) in seen.items():
        refused = response.status_code >= 400
        expected = ["open", "refusal", "settle", "headers"] if refused else ["open", "settle", "headers"]
        assert steps == expected, (name, response.status_code)


def test_a_header_step_added_to_the_envelope_is_on_both_paths(app, http, auth, reached_flask, monkeypatch):
    envelope: Envelope = app.extensions[ENVELOPE]
    every = envelope.headers
    monkeypatch.setattr(envelope, "headers", lambda call: [*every(call), ("X-Added-Step", "yes")])
    seen = _calls(http, auth, reached_flask, [])
    assert {name: response.headers.get("X-Added-Step") for name, (_, _, response) in seen.items()} == {
        name: "yes" for name in seen}
    assert all(response.headers["X-Content-Type-Options"] == "nosniff" for _, _, response in seen.values())


def test_a_fresh_call_id_is_a_random_uuid4():
    ids = {fresh_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(str(uuid.UUID(i)) == i and uuid.UUID(i).version == 4 for i in ids)
