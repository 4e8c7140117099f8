"""The operations side against real processes: /metrics against known traffic,
the front door through a Redis outage, the operations page in headless
Chromium, the operator CLI, and the JSON logs.

The metrics are the fleet's, per provider and model, so the metrics test reads
``/metrics`` before and after its traffic and compares the differences. The
Redis-outage tests run a stack of their own on a ``redis-server`` of their own.
"""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import requests

from router_queue.requests.record import Submission
from router_queue.store import keys
from tests.redis_servers import PrivateRedis, SentinelGroup

from .harness import (
    FLUX,
    GEMINI,
    SWEEP_INTERVAL_S,
    WORKER_CONCURRENCY,
    ApiClient,
    RunningStack,
    broker_drained,
    make_caller,
    saturated_worker,
    unique_prompt,
    wait_for,
)
from .ops_support import (
    CLIENT_TIMEOUT_S,
    chromium,
    depths_table,
    json_lines,
    ops_ok,
    parse_ops_page,
    run_chromium,
    run_ops,
    scrape,
)
from .outage_support import (
    STALL_EACH_S,
    STALLED_ANSWER_S,
    STALLED_SUBMIT_S,
    Fault,
    assert_503,
    outage_under_load,
    private_env,
    stalls_under_load,
)

BFL = "bfl"


def _quiet(stack: RunningStack, provider: str = BFL) -> None:
    """Nothing of ``provider`` waiting, running or in the broker: no earlier test's
    work still moves the fleet-wide figures."""
    services = stack.services
    wait_for(lambda: services.store.queue_depth(provider) == 0 and services.store.in_flight(provider) == 0
             and broker_drained(services, provider), timeout_s=30, what=f"{provider} quiet")


# -- 1. /metrics against known traffic -------------------------------------------------------


def test_metrics_match_known_traffic(stack: RunningStack, caller: ApiClient) -> None:
    n_ok, n_refused, n_failing = 3, 2, 1  # a failing one retries with backoff (about 7 s): keep it to one
    attempts = stack.services.catalog.by_id(FLUX).policy.max_attempts
    _quiet(stack)
    before = scrape(stack.ops_url)
    assert {"router_queue_depth", "router_queue_in_flight", "router_queue_in_flight_limit",
            "router_queue_draining", "router_queue_admissions_total"} <= before.names()

    # A cancel of a queued request, behind a saturated worker.
    with saturated_worker(caller) as saturating:
        queued = caller.submit_ok(FLUX, {"prompt": unique_prompt("metrics cancelled while queued")})
        during = scrape(stack.ops_url)
        assert during.get("router_queue_depth", provider=BFL) == before.get("router_queue_depth", provider=BFL) + 1
        # the queued one is granted a slot (the cap is far) and waits for a worker thread
        assert during.get("router_queue_in_flight", provider=BFL) == (
            before.get("router_queue_in_flight", provider=BFL) + WORKER_CONCURRENCY + 1)
        assert during.get("router_queue_oldest_wait_seconds", provider=BFL) >= 0
        assert caller.cancel(FLUX, queued).status_code == 202
    assert caller.status_body(FLUX, queued)["error_type"] == "cancelled"

    # A refusal: 402, nothing queued.
    with make_caller(stack, "metrics-broke", credits=0) as broke:
        refused = broke.submit(FLUX, {"prompt": unique_prompt("metrics broke")})
    assert refused.status_code == 402, refused.text

    failing = [caller.submit_ok(FLUX, {"prompt": unique_prompt("metrics 500", "[stub:status=500]")})
               for _ in range(n_failing)]
    ok = [caller.submit_ok(FLUX, {"prompt": unique_prompt("metrics ok")}) for _ in range(n_ok)]
    refusals = [caller.submit_ok(FLUX, {"prompt": unique_prompt("metrics refuse", "[stub:refuse]")})
                for _ in range(n_refused)]
    outcomes = {rid: caller.wait_status(FLUX, rid, timeout_s=30).get("error_type", "success")
                for rid in ok + refusals + failing}
    assert [outcomes[r] for r in ok] == ["success"] * n_ok
    assert [outcomes[r] for r in refusals] == ["content_policy_violation"] * n_refused
    assert [outcomes[r] for r in failing] == ["provider_error"] * n_failing

    _quiet(stack)
    after = scrape(stack.ops_url)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    model = {"provider": BFL, "model": FLUX}
    ran = n_ok + n_refused + n_failing + len(saturating)  # claimed and run by the worker
    assert delta("router_queue_admissions_total", **model) == ran + 1  # + the one cancelled while queued
    assert delta("router_queue_refusals_total", **model, reason="insufficient_credits") == 1
    assert {reason: delta("router_queue_refusals_total", **model, reason=reason)
            for reason in ("draining", "not_enabled", "backlog_full")} == dict.fromkeys(
        ("draining", "not_enabled", "backlog_full"), 0)
    completions = {outcome: delta("router_queue_completions_total", **model, outcome=outcome)
                   for outcome in ("success", "content_policy_violation", "provider_error", "cancelled",
                                   "queue_timeout", "internal_error", "provider_timeout", "invalid_input")}
    assert completions == {
        "success": n_ok, "content_policy_violation": n_refused, "provider_error": n_failing,
        # the saturating generations cancelled while running, and the one cancelled while queued
        "cancelled": len(saturating) + 1,
        "queue_timeout": 0, "internal_error": 0, "provider_timeout": 0, "invalid_input": 0,
    }
    assert delta("router_queue_wait_seconds_count", **model) == ran
    assert delta("router_queue_run_seconds_count", **model) == ran
    assert delta("router_queue_wait_seconds_bucket", **model, le="+Inf") == ran
    assert delta("router_queue_wait_seconds_sum", **model) >= 0
    assert delta("router_queue_run_seconds_sum", **model) > 0
    # Every request called the provider at least once; the failing ones max_attempts times.
    least_calls = n_ok + n_refused + len(saturating) + n_failing * attempts
    assert delta("router_queue_call_seconds_count", **model) >= least_calls
    assert delta("router_queue_provider_retries_total", **model) == n_failing * (attempts - 1)
    for gauge in ("router_queue_depth", "router_queue_in_flight"):
        assert after.get(gauge, provider=BFL) == before.get(gauge, provider=BFL), gauge
    assert after.get("router_queue_in_flight_limit", provider=BFL) == stack.services.catalog.max_in_flight(BFL)
    assert after.get("router_queue_draining", provider=BFL) == 0
    # Histograms are cumulative: buckets never decrease with their bound.
    buckets = sorted(((float(dict(labels)["le"]), value) for (name, labels), value in after.samples.items()
                      if name == "router_queue_run_seconds_bucket" and dict(labels).get("model") == FLUX))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)


# -- 2. a Redis outage under load --------------------------------------------------------------

#: How long a single stall lasts: the issue's 10 s (the outage's length is outage_support.OUTAGE_S).
STALL_S = 10.0


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrivateRedis, RunningStack]]:
    """A redis-server of our own (append-only file on, so a kill keeps the data) and
    a stack on it (broker too); the tests below stop that Redis, never the session's."""
    yield from _on_private_redis(tmp_path_factory, "outage", persist=True)


def _on_private_redis(tmp_path_factory: pytest.TempPathFactory, name: str,
                      persist: bool) -> Iterator[tuple[PrivateRedis, RunningStack]]:
    server = PrivateRedis(tmp_path_factory.mktemp(f"{name}-redis"), persist=persist)
    server.start()
    try:
        with RunningStack.start(private_env(server.url), tmp_path_factory.mktemp(f"{name}-logs"),
                                label=f"{name} stack") as running:
            yield server, running
    finally:
        server.stop()


@pytest.mark.slow
def test_redis_outage_under_load(private: tuple[PrivateRedis, RunningStack]) -> None:
    server, running = private
    outage_under_load(running, Fault("kill", server.kill, heal=server.start))


@pytest.mark.slow
def test_redis_stall_under_load(private: tuple[PrivateRedis, RunningStack]) -> None:
    server, running = private
    outage_under_load(running, Fault("stall", server.pause, heal=server.resume, lasts_s=STALL_S))


@pytest.fixture(scope="module", params=["0", "1"], ids=["async", "wait-1-replica"])
def sentinel_group(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SentinelGroup, RunningStack]]:
    """A primary, a replica and three sentinels of our own, and a stack given the
    ``sentinel://`` URL for its store and broker; with REDIS_WAIT_REPLICAS 0 and 1."""
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel-redis"))
    try:
        group.start()
        with RunningStack.start(private_env(group.url, REDIS_WAIT_REPLICAS=request.param),
                                tmp_path_factory.mktemp("sentinel-logs"), label="sentinel stack") as running:
            yield group, running
    finally:
        group.stop()


@pytest.mark.slow
def test_sentinel_failover_under_load(sentinel_group: tuple[SentinelGroup, RunningStack]) -> None:
    """The primary SIGKILLed; the sentinels promote the replica; the front door,
    the workers and the broker find it through the same URL, with no restart."""
    group, running = sentinel_group
    outage_under_load(running, Fault("failover", group.kill_primary, healed=group.promoted))
    assert running.services.redis.info("server")["tcp_port"] == group.replica.port


@pytest.mark.slow
def test_a_hung_redis_never_hangs_the_front_door(private: tuple[PrivateRedis, RunningStack]) -> None:
    server, running = private
    submit_url = f"{running.base_url}/v2/models/{FLUX}/requests"
    calls = {
        "submit without a key": lambda: requests.post(submit_url, json={"prompt": "x"}, timeout=CLIENT_TIMEOUT_S),
        "operations summary": lambda: requests.get(f"{running.ops_url}/ops/summary.json",
                                                   timeout=CLIENT_TIMEOUT_S),
    }
    server.pause()
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = {name: pool.submit(call) for name, call in calls.items()}
            answers = {}
            for name, future in futures.items():
                try:
                    answers[name] = future.result().status_code
                except requests.RequestException as exc:
                    answers[name] = repr(exc)
        healthz = requests.get(f"{running.base_url}/healthz", timeout=CLIENT_TIMEOUT_S)
    finally:
        server.resume()
    assert healthz.status_code == 200
    assert answers == {"submit without a key": 401, "operations summary": 503}, answers


@pytest.mark.slow
def test_a_full_redis_answers_503_keeps_the_worker_and_loses_nothing(private: tuple[PrivateRedis, RunningStack]) -> None:
    """Redis at ``maxmemory`` (noeviction) refuses every write. The front door
    answers 503 with Retry-After (never 500), readiness says the store is full,
    and the worker that pops a grant it cannot record (kombu's unacked-index
    write refused) reconnects instead of exiting. Once there is room, the grant
    it popped is published again and every admitted request completes, charged once."""
    server, running = private
    store = running.services.redis
    caller = running.caller("full")
    worker = running.stack.procs["worker"]
    before = caller.submit_ok(FLUX, {"prompt": unique_prompt("admitted before the store fills")})
    # Stopped, the worker cannot record the next grant before Redis fills; resumed, it pops it into a full store.
    worker.send_signal(signal.SIGSTOP)
    try:
        popped = caller.submit_ok(FLUX, {"prompt": unique_prompt("granted while the worker is stopped")})
        store.config_set("maxmemory", 1)
    finally:
        worker.send_signal(signal.SIGCONT)
    try:
        submit = caller.submit(FLUX, {"prompt": unique_prompt("refused: the store is full")})
        status = caller.status(FLUX, before)
        result = caller.result(FLUX, before)
        ready = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
        time.sleep(2.0)  # the worker meets the full store
        worker_alive = worker.poll() is None
    finally:
        store.config_set("maxmemory", 0)
    context = f"\n\n{running.log_tails()}"
    assert_503(submit)
    assert int(submit.headers["Retry-After"]) >= 5
    for read in (status, result):
        assert read.status_code in (200, 202, 503), (read.status_code, read.text)
    assert_503(ready)
    assert "full" in ready.json()["detail"], ready.text
    assert worker_alive and running.stack.exited() is None, f"{running.stack.exited()} exited{context}"

    after = caller.submit_ok(FLUX, {"prompt": unique_prompt("admitted once there is room")})
    for request_id in (before, popped, after):
        body = caller.wait_status(FLUX, request_id, timeout_s=60)
        assert "error_type" not in body, body
    assert requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S).status_code == 200
    charged = [e.request_id for e in running.services.accounts.ledger(caller.workspace) if e.type == "charge"]
    assert sorted(charged) == sorted({before, popped, after}), charged


def test_a_stopped_worker_is_shown_dead_and_alive_again_once_resumed(private: tuple[PrivateRedis, RunningStack]) -> None:
    """The heartbeat comes from the worker's own consumer loop: SIGSTOP it and
    the page's JSON, ``ops depths`` and ``router_queue_workers_alive`` say no
    live worker consumes the provider queues, though ``/readyz`` still says ready."""
    _, running = private
    worker = running.stack.procs["worker"]

    def bfl_workers() -> int:
        rows = requests.get(f"{running.ops_url}/ops/summary.json", timeout=CLIENT_TIMEOUT_S).json()["providers"]
        return {row["provider"]: row["workers"] for row in rows}[BFL]

    wait_for(lambda: bfl_workers() == 1, timeout_s=15, what="the worker's heartbeat")
    worker.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: bfl_workers() == 0, timeout_s=15, what="the stopped worker counted dead")
        summary = requests.get(f"{running.ops_url}/ops/summary.json", timeout=CLIENT_TIMEOUT_S).json()
        gauge = scrape(running.ops_url).get("router_queue_workers_alive", queue="provider.bfl")
        depths = depths_table(ops_ok(dict(running.env), "depths"))
        ready = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
    finally:
        worker.send_signal(signal.SIGCONT)
    dead = [w for w in summary["workers"] if not w["alive"]]
    assert [w["pid"] for w in dead] == [worker.pid], summary["workers"]
    assert "provider.bfl" in dead[0]["queues"]
    assert gauge == 0 and depths[BFL]["workers"] == "0"
    assert ready.status_code == 200  # the front door can admit; the fleet's liveness is a separate signal
    wait_for(lambda: bfl_workers() == 1, timeout_s=15, what="the resumed worker alive again")


@pytest.fixture(scope="module")
def forgetful(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrivateRedis, RunningStack]]:
    """A stack on a redis-server of its own without an append-only file: killed
    and started again, it comes back empty."""
    yield from _on_private_redis(tmp_path_factory, "forgetful", persist=False)


@pytest.mark.slow
def test_a_redis_restarted_empty_is_refused_loudly_not_served_as_new(
        forgetful: tuple[PrivateRedis, RunningStack]) -> None:
    """Every key would be 401 and every admitted request 404 while /readyz says
    200: instead the front door answers 503 and says the store lost its data,
    the sweeper fails loudly, and no process exits."""
    server, running = forgetful
    caller = running.caller("forgotten")
    admitted = caller.submit_ok(FLUX, {"prompt": unique_prompt("admitted before the loss")})
    assert requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S).status_code == 200
    time.sleep(2 * SWEEP_INTERVAL_S)  # the sweeps since the first workspace adopted its marker
    server.kill()
    server.start()  # empty: no append-only file
    time.sleep(3.0)  # past the front door's key cache (2 s), and a sweep or two
    submit = caller.submit(FLUX, {"prompt": unique_prompt("after the loss")})
    status = caller.status(FLUX, admitted)
    ready = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
    context = f"\n\n{running.log_tails()}"
    for answer in (submit, status, ready):
        assert_503(answer)
    assert "lost its data" in ready.json()["detail"], ready.text
    assert running.stack.exited() is None, f"{running.stack.exited()} exited{context}"
    wait_for(lambda: "the store lost its data" in (running.stack.log_dir / "worker.log").read_text(),
             timeout_s=15, what="the sweeper saying the store lost its data")


def _assert_not_known_admitted(response: requests.Response) -> None:
    """A submit answered while Redis did not answer: 503 (known not admitted)
    or 504 outcome_unknown naming the id it has if it was."""
    if response.status_code == 504:
        assert response.json()["error_type"] == "outcome_unknown", response.text
        assert response.json()["request_id"] and int(response.headers["Retry-After"]) >= 1
        return
    assert_503(response)


@pytest.mark.slow
def test_writes_answered_503_during_a_stall_never_take_effect_later(private: tuple[PrivateRedis, RunningStack]) -> None:
    """The admit reaches the stalled Redis (the key is cached by then) and waits
    in its socket; the front door answers 503 within its wait; when Redis wakes,
    the script finds itself past its deadline by Redis's clock and writes nothing."""
    server, running = private
    caller = running.caller("stall")
    accounts = running.services.accounts
    for n in range(3):  # the key is now cached by the web worker this session talks to
        caller.submit_ok(FLUX, {"prompt": unique_prompt(f"before the stall {n}")})
    long = caller.submit_ok(FLUX, {"prompt": unique_prompt("runs through the stall", "[stub:latency=4]")})
    before = accounts.get(caller.workspace)
    ledger_before = accounts.ledger(caller.workspace)
    server.pause()
    try:
        answers = []
        for n in range(4):
            started = time.monotonic()
            response = caller.submit(FLUX, {"prompt": unique_prompt(f"during the stall {n}")})
            answers.append((response, time.monotonic() - started))
        started = time.monotonic()
        cancel = caller.session.put(caller.url(FLUX, long, "/cancel"), headers=caller.headers(), timeout=10)
        cancel_s = time.monotonic() - started
        started = time.monotonic()
        ready = requests.get(f"{running.base_url}/readyz", timeout=CLIENT_TIMEOUT_S)
        ready_s = time.monotonic() - started
        healthz = requests.get(f"{running.base_url}/healthz", timeout=CLIENT_TIMEOUT_S)
    finally:
        server.resume()
    time.sleep(1.0)  # what waited in Redis's socket buffers has run by now
    for response, elapsed in answers:
        _assert_not_known_admitted(response)
        assert elapsed < STALLED_SUBMIT_S, (elapsed, response.request.url)
        if response.status_code == 504:  # sent into the stall: never admitted, as its status now says
            assert caller.session.get(response.json()["status_url"], headers=caller.headers(),
                                      timeout=10).status_code in (404, 410)
    for response, elapsed in [(cancel, cancel_s), (ready, ready_s)]:
        assert_503(response)
        assert int(response.headers["Retry-After"]) >= 1
        assert elapsed < STALLED_ANSWER_S, (elapsed, response.request.url)
    assert healthz.status_code == 200
    after = accounts.get(caller.workspace)
    assert after.held <= before.held, "a 503'd submit was admitted later"
    assert [e for e in accounts.ledger(caller.workspace) if e.type == "hold"] == [
        e for e in ledger_before if e.type == "hold"], "a 503'd submit holds credits"
    assert not running.services.redis.hexists(keys.request(long), "cancel_requested"), "a 503'd cancel took effect"
    assert "error_type" not in caller.wait_status(FLUX, long, timeout_s=30)
    assert caller.submit(FLUX, {"prompt": unique_prompt("after the stall")}).status_code == 201


@pytest.mark.slow
def test_no_503_during_stalls_was_admitted(private: tuple[PrivateRedis, RunningStack]) -> None:
    server, running = private
    stalls_under_load(running, Fault("stalls", server.pause, heal=server.resume, lasts_s=STALL_EACH_S))


# -- 2b. the operator surfaces: on the operator listener only ----------------------------------

OPERATOR_PATHS = ("/metrics", "/ops", "/ops/summary.json")


def test_operator_surfaces_answer_only_on_the_operator_listener(stack: RunningStack, caller: ApiClient) -> None:
    """The public port answers 404 in the contract's shape for each, whatever
    Host it is sent, with or without a key; the operator port (OPS_PORT, the
    Procfile's second bind) serves them, the pages with their security headers."""
    ops_host = stack.ops_url.removeprefix("http://")
    for path in OPERATOR_PATHS:
        for headers in ({}, caller.headers(), {"Host": ops_host}, {**caller.headers(), "Host": ops_host}):
            public = requests.get(f"{stack.base_url}{path}", headers=headers, timeout=10)
            assert public.status_code == 404, (path, headers, public.status_code, public.text[:300])
            assert public.headers["X-Comfy-Error-Type"] == public.json()["error_type"] == "model_not_found"
            assert public.headers["X-Content-Type-Options"] == "nosniff"
        served = requests.get(f"{stack.ops_url}{path}", timeout=10)
        assert served.status_code == 200, (path, served.status_code, served.text[:300])
        assert served.headers["X-Content-Type-Options"] == "nosniff"
    page = requests.get(f"{stack.ops_url}/ops", timeout=10)
    policy = page.headers["Content-Security-Policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", policy).group(1)
    assert f'<script nonce="{nonce}">' in page.text and "unsafe-inline" not in policy
    assert page.headers["X-Frame-Options"] == "DENY" and page.headers["Referrer-Policy"] == "no-referrer"
    # The public API is unchanged on the public port; probes answer on both.
    for base in (stack.base_url, stack.ops_url):
        assert requests.get(f"{base}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{stack.base_url}/v2/models", headers=caller.headers(), timeout=10).status_code == 200


def test_a_forged_host_is_refused_not_echoed(stack: RunningStack, caller: ApiClient) -> None:
    """TRUSTED_HOSTS (the harness's 127.0.0.1, localhost): absolute URLs follow
    a trusted Host and a forged one is 400 before anything is admitted."""
    submit = f"{stack.base_url}/v2/models/{FLUX}/requests"
    body = {"prompt": unique_prompt("forged host")}
    refused = requests.post(submit, json=body, headers=caller.headers({"Host": "evil.example"}), timeout=10)
    assert refused.status_code == 400, refused.text
    assert refused.headers["X-Comfy-Error-Type"] == "invalid_input"
    assert "evil.example" not in refused.text
    port = stack.base_url.rsplit(":", 1)[1]
    admitted = requests.post(submit, json=body, headers=caller.headers({"Host": f"localhost:{port}"}), timeout=10)
    assert admitted.status_code == 201, admitted.text
    assert admitted.json()["status_url"].startswith(f"http://localhost:{port}/v2/models/{FLUX}/requests/")


# -- 3. the operations page in headless Chromium -------------------------------------------------


def test_operations_page_in_headless_chromium(stack: RunningStack, caller: ApiClient, tmp_path: Path) -> None:
    binary = chromium()
    waiting = 3
    _quiet(stack)
    url = f"{stack.ops_url}/ops"
    with saturated_worker(caller) as saturating:
        queued = [caller.submit_ok(FLUX, {"prompt": unique_prompt(f"ops page {n}")}) for n in range(waiting)]

        served = parse_ops_page(requests.get(url, timeout=10).text)
        assert served.cell(BFL, "queued") == str(waiting)
        # granted a slot (the cap is far), waiting for a worker thread
        assert served.cell(BFL, "in_flight") == str(len(saturating) + waiting)
        assert served.updated == "rendered by the server"

        dumped = run_chromium(binary, tmp_path / "profile-dom", "--virtual-time-budget=5000", "--dump-dom", url)
        assert dumped.returncode == 0, dumped.stderr[-3000:]
        page = parse_ops_page(dumped.stdout)
        assert set(page.rows) == set(stack.services.catalog.providers()), page.rows
        # The page's JavaScript ran its refresh: the rebuilt rows class every figure,
        # and span#updated says when.
        assert page.updated.startswith("updated "), (page.updated, dumped.stdout[-2000:])
        assert page.cell(BFL, "cap") == str(stack.services.catalog.max_in_flight(BFL))
        assert page.rows[BFL][0] == ("", BFL)
        assert page.cell(BFL, "queued") == str(waiting)
        assert page.cell(BFL, "in_flight") == str(len(saturating) + waiting)
        assert page.cell(BFL, "waiting_workspaces") == "0"  # all hold granted slots
        assert float(page.cell(BFL, "oldest_wait_s")) >= 0
        for provider in ("vertexai", "openai"):
            assert page.cell(provider, "queued") == "0" and page.cell(provider, "in_flight") == "0"

        shot = tmp_path / "ops.png"
        taken = run_chromium(binary, tmp_path / "profile-shot", "--virtual-time-budget=5000",
                             f"--screenshot={shot}", "--window-size=1200,600", url)
        assert taken.returncode == 0, taken.stderr[-3000:]
        assert shot.exists(), taken.stderr[-3000:]
        png = shot.read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(png) > 10_000, len(png)
        for request_id in queued:
            caller.cancel(FLUX, request_id)


# -- 4. the operator CLI --------------------------------------------------------------------------


def test_operator_cli_end_to_end(stack: RunningStack, caller: ApiClient) -> None:
    env = dict(stack.env)
    services = stack.services
    _quiet(stack)

    # depths, inspect and cancel, with requests waiting behind a saturated worker.
    with saturated_worker(caller) as saturating:
        first_prompt = unique_prompt("cli inspect")
        first = caller.submit_ok(FLUX, {"prompt": first_prompt})
        second = caller.submit_ok(FLUX, {"prompt": unique_prompt("cli cancel")})

        table = depths_table(ops_ok(env, "depths"))
        assert set(table) == set(services.catalog.providers())
        assert table[BFL]["waiting"] == "2" and table[BFL]["in_flight"] == str(len(saturating) + 2)
        assert table[BFL]["workspaces_waiting"] == "0"  # both hold granted slots: none waits for one
        assert table[BFL]["cap"] == str(services.catalog.max_in_flight(BFL)) and table[BFL]["draining"] == "no"
        assert float(table[BFL]["oldest_wait_s"]) >= 0
        assert table["vertexai"]["waiting"] == "0"

        shown = ops_ok(env, "inspect", first)
        assert first_prompt not in shown, "inspect printed the request body"
        record = json.loads(shown)
        assert record["id"] == first and record["status"] == "IN_QUEUE"
        assert record["workspace"] == caller.workspace and record["model"] == FLUX and record["provider"] == BFL
        assert re.fullmatch(r"<\d+ bytes>", record["body"]), record["body"]
        assert record["position"] == 0
        assert record["ttl_s"] == -1  # not COMPLETED: kept until it finishes

        missing = run_ops(env, "inspect", "no-such-request")
        assert missing.returncode != 0 and "no request" in missing.stderr

        assert ops_ok(env, "cancel", second).strip() == "cancelled"
        cancelled = caller.status_body(FLUX, second)
        assert cancelled["status"] == "COMPLETED" and cancelled["error_type"] == "cancelled"
    caller.wait_status(FLUX, first)

    # drain: bfl answers 503 while vertexai admits, and bfl work in flight completes.
    in_flight = caller.submit_ok(FLUX, {"prompt": unique_prompt("cli drain in flight", "[stub:latency=2]")})
    caller.wait_status(FLUX, in_flight, "IN_PROGRESS")
    before_drain = scrape(stack.ops_url)
    try:
        assert ops_ok(env, "drain", BFL).strip() == "bfl draining"
        assert depths_table(ops_ok(env, "depths"))[BFL]["draining"] == "yes"
        assert_503(caller.submit(FLUX, {"prompt": unique_prompt("cli drained")}))
        drained = scrape(stack.ops_url)
        assert drained.get("router_queue_draining", provider=BFL) == 1
        assert drained.get("router_queue_draining", provider="vertexai") == 0
        refused_draining = {"provider": BFL, "model": FLUX, "reason": "draining"}
        assert (drained.get("router_queue_refusals_total", **refused_draining)
                - before_drain.get("router_queue_refusals_total", **refused_draining)) == 1
        assert 'class="draining"' in requests.get(f"{stack.ops_url}/ops", timeout=10).text
        gemini = caller.submit_ok(GEMINI, {"contents": [{"role": "user", "parts": [{"text": unique_prompt("g")}]}]})
        assert "error_type" not in caller.wait_status(FLUX, in_flight)
        assert "error_type" not in caller.wait_status(GEMINI, gemini)
        assert ops_ok(env, "drain", BFL, "--off").strip() == "bfl admitting"
    finally:
        run_ops(env, "drain", BFL, "--off")
        services.store.set_draining(BFL, False)
    after = caller.submit_ok(FLUX, {"prompt": unique_prompt("cli admitted again")})
    assert "error_type" not in caller.wait_status(FLUX, after)
    assert run_ops(env, "drain", "nope").returncode != 0

    # requeue: a granted request whose message was lost. This process's store
    # has no dispatcher: the admit grants the slot and publishes nothing.
    assert services.store.grants.publish is None and not services.store.grants.templates
    request_id = services.ids.mint(caller.workspace, FLUX)
    admission = services.store.admit(
        Submission(request_id=request_id, workspace=caller.workspace, model=FLUX, provider=BFL,
        body=json.dumps({"prompt": unique_prompt("cli requeue")}),
        price=services.catalog.by_id(FLUX).price_credits),
    )
    assert admission.outcome == "ADMITTED", admission
    # The reaper's look at its grant lease is far off: nothing would run it.
    services.redis.zadd(keys.running(BFL), {request_id: time.time() + 3600}, xx=True)
    time.sleep(1.5)
    assert caller.status_body(FLUX, request_id)["status"] == "IN_QUEUE"
    assert ops_ok(env, "requeue", request_id).strip() == f"published {request_id} to bfl"
    assert "error_type" not in caller.wait_status(FLUX, request_id)
    refused = run_ops(env, "requeue", request_id)
    assert refused.returncode != 0 and "COMPLETED" in refused.stderr

    # purge-expired: an index entry whose record is gone is dropped.
    ghost = services.ids.mint(caller.workspace, GEMINI)
    services.redis.zadd(keys.running("vertexai"), {ghost: time.time() + 3600})
    purged = re.fullmatch(r"purged (\d+) index entries of expired requests", ops_ok(env, "purge-expired").strip())
    assert purged and int(purged.group(1)) >= 1
    assert services.redis.zscore(keys.running("vertexai"), ghost) is None


def test_cli_cancel_is_counted_as_a_completion(stack: RunningStack, caller: ApiClient) -> None:
    env = dict(stack.env)
    labels = {"provider": BFL, "model": FLUX, "outcome": "cancelled"}
    with saturated_worker(caller):
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("cli cancel counted")})
        before = scrape(stack.ops_url)
        assert ops_ok(env, "cancel", request_id).strip() == "cancelled"
        after = scrape(stack.ops_url)
        assert caller.status_body(FLUX, request_id)["error_type"] == "cancelled"
        assert after.get("router_queue_depth", provider=BFL) == before.get("router_queue_depth", provider=BFL) - 1
        assert (after.get("router_queue_completions_total", **labels)
                - before.get("router_queue_completions_total", **labels)) == 1


# -- 5. JSON logs -----------------------------------------------------------------------------------

#: A gunicorn access-log line (its own logger and format, not ours).
ACCESS_LINE = re.compile(r'^\S+ - \S+ \[[^\]]+\] "(GET|POST|PUT|DELETE|HEAD) \S+ HTTP/[\d.]+" \d{3} ')


def test_json_logs_carry_the_request_context_and_never_the_key(stack: RunningStack, caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("json logs")})
    caller.wait_status(FLUX, request_id)
    context = {"request_id": request_id, "workspace": caller.workspace, "model": FLUX}

    def lines_about(name: str) -> list[dict]:
        objects, others = json_lines(stack.log_text(name))
        stray = [line for line in others if request_id in line and not ACCESS_LINE.match(line)]
        assert not stray, f"{name}.log: lines about the request that are not JSON: {stray[:5]}"
        ours = [o for o in objects if str(o.get("logger", "")).startswith(("router_queue", "workers"))]
        assert ours, f"{name}.log has no JSON line of our loggers"
        for line in ours:
            assert {"time", "level", "logger", "message"} <= line.keys(), line
        return [o for o in objects if o.get("request_id") == request_id or request_id in str(o.get("message"))]

    def wait_lines(name: str, want) -> list[dict]:
        return wait_for(lambda: [o for o in lines_about(name) if want(o)], timeout_s=10,
                        what=f"{name}.log lines about {request_id}")

    claim = wait_lines("worker", lambda o: str(o.get("message", "")).startswith("claim:"))
    assert len(claim) == 1, claim
    assert {k: claim[0].get(k) for k in context} == context, claim[0]
    assert claim[0]["outcome"] == "claimed" and claim[0]["logger"] == "workers.delivery"

    done = wait_lines("worker", lambda o: "completed" in str(o.get("message", "")) and o.get("outcome"))
    assert len(done) == 1, done
    assert {k: done[0].get(k) for k in context} == context, done[0]
    assert done[0]["outcome"] == "success" and done[0]["status"] == "COMPLETED"

    submitted = wait_lines("web", lambda o: str(o.get("message", "")).startswith("submit:"))
    assert len(submitted) == 1, submitted
    assert {k: submitted[0].get(k) for k in context} == context, submitted[0]
    assert submitted[0]["outcome"] == "admitted"

    # Lines about the request carry its context; the API key is on no line of any log.
    for name in ("worker", "web"):
        for line in lines_about(name):
            if line.get("request_id") == request_id:
                assert line.get("workspace") in (None, caller.workspace), line
    for path in stack.stack.log_dir.glob("*.log"):
        assert caller.api_key not in path.read_text(errors="replace"), f"the API key is in {path}"
