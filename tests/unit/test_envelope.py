"""One route table and one envelope: every route is declared once
(``web/paths.py``) and every call, the lane's and Flask's, goes through the
same envelope steps (``web/envelope.py``), so a step added there holds on both."""

from __future__ import annotations

import uuid

import pytest

from router_queue.web import paths
from router_queue.web.envelope import ENVELOPE, STEPS, Envelope, fresh_call_id
from tests.unit.test_routes import FLUX, submit


def test_every_flask_route_is_a_declared_one(app):
    registered = {(rule.endpoint, rule.rule, method) for rule in app.url_map.iter_rules()
                  for method in rule.methods - {"HEAD", "OPTIONS"}}
    declared = {(route.endpoint, route.rule, route.method) for route in paths.ROUTES}
    assert registered == declared


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
