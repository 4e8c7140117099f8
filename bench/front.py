"""The front-door phases: the real front door against a Flask hello world served the same way
(gunicorn, gevent), loaded with wrk, baseline and subject interleaved over a few rounds."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import redis

from . import schedule
from .core import (
    MODEL_ID,
    Context,
    MeasurementError,
    capped_catalog,
    emit,
    http_json,
    label,
    median_round,
    option,
    phase,
    redis_cpu,
    server_env,
    wait_http,
)
from .load import Driver, LoadResult, Shot
from .procs import Children, cpu_seconds, ensure_tool, log, start_gunicorn, start_redis

SUBMIT_BODY = '{"prompt": "bench"}'


def add_arguments(parser) -> None:
    group = parser.add_argument_group("front door (status_read, floor, submit, replicated, depth)")
    option(group, "--workers", 2, "gunicorn gevent workers per app (default 2, the Procfile's WEB_CONCURRENCY)")
    option(group, "--threads", 2, "wrk threads (default 2)")
    option(group, "--connections", 16, "wrk connections (default 16; at least --threads)")
    option(group, "--duration", 5, "seconds per measured run (default 5)")
    option(group, "--warmup", 2, "seconds of warm-up per target (default 2)", minimum=0)
    option(group, "--rounds", 3, "interleaved baseline/subject rounds; medians are reported (default 3)")
    option(group, "--near", 10, "requests ahead for the cost baseline (default 10)")
    option(group, "--depth", 100_000, "requests ahead for the deep read (default 100000)")
    option(group, "--depth-rounds", 5, "interleaved rounds of the depth figure (default 5: its A/A spread on this "
           "machine is wider than the target)")
    option(group, "--depth-workspaces", 1000, "workspaces the requests ahead are spread over (default 1000; "
           "the near side uses min(this, --near))")


def check_arguments(parser, args) -> None:
    if args.connections < args.threads:
        parser.error("connections must be at least threads (wrk)")


@dataclass
class FrontDoor:
    """The front door and the hello world, both served, a seeded workspace's key, the load driver."""

    services: Any
    entry: Any
    env: dict[str, str]
    url: str
    proc: Any
    hello: str
    hello_proc: Any
    driver: Driver
    auth: dict[str, str]
    post_headers: dict[str, str] = field(init=False)
    submit_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.submit_url = f"{self.url}/v2/models/{MODEL_ID}/requests"


def start(ctx: Context) -> FrontDoor:
    from router_queue.services import Services
    from router_queue.settings import Settings

    args, children = ctx.args, ctx.children
    wrk = ensure_tool("wrk", "wrk")
    if wrk is None:
        raise SystemExit("bench: wrk is required and could not be installed with apt-get")
    services = Services.build(Settings.from_env({"REDIS_URL": ctx.redis_url}))
    entry = services.catalog.by_id(MODEL_ID)
    if entry is None:
        raise SystemExit(f"{MODEL_ID} is not in the catalog")
    workspace = services.accounts.create_workspace("bench", queue_enabled=True, credits=10**12)
    # The workspace's own limits, far above what a run reaches: every call still pays for the
    # rate-limit check, the backlog cap and the byte quota, none is refused by them (the defaults,
    # 50/second, 1000 waiting and 256 MiB of bodies, would refuse most of a run's calls and the 100k
    # seeded requests)
    services.accounts.set_limits(workspace, max_queued=10**9, rate_limit="10000000/second", max_queued_bytes=10**12)
    api_key = services.accounts.mint_key(workspace)
    log(f"seeded workspace {workspace} with queued delivery on, limits out of reach, and a key")
    env = server_env(ctx.redis_url)
    url, proc = start_gunicorn(children, "frontdoor", "router_queue.wsgi:app", env, args.workers)
    hello, hello_proc = start_gunicorn(children, "hello", "bench.hello:app", env, args.workers)
    wait_http(f"{url}/healthz", proc)
    wait_http(f"{hello}/hello", hello_proc)
    log(f"front door {url}, hello world {hello}, {args.workers} gevent workers each; "
        f"load: wrk {args.threads} threads x {args.connections} connections, "
        f"{args.duration} s runs, {args.rounds} rounds")
    driver = Driver(wrk, ctx.tmp, threads=args.threads, connections=args.connections)
    return FrontDoor(services, entry, env, url, proc, hello, hello_proc, driver, {"X-API-Key": api_key})


def stop(front: FrontDoor, children: Children) -> list[str]:
    """Stop both servers; the names of those that exited during the run."""
    died = []
    for name, proc in (("front door", front.proc), ("hello world", front.hello_proc)):
        if proc.poll() is not None:
            log(f"ERROR: the {name} gunicorn exited with {proc.returncode} during the run")
            died.append(name)
    children.stop({"frontdoor", "hello"})
    return died


# -- interleaved pairs of load runs -----------------------------------------------------


@dataclass
class Target:
    """What one side of a pair loads: a shot at a server, with an optional check before each run."""

    label: str
    shot: Shot
    server_pid: int
    enter: Callable[[], None] | None = None


def _run(driver: Driver, target: Target, seconds: int) -> tuple[LoadResult, float | None]:
    """One load run; also the server's CPU (master + workers) per completed request, in ms."""
    if target.enter:
        target.enter()
    before = cpu_seconds(target.server_pid)
    result = driver.run(target.shot, seconds)
    after = cpu_seconds(target.server_pid)
    cpu_ms = None
    if before is not None and after is not None and result.requests:
        cpu_ms = 1000.0 * (after - before) / result.requests
    return result, cpu_ms


def _checked(result: LoadResult, what: str, expected_status: int) -> LoadResult:
    answered = result.expected + result.unexpected
    if answered == 0 or result.ok_fraction < 0.5:
        raise MeasurementError(
            f"{what}: only {result.expected} of {answered} answers were {expected_status} "
            f"({result.socket_errors} socket errors); the figure would be meaningless")
    if result.unexpected or result.socket_errors:
        log(f"warning: {what}: {result.unexpected} answers were not {expected_status}, "
            f"{result.socket_errors} socket errors")
    return result


def _describe(result: LoadResult, cpu_ms: float | None) -> str:
    cpu = f", {cpu_ms:.2f} ms server CPU/req" if cpu_ms is not None else ""
    return f"{result.rate:.1f} req/s (p50 {result.p50_ms:.2f} ms{cpu})"


def measure_pair(ctx: Context, name: str, baseline: Target, subject: Target,
                 rounds: int | None = None) -> tuple[list[LoadResult], LoadResult, LoadResult]:
    """Warm both up, then ``rounds`` x (baseline, subject), every run checked: the subject's runs and
    the (baseline, subject) of the round with the median rate ratio."""
    args, driver = ctx.args, ctx.front.driver
    rounds = rounds or args.rounds
    if args.warmup > 0:
        log(f"{name}: warm-up ({args.warmup} s each)")
        for target in (baseline, subject):
            _run(driver, target, args.warmup)
    pairs = []
    for round_no in range(1, rounds + 1):
        b, b_cpu = _run(driver, baseline, args.duration)
        _checked(b, f"{name} {baseline.label}", baseline.shot.expected_status)
        s, s_cpu = _run(driver, subject, args.duration)
        _checked(s, f"{name} {subject.label}", subject.shot.expected_status)
        pairs.append((b, s))
        log(f"{name} round {round_no}/{rounds}: {baseline.label} {_describe(b, b_cpu)}; "
            f"{subject.label} {_describe(s, s_cpu)}")
    log(f"{name}: {subject.label} / {baseline.label} rate ratio per round: "
        + " ".join(f"{s.rate / b.rate:.3f}" for b, s in pairs) + " (the median round is reported)")
    b, s = median_round(pairs, lambda b, s: s.rate / b.rate)
    return [s for _, s in pairs], b, s


def _hello(front: FrontDoor, method: str = "GET") -> Target:
    if method == "POST":
        return Target("hello POST", Shot("POST", f"{front.hello}/hello", 201, front.post_headers, SUBMIT_BODY),
                      front.hello_proc.pid)
    return Target("hello GET", Shot("GET", f"{front.hello}/hello", 200, front.auth), front.hello_proc.pid)


def _submit(front: FrontDoor, url: str, pid: int, what: str = "submit") -> Target:
    return Target(what, Shot("POST", url, 201, front.post_headers, SUBMIT_BODY), pid)


# -- the phases -----------------------------------------------------------------------


@phase("status_read", "front", 10)
def status_read(ctx: Context) -> None:
    front = ctx.front
    code, handle = http_json("POST", front.submit_url, front.post_headers, SUBMIT_BODY)
    if code != 201 or "request_id" not in handle:
        raise MeasurementError(f"status_read: the target submit answered {code}: {handle}")
    url = f"{front.submit_url}/{handle['request_id']}/status"
    code, body = http_json("GET", url, front.auth)
    if code != 200:
        raise MeasurementError(f"status_read: a status read answered {code}: {body}")
    _, b, v = measure_pair(ctx, "status_read", _hello(front),
                           Target("status read", Shot("GET", url, 200, front.auth), front.proc.pid))
    emit("status_read_throughput", v.rate, "req/s", b.rate)


@phase("floor", "front", 20)
def floor(ctx: Context) -> None:
    """What one Redis round trip costs a hello world served this way: the floor under any read
    that must touch Redis."""
    front = ctx.front
    _, b, v = measure_pair(ctx, "floor", _hello(front),
                           Target("hello + one Redis INCR", Shot("GET", f"{front.hello}/hello/redis", 200,
                                                                 front.auth), front.hello_proc.pid))
    emit("one_redis_round_trip_throughput", v.rate, "req/s", b.rate)


@phase("submit", "front", 30)
def submit(ctx: Context) -> None:
    from router_queue.store import keys

    front = ctx.front
    client = front.services.redis
    queue_key = keys.queue(front.entry.provider)
    before = client.zcard(queue_key)
    runs, b, v = measure_pair(ctx, "submit", _hello(front, "POST"), _submit(front, front.submit_url, front.proc.pid))
    measured = sum(r.expected for r in runs)
    grown = client.zcard(queue_key) - before
    # warm-up submits grew the index too; every measured 201 must be in it
    if grown < measured:
        raise MeasurementError(f"submit: {measured} answers were 201 but the queue index grew by only {grown}")
    log(f"submit: queue index grew by {grown} (measured 201s: {measured}, the rest from warm-up)")
    emit("submit_throughput", v.rate, "req/s", b.rate)


@phase("replicated", "front", 40)
def replicated(ctx: Context) -> None:
    """What REDIS_WAIT_REPLICAS=1 costs a submit: a second front door that WAITs for a replica
    (started here, replicating the bench's private Redis) after each admission."""
    import os

    if os.environ.get("REDIS_URL"):
        log("replicated: skipped: the bench attaches a replica only to its own private Redis")
        return
    front, children = ctx.front, ctx.children
    try:
        _attach_replica(ctx, "replicated")
        waiting, waiting_proc = start_gunicorn(children, "frontdoor-wait", "router_queue.wsgi:app",
                                               dict(front.env, REDIS_WAIT_REPLICAS="1"), ctx.args.workers)
        wait_http(f"{waiting}/healthz", waiting_proc)
        _, b, v = measure_pair(ctx, "replicated", _submit(front, front.submit_url, front.proc.pid),
                               _submit(front, f"{waiting}/v2/models/{MODEL_ID}/requests", waiting_proc.pid,
                                       "submit, WAIT 1 replica"))
    finally:
        children.stop({"frontdoor-wait", "redis-replica"})
    emit("submit_throughput_wait_1_replica", v.rate, "req/s", b.rate)


def _attach_replica(ctx: Context, what: str) -> str:
    """A replica of the bench's private Redis (``redis-replica``), once it follows it; its URL."""
    primary = urlsplit(ctx.redis_url)
    url, _ = start_redis(ctx.children, shutil.which("redis-server"), "redis-replica",
                         ("--replicaof", primary.hostname, str(primary.port)))
    deadline = time.monotonic() + 30
    while ctx.front.services.redis.info("replication").get("connected_slaves") != 1:
        if time.monotonic() > deadline:
            raise MeasurementError(f"{what}: the replica did not connect within 30 s")
        time.sleep(0.1)
    return url


@phase("replica_reads", "front", 45)
def replica_reads(ctx: Context) -> None:
    """The primary's CPU per status poll when a replica serves the reads (a second front door
    with REDIS_READ_URL) against the same polls served by the primary (the plain front door)."""
    import os

    if os.environ.get("REDIS_URL"):
        log("replica_reads: skipped: the bench attaches a replica only to its own private Redis")
        return
    front, children, args = ctx.front, ctx.children, ctx.args
    code, handle = http_json("POST", front.submit_url, front.post_headers, SUBMIT_BODY)
    if code != 201 or "request_id" not in handle:
        raise MeasurementError(f"replica_reads: the target submit answered {code}: {handle}")
    path = f"/v2/models/{MODEL_ID}/requests/{handle['request_id']}/status"
    try:
        replica_url = _attach_replica(ctx, "replica_reads")
        reading, reading_proc = start_gunicorn(children, "frontdoor-replica", "router_queue.wsgi:app",
                                               dict(front.env, REDIS_READ_URL=replica_url), args.workers)
        wait_http(f"{reading}/healthz", reading_proc)
        sides = (Target("status read, primary", Shot("GET", front.url + path, 200, front.auth), front.proc.pid),
                 Target("status read, replica", Shot("GET", reading + path, 200, front.auth), reading_proc.pid))
        primary, replica = front.services.redis, redis.Redis.from_url(replica_url)
        for target in sides:
            _run(front.driver, target, args.warmup or 1)
        pairs = []
        for round_no in range(1, args.rounds + 1):
            per_poll = []
            for target in sides:
                before, replica_before = redis_cpu(primary), redis_cpu(replica)
                result, _ = _run(front.driver, target, args.duration)
                _checked(result, f"replica_reads {target.label}", 200)
                per_poll.append(1000.0 * (redis_cpu(primary) - before) / result.requests)
                replica_us = 1e6 * (redis_cpu(replica) - replica_before) / result.requests
                log(f"replica_reads round {round_no}/{args.rounds}: {target.label} {result.rate:.1f} req/s, "
                    f"CPU per poll: primary {1000 * per_poll[-1]:.1f} µs, replica {replica_us:.1f} µs")
            pairs.append(tuple(per_poll))
    finally:
        children.stop({"frontdoor-replica", "redis-replica"})
    b, v = median_round(pairs, lambda b, v: v / b)
    emit("status_primary_cpu_with_replica", v, "ms", b)


def _depth_side(ctx: Context, which: str, ahead: int, url: str, catalog_path) -> tuple[Target, Any, str]:
    """Seed one side's database with ``ahead`` requests before the target and serve it; its target."""
    args, front = ctx.args, ctx.front
    started = time.monotonic()
    side = schedule.services_for(url, catalog_path)
    side.redis.flushdb()
    workspace_id, request_id, position = schedule.seed_behind(side, front.entry, ahead, args.depth_workspaces,
                                                              SUBMIT_BODY)
    if which == "deep" and args.depth >= 100_000 and position <= 99_000:
        raise MeasurementError(f"depth: the deep target sits at position {position}, not above 99,000")
    auth = {"X-API-Key": side.accounts.mint_key(workspace_id)}
    log(f"depth: {which}: seeded {ahead} queued requests over {max(1, min(args.depth_workspaces, ahead))} "
        f"workspace(s) ahead of {request_id} (position {position}: admit.lua, lib.lua's formula and the count "
        f"agree) in {time.monotonic() - started:.1f} s")
    side_front, side_proc = start_gunicorn(ctx.children, f"frontdoor-{which}", "router_queue.wsgi:app",
                                           dict(front.env, REDIS_URL=url, CATALOG_PATH=str(catalog_path)),
                                           args.workers)
    wait_http(f"{side_front}/healthz", side_proc)
    status_url = f"{side_front}/v2/models/{MODEL_ID}/requests/{request_id}/status"

    def position_holds() -> None:
        code, body = http_json("GET", status_url, auth)
        if code != 200 or body.get("queue_position") != ahead:
            raise MeasurementError(f"depth: a status read answered {code} with queue_position="
                                   f"{body.get('queue_position')}, expected {ahead}")

    return Target(f"behind {ahead}", Shot("GET", status_url, 200, auth), side_proc.pid, position_holds), side, \
        request_id


@phase("depth", "front", 50, side_dbs=True)
def depth(ctx: Context) -> None:
    """A waiting request lives in the schedule (several keys): each side gets its own database and
    front door, served a catalog copy capping the provider at 1 with one claimed request holding
    that slot, so nothing is ever granted; the two front doors' runs interleave as every pair does."""
    args, provider = ctx.args, ctx.front.entry.provider
    catalog_path = capped_catalog(ctx.tmp, {provider: 1})
    try:
        near, near_side, near_id = _depth_side(ctx, "near", args.near, ctx.side_urls[0], catalog_path)
        deep, deep_side, deep_id = _depth_side(ctx, "deep", args.depth, ctx.side_urls[1], catalog_path)
        _, n, d = measure_pair(ctx, "depth", near, deep, rounds=args.depth_rounds)
    finally:
        ctx.children.stop({"frontdoor-near", "frontdoor-deep"})
    # status.lua alone, no HTTP: the schedule's own share of a read (stderr only)
    script_us: dict[str, list[float]] = {"near": [], "deep": []}
    for _ in range(3):
        for which, side, request_id, ahead in (("near", near_side, near_id, args.near),
                                               ("deep", deep_side, deep_id, args.depth)):
            wall_us, used_us = schedule.time_status_reads(side, request_id, provider)
            script_us[which].append(used_us)
            log(f"depth: status.lua alone behind {ahead} (RequestStore.status_view, no HTTP): {wall_us:.0f} us "
                f"per round trip, {used_us:.1f} us in the script (INFO commandstats)")
    log(f"depth: the script's own cost behind {args.depth} / behind {args.near}, per round: "
        + " ".join(f"{d / n:.3f}" for n, d in zip(script_us["near"], script_us["deep"])))
    emit(f"status_read_cost_behind_{label(args.depth)}", 1000.0 / d.rate, "ms", 1000.0 / n.rate)
