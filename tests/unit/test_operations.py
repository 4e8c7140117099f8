"""Metrics that match known traffic, drain, the operations page, JSON logs."""

from __future__ import annotations

import json
import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from router_queue import logs
from router_queue.cli.ops import ops
from router_queue.store import keys
from router_queue.store.requests_values import Lease
from tests.unit.support import cli_runner, record_of

FLUX = "/v2/models/bfl/flux-2-pro"


def scrape(ops_http) -> dict[tuple[str, tuple], float]:
    response = ops_http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def submit(http, auth, prompt):
    return http.post(f"{FLUX}/requests", data=json.dumps({"prompt": prompt}),
                     headers={**auth, "Content-Type": "application/json"})


def _counted(before: dict, after: dict) -> dict:
    """What the traffic between two scrapes counted: the counters' growth
    (the counters are this process's, and other tests counted before)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def test_metrics_match_known_traffic(http, ops_http, auth, services, workspace):
    before = scrape(ops_http)
    ids = [submit(http, auth, f"p{n}").json["request_id"] for n in range(4)]
    poor = services.accounts.create_workspace("poor", queue_enabled=True, credits=0)
    assert submit(http, {"X-API-Key": services.accounts.mint_key(poor)}, "x").status_code == 402
    store, metrics = services.store, services.metrics
    for request_id, outcome in ((ids[0], "success"), (ids[1], "provider_error")):
        store.claim(record_of(services, request_id, "bfl"), Lease("t", 30, 3600, 3))
        metrics.claimed("bfl", "bfl/flux-2-pro", 0.3)
        if outcome == "success":
            store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
        else:
            store.complete(record_of(services, request_id, "bfl"), error_type=outcome, detail="x")
        metrics.completed("bfl", "bfl/flux-2-pro", outcome, 2.0)
    http.put(f"{FLUX}/requests/{ids[2]}/cancel", headers=auth)
    metrics.swept(republished=2, reaped=1, timed_out=0)

    samples = scrape(ops_http)
    counted = _counted(before, samples)
    bfl = (("provider", "bfl"),)
    model = (("model", "bfl/flux-2-pro"), ("provider", "bfl"))
    assert samples[("router_queue_depth", bfl)] == 1
    assert samples[("router_queue_in_flight", bfl)] == 1  # ids[3] holds the slot it was granted
    assert counted[("router_queue_admissions_total", model)] == 4
    assert counted[("router_queue_refusals_total", tuple(sorted(model + (("reason", "insufficient_credits"),))))] == 1
    completions = {labels: value for (name, labels), value in counted.items()
                   if name == "router_queue_completions_total" and value}
    assert completions == {
        (("model", "bfl/flux-2-pro"), ("outcome", "success"), ("provider", "bfl")): 1,
        (("model", "bfl/flux-2-pro"), ("outcome", "provider_error"), ("provider", "bfl")): 1,
        (("model", "bfl/flux-2-pro"), ("outcome", "cancelled"), ("provider", "bfl")): 1,
    }
    assert counted[("router_queue_wait_seconds_count", model)] == 2
    assert counted[("router_queue_wait_seconds_bucket", tuple(sorted(model + (("le", "0.25"),))))] == 0
    assert counted[("router_queue_wait_seconds_bucket", tuple(sorted(model + (("le", "0.5"),))))] == 2
    assert counted[("router_queue_run_seconds_sum", model)] == 4.0
    assert counted[("router_queue_sweeper_actions_total", (("action", "republished"),))] == 2
    assert samples[("router_queue_oldest_wait_seconds", bfl)] >= 0
    # counted in this process: none of it was written to Redis
    assert not [key for key in services.redis.scan_iter(keys.PREFIX + ":metrics*")]
    assert not [key for key in services.redis.scan_iter(keys.PREFIX + ":completions*")]


def test_a_draining_provider_admits_nothing_and_says_so(http, auth, services):
    services.store.set_draining("bfl", True)
    refused = submit(http, auth, "during a deploy")
    assert refused.status_code == 503
    assert refused.headers["X-Comfy-Error-Type"] == "service_unavailable"
    assert int(refused.headers["Retry-After"]) >= 1
    assert services.store.queue_depth("bfl") == 0
    services.store.set_draining("bfl", False)
    assert submit(http, auth, "after it").status_code == 201


def test_the_operations_page_shows_the_queues(http, ops_http, auth):
    submit(http, auth, "waiting")
    page = ops_http.get("/ops").get_data(as_text=True)
    assert '<tr data-provider="bfl">' in page
    assert '<td class="queued">1</td>' in page
    summary = ops_http.get("/ops/summary.json").json
    assert {row["provider"]: row["queued"] for row in summary["providers"]}["bfl"] == 1


def test_health_answers_without_touching_dependencies(http):
    assert http.get("/healthz").json == {"status": "ok"}


def test_log_lines_are_json_with_the_bound_context(capsys):
    logs.configure("INFO")
    try:
        with logs.bound(request_id="r-1", workspace="ws_1", model="bfl/flux-2-pro"):
            logging.getLogger("router_queue.test").info("claimed", extra={"outcome": "claimed"})
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        logging.getLogger().handlers.clear()
    assert line["message"] == "claimed"
    assert (line["request_id"], line["workspace"], line["model"], line["outcome"]) == (
        "r-1", "ws_1", "bfl/flux-2-pro", "claimed")


def test_the_operations_page_shows_the_workspaces_waiting_for_a_slot(http, ops_http, auth, services, workspace):
    services.store.max_in_flight = lambda provider: 1
    other = services.accounts.create_workspace("other", queue_enabled=True, credits=1000)
    other_auth = {"X-API-Key": services.accounts.mint_key(other)}
    for n in range(4):  # the first takes the one slot; three wait
        submit(http, auth, f"mine {n}")
    submit(http, other_auth, "theirs")
    row = {r["provider"]: r for r in ops_http.get("/ops/summary.json").json["providers"]}["bfl"]
    assert (row["queued"], row["in_flight"], row["waiting_workspaces"]) == (5, 1, 2)
    assert row["largest"] == [{"workspace": workspace, "waiting": 3}, {"workspace": other, "waiting": 1}]
    page = ops_http.get("/ops").get_data(as_text=True)
    assert '<td class="waiting_workspaces">2</td>' in page
    assert scrape(ops_http)[("router_queue_waiting_workspaces", (("provider", "bfl"),))] == 2
    assert f"{workspace} (3), {other} (1)" in page


def test_requeue_publishes_a_granted_request_and_leaves_a_waiting_one_to_the_schedule(app, http, auth, services,
                                                                                       dispatcher):
    services.store.max_in_flight = lambda provider: 1
    granted, waiting = (submit(http, auth, f"p{n}").json["request_id"] for n in range(2))
    dispatcher.published.clear()
    runner = cli_runner(app)

    shown = runner.invoke(ops, ["requeue", waiting])
    assert shown.exit_code == 0 and "waits for a bfl slot" in shown.output
    assert dispatcher.published == []

    shown = runner.invoke(ops, ["requeue", granted])
    assert shown.exit_code == 0 and shown.output.strip() == f"published {granted} to bfl"
    assert dispatcher.published == [(granted, "bfl")]


def test_gunicorns_own_log_lines_are_json_too(capsys):
    """gunicorn's loggers had handlers of their own whose format needs a
    process id, which our records no longer carry: a warning failed to format."""
    gunicorn_error = logging.getLogger("gunicorn.error")
    gunicorn_error.addHandler(logging.StreamHandler())  # as gunicorn's glogging sets it up
    gunicorn_error.handlers[-1].setFormatter(logging.Formatter("%(asctime)s [%(process)d] %(message)s"))
    logs.configure("INFO")
    try:
        gunicorn_error.warning("Invalid request from ip=%s: %s", "127.0.0.1", "Invalid chunk size")
        err = capsys.readouterr().err
        line = json.loads(err.strip().splitlines()[-1])
    finally:
        logging.getLogger().handlers.clear()
        gunicorn_error.handlers.clear()
        gunicorn_error.propagate = True
    assert (line["logger"], line["level"]) == ("gunicorn.error", "WARNING")
    assert line["message"] == "Invalid request from ip=127.0.0.1: Invalid chunk size"
    assert "Logging error" not in err and len(err.strip().splitlines()) == 1, err


def test_per_minute_counts_what_completed_in_the_last_minute(http, ops_http, auth, services, workspace):
    """It read 639.8 after one completion: it was 60 / the pace estimate's gap,
    which is capped at the run time. Now it is a count, fleet-wide: complete.lua
    keeps it with the pace, in the write it already makes."""
    def bfl_row() -> dict:
        return {r["provider"]: r for r in ops_http.get("/ops/summary.json").json["providers"]}["bfl"]

    assert bfl_row()["per_minute"] == 0
    store = services.store
    ids = [submit(http, auth, f"per minute {n}").json["request_id"] for n in range(2)]
    now = time.time()
    store.claim(record_of(services, ids[0], "bfl"), Lease("t", 30, 3600, 3), now=now)
    store.complete(record_of(services, ids[0], "bfl"), output=b"{}", content_type="application/json")
    assert (bfl_row()["per_minute"], bfl_row()["completed"]) == (1, 1)
    store.claim(record_of(services, ids[1], "bfl"), Lease("t", 30, 3600, 3), now=now)
    store.complete(record_of(services, ids[1], "bfl"), error_type="provider_error", detail="x")
    row = bfl_row()
    assert (row["per_minute"], row["completed"]) == (2, 2)
    assert 0 <= row["avg_wait_s"] < 5
    assert store.delivery_totals("bfl", time.time() + 61).last_minute == 0
    assert store.delivery_totals("bfl", time.time() + 61).completed == 2
    assert store.delivery_totals("vertexai").last_minute == 0


def test_workers_heard_from_lately_are_counted_per_queue_and_a_silent_one_is_dead(app, ops_http, services, workspace):
    """The fleet's liveness: what the page, its JSON, ``ops depths`` and
    ``router_queue_workers_alive`` show of the workers' heartbeats."""
    fleet, now = services.fleet, time.time()
    fleet.beat("worker-a@host", ("provider.bfl", "router.maintenance"), 101, now - 60, now=now - 1)
    fleet.beat("worker-b@host", ("provider.bfl", "provider.openai"), 102, now - 60,
               now=now - fleet.heartbeat_s * 3 - 1)  # missed three heartbeats: stopped, stuck or dead
    fleet.beat("webhooks@host", ("router.webhooks",), 103, now - 60, now=now - 2)

    summary = ops_http.get("/ops/summary.json").json
    rows = {row["provider"]: row for row in summary["providers"]}
    assert (rows["bfl"]["workers"], rows["openai"]["workers"], rows["vertexai"]["workers"]) == (1, 0, 0)
    shown = {w["name"]: (w["alive"], w["pid"]) for w in summary["workers"]}
    assert shown == {"worker-a@host": (True, 101), "worker-b@host": (False, 102), "webhooks@host": (True, 103)}

    samples = scrape(ops_http)
    alive = {labels[0][1]: value for (name, labels), value in samples.items() if name == "router_queue_workers_alive"}
    assert alive == {"provider.bfl": 1, "provider.openai": 0, "provider.vertexai": 0, "router.webhooks": 1,
                     "router.maintenance": 1}

    page = ops_http.get("/ops").get_data(as_text=True)
    assert "worker-b@host" in page and ">dead<" in page

    depths = cli_runner(app).invoke(ops, ["depths"])
    assert depths.exit_code == 0, depths.output
    header, *lines = [line.split("\t") for line in depths.output.strip().splitlines()]
    by_provider = {line[0]: dict(zip(header, line)) for line in lines}
    assert (by_provider["bfl"]["workers"], by_provider["openai"]["workers"]) == ("1", "0")


def test_a_worker_silent_for_an_hour_is_forgotten(services):
    fleet, now = services.fleet, time.time()
    fleet.beat("gone@host", ("provider.bfl",), 1, now - 7200, now=now - 3601)
    fleet.beat("here@host", ("provider.bfl",), 2, now - 60, now=now)
    assert [w.name for w in fleet.workers()] == ["here@host"]
