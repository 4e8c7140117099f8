"""The operator's view of failures: each failure counted by model and
error_type where completions are counted, in 5-minute buckets kept a day, and
shown on the ops page, in /ops/summary.json and by ``router-queue ops failures``
with counts only."""

from __future__ import annotations

import time

from router_queue.cli import main
from router_queue.store.failures import BUCKET_S, FailureCounts, FailureRow
from tests.unit.route_support import failed, submit
from tests.unit.support import cli_runner


def test_counts_fall_into_the_last_hour_and_the_last_day_and_then_out(client):
    counts = FailureCounts(client)
    now = 1_800_000_000.0
    counts.count("bfl", "bfl/flux-2-pro", "provider_error", now=now)
    counts.count("bfl", "bfl/flux-2-pro", "provider_error", now=now - 2 * 3600)
    counts.count("bfl", "bfl/flux-2-pro", "queue_timeout", now=now - 60)
    counts.count("openai", "openai/gpt-4o-mini-tts", "provider_timeout", now=now - 25 * 3600)  # past the day
    assert counts.recent(["bfl", "openai", "vertexai"], now) == [
        FailureRow("bfl/flux-2-pro", "provider_error", 1, 2), FailureRow("bfl/flux-2-pro", "queue_timeout", 1, 1)]
    assert counts.recent(["bfl"], now + 3600 + BUCKET_S) == [
        FailureRow("bfl/flux-2-pro", "provider_error", 0, 2), FailureRow("bfl/flux-2-pro", "queue_timeout", 0, 1)]
    assert all(0 < client.ttl(key) <= 86400 + BUCKET_S for key in client.scan_iter(match="*failures*"))


def test_failures_show_on_the_page_the_summary_and_the_cli_with_counts_only(http, ops_http, auth, services, app):
    secret = "a very private prompt"
    for _ in range(2):
        failed(http, auth, services, {"prompt": secret}, error_type="provider_error")
    request_id = submit(http, auth, {"prompt": secret}).json["request_id"]
    assert http.put(f"/v2/models/bfl/flux-2-pro/requests/{request_id}/cancel", headers=auth).status_code == 202
    # failed() completes in the store directly; a worker's completion counts
    # through Recorder.completed, as the cancel route's does
    services.metrics.completed("bfl", "bfl/flux-2-pro", "provider_error")
    summary = ops_http.get("/ops/summary.json").json
    rows = {(r["model"], r["error_type"]): (r["last_hour"], r["last_24h"]) for r in summary["failures"]}
    assert rows == {("bfl/flux-2-pro", "cancelled"): (1, 1), ("bfl/flux-2-pro", "provider_error"): (1, 1)}
    page = ops_http.get("/ops").get_data(as_text=True)
    assert 'id="failures"' in page and "cancelled" in page
    shown = cli_runner(app).invoke(main, ["ops", "failures"])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == "model\terror_type\tlast_hour\tlast_24h"
    assert sorted(lines[1:]) == ["bfl/flux-2-pro\tcancelled\t1\t1", "bfl/flux-2-pro\tprovider_error\t1\t1"]
    for text in (page, shown.output, str(summary["failures"])):
        assert secret not in text and request_id not in text and "acme" not in text


def test_a_success_is_not_a_failure(services):
    services.metrics.completed("bfl", "bfl/flux-2-pro", "success")
    assert services.failures.recent(["bfl"], time.time()) == []
