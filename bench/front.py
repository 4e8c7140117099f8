"""The front-door phases: the real front door against a Flask hello world served the same way
(gunicorn, gevent), loaded with wrk, baseline and subject interleaved over a few rounds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import redis

from . import schedule
from .core import (
    MODEL_ID,
    Children,
    Context,
    MeasurementError,
    capped_catalog,
    cpu_seconds,
    emit,
    ensure_tool,
    http_json,
    label,
    log,
    median_round,
    new_workspace,
    option,
    phase,
    redis_cpu,
    server_env,
    start_gunicorn,
    start_redis,
    wait_http,
)

SUBMIT_BODY = '{"prompt": "bench"}'
APP = "router_queue.wsgi:app"


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
    """The front door and the hello world, both served, and a seeded workspace's key."""

    services: Any
    entry: Any
    env: dict[str, str]
    url: str
    proc: Any
    hello: str
    hello_proc: Any
    wrk: str
    auth: dict[str, str]

    def __post_init__(self) -> None:
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.submit_url = f"{self.url}/v2/models/{MODEL_ID}/requests"

    def queued_request(self, what: str) -> str:
        """The id of a request submitted now (it stays queued: no worker runs)."""
        code, handle = http_json("POST", self.submit_url, self.post_headers, SUBMIT_BODY)
        if code != 201 or "request_id" not in handle:
            raise MeasurementError(f"{what}: the target submit answered {code}: {handle}")
        return handle["request_id"]


def start(ctx: Context) -> FrontDoor:
    from router_queue.services import Services
    from router_queue.settings import Settings

    args, children = ctx.args, ctx.children
    if (wrk := ensure_tool("wrk", "wrk")) is None:
        raise SystemExit("bench: wrk is required and could not be installed with apt-get")
    services = Services.build(Settings.from_env({"REDIS_URL": ctx.redis_url}))
    if (entry := services.catalog.by_id(MODEL_ID)) is None:
        raise SystemExit(f"{MODEL_ID} is not in the catalog")
    # limits out of reach: every call still pays for the checks, none is refused by them
    api_key = services.accounts.mint_key(new_workspace(services, "bench"))
    log("seeded a workspace with queued delivery on, limits out of reach, and a key")
    env = server_env(ctx.redis_url)
    url, proc = start_gunicorn(children, "frontdoor", APP, env, args.workers)
    hello, hello_proc = start_gunicorn(children, "hello", "bench.hello:app", env, args.workers)
    wait_http(f"{url}/healthz", proc)
    wait_http(f"{hello}/hello", hello_proc)
    log(f"front door {url}, hello world {hello}, {args.workers} gevent workers each; load: wrk {args.threads} "
        f"threads x {args.connections} connections, {args.duration} s runs, {args.rounds} rounds")
    return FrontDoor(services, entry, env, url, proc, hello, hello_proc, wrk, {"X-API-Key": api_key})


def stop(front: FrontDoor, children: Children) -> list[str]:
    """Stop both servers; the names of those that exited during the run."""
    died = []
    for name, proc in (("front door", front.proc), ("hello world", front.hello_proc)):
        if proc.poll() is not None:
            log(f"ERROR: the {name} gunicorn exited with {proc.returncode} during the run")
            died.append(name)
    children.stop({"frontdoor", "hello"})
    return died


# -- wrk runs, in interleaved pairs ---------------------------------------------------------

_LUA = """-- generated by bench/front.py
wrk.method = {method}
wrk.body = {body}
{headers}
local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) expected = 0; unexpected = 0 end
function response(status, headers, body)
  if status == {status} then expected = expected + 1 else unexpected = unexpected + 1 end
end
function done(summary, latency, requests)
  local e, u = 0, 0
  for _, t in ipairs(threads) do e = e + t:get("expected"); u = u + t:get("unexpected") end
  io.write(string.format("BENCHLUA expected=%d unexpected=%d p50_us=%d\\n", e, u, latency:percentile(50)))
end
"""


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass
class Target:
    """One side of a pair: one request sent over and over to a server, an optional check before each run."""

    label: str
    method: str
    url: str
    status: int
    headers: dict[str, str]
    server_pid: int
    body: str = ""
    enter: Callable[[], None] | None = None
    script: Path | None = None  # the wrk script, written at the first run


@dataclass(frozen=True)
class LoadResult:
    rate: float  # completed requests per second
    p50_ms: float
    requests: int  # completed requests
    expected: int  # answers with the expected status
    unexpected: int
    socket_errors: int


def _wrk(ctx: Context, target: Target, seconds: int) -> LoadResult:
    if target.script is None:
        target.script = ctx.tmp / f"shot-{id(target)}.lua"
        headers = "\n".join(f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in target.headers.items())
        target.script.write_text(_LUA.format(method=_lua_string(target.method), body=_lua_string(target.body),
                                             headers=headers, status=target.status))
    args = ctx.args
    argv = [ctx.front.wrk, f"-t{args.threads}", f"-c{args.connections}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(target.script), target.url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    out = done.stdout
    if done.returncode != 0 or "Requests/sec" not in out:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or out.strip()}")
    lua = re.search(r"BENCHLUA expected=(\d+) unexpected=(\d+) p50_us=(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return LoadResult(float(re.search(r"Requests/sec:\s*([\d.]+)", out).group(1)), int(lua.group(3)) / 1000.0,
                      int(re.search(r"(\d+) requests in", out).group(1)), int(lua.group(1)), int(lua.group(2)),
                      sum(int(g) for g in errors.groups()) if errors else 0)


def _run(ctx: Context, target: Target, seconds: int, what: str = "") -> tuple[LoadResult, str]:
    """One load run (checked unless a warm-up): the result and the server's CPU per request, described."""
    if target.enter:
        target.enter()
    before = cpu_seconds(target.server_pid)
    result = _wrk(ctx, target, seconds)
    after = cpu_seconds(target.server_pid)
    answered = result.expected + result.unexpected
    if what and (answered == 0 or result.expected / answered < 0.5):
        raise MeasurementError(f"{what}: only {result.expected} of {answered} answers were {target.status} "
                               f"({result.socket_errors} socket errors); the figure would be meaningless")
    if what and (result.unexpected or result.socket_errors):
        log(f"warning: {what}: {result.unexpected} answers were not {target.status}, "
            f"{result.socket_errors} socket errors")
    cpu = ""
    if before is not None and after is not None and result.requests:
        cpu = f", {1000.0 * (after - before) / result.requests:.2f} ms server CPU/req"
    return result, f"{result.rate:.1f} req/s (p50 {result.p50_ms:.2f} ms{cpu})"


def measure_pair(ctx: Context, name: str, baseline: Target, subject: Target,
                 rounds: int | None = None) -> tuple[list[LoadResult], LoadResult, LoadResult]:
    """Warm both up, then ``rounds`` x (baseline, subject): the subject's runs and the (baseline, subject)
    of the round with the median rate ratio."""
    args = ctx.args
    rounds = rounds or args.rounds
    if args.warmup > 0:
        log(f"{name}: warm-up ({args.warmup} s each)")
        for target in (baseline, subject):
            _run(ctx, target, args.warmup)
    pairs = []
    for round_no in range(1, rounds + 1):
        b, b_said = _run(ctx, baseline, args.duration, f"{name} {baseline.label}")
        s, s_said = _run(ctx, subject, args.duration, f"{name} {subject.label}")
        pairs.append((b, s))
        log(f"{name} round {round_no}/{rounds}: {baseline.label} {b_said}; {subject.label} {s_said}")
    log(f"{name}: {subject.label} / {baseline.label} rate ratio per round: "
        + " ".join(f"{s.rate / b.rate:.3f}" for b, s in pairs) + " (the median round is reported)")
    return [s for _, s in pairs], *median_round(pairs, lambda b, s: s.rate / b.rate)


def _hello(front: FrontDoor, method: str = "GET") -> Target:
    if method == "POST":
        return Target("hello POST", "POST", f"{front.hello}/hello", 201, front.post_headers, front.hello_proc.pid,
                      SUBMIT_BODY)
    return Target("hello GET", "GET", f"{front.hello}/hello", 200, front.auth, front.hello_proc.pid)


def _submit(front: FrontDoor, url: str, pid: int, what: str = "submit") -> Target:
    return Target(what, "POST", url, 201, front.post_headers, pid, SUBMIT_BODY)


# -- the phases -----------------------------------------------------------------------


@phase("status_read", "front", 10)
def status_read(ctx: Context) -> None:
    front = ctx.front
    url = f"{front.submit_url}/{front.queued_request('status_read')}/status"
    code, body = http_json("GET", url, front.auth)
    if code != 200:
        raise MeasurementError(f"status_read: a status read answered {code}: {body}")
    _, b, v = measure_pair(ctx, "status_read", _hello(front),
                           Target("status read", "GET", url, 200, front.auth, front.proc.pid))
    emit("status_read_throughput", v.rate, "req/s", b.rate)


@phase("floor", "front", 20)
def floor(ctx: Context) -> None:
    """One Redis round trip on the hello world: the floor under any read that must touch Redis."""
    front = ctx.front
    _, b, v = measure_pair(ctx, "floor", _hello(front), Target("hello + one Redis INCR", "GET",
                           f"{front.hello}/hello/redis", 200, front.auth, front.hello_proc.pid))
    emit("one_redis_round_trip_throughput", v.rate, "req/s", b.rate)


@phase("submit", "front", 30)
def submit(ctx: Context) -> None:
    from router_queue.store import keys

    front = ctx.front
    queue_key = keys.queue(front.entry.provider)
    before = front.services.redis.zcard(queue_key)
    runs, b, v = measure_pair(ctx, "submit", _hello(front, "POST"), _submit(front, front.submit_url, front.proc.pid))
    measured = sum(r.expected for r in runs)
    # warm-up submits grew the index too; every measured 201 must be in it
    if (grown := front.services.redis.zcard(queue_key) - before) < measured:
        raise MeasurementError(f"submit: {measured} answers were 201 but the queue index grew by only {grown}")
    log(f"submit: queue index grew by {grown} (measured 201s: {measured}, the rest from warm-up)")
    emit("submit_throughput", v.rate, "req/s", b.rate)


@contextmanager
def _replica_front(ctx: Context, name: str, env_for: Callable[[str], dict[str, str]]):
    """A replica of the bench's private Redis (``redis-replica``) and a third front door (``frontdoor-<name>``)
    whose environment adds ``env_for(replica URL)``: (its URL, its master, the replica's URL)."""
    primary = urlsplit(ctx.redis_url)
    try:
        replica_url = start_redis(ctx.children, shutil.which("redis-server"), "redis-replica",
                                  ("--replicaof", primary.hostname, str(primary.port)))
        deadline = time.monotonic() + 30
        while ctx.front.services.redis.info("replication").get("connected_slaves") != 1:
            if time.monotonic() > deadline:
                raise MeasurementError(f"{name}: the replica did not connect within 30 s")
            time.sleep(0.1)
        url, proc = start_gunicorn(ctx.children, f"frontdoor-{name}", APP,
                                   dict(ctx.front.env, **env_for(replica_url)), ctx.args.workers)
        wait_http(f"{url}/healthz", proc)
        yield url, proc, replica_url
    finally:
        ctx.children.stop({f"frontdoor-{name}", "redis-replica"})


def _shared_redis(what: str) -> bool:
    if os.environ.get("REDIS_URL"):
        log(f"{what}: skipped: the bench attaches a replica only to its own private Redis")
    return bool(os.environ.get("REDIS_URL"))


@phase("replicated", "front", 40)
def replicated(ctx: Context) -> None:
    """What REDIS_WAIT_REPLICAS=1 costs a submit (a front door that WAITs for a replica after each admission)."""
    if _shared_redis("replicated"):
        return
    front = ctx.front
    with _replica_front(ctx, "wait", lambda _: {"REDIS_WAIT_REPLICAS": "1"}) as (waiting, waiting_proc, _):
        _, b, v = measure_pair(ctx, "replicated", _submit(front, front.submit_url, front.proc.pid),
                               _submit(front, f"{waiting}/v2/models/{MODEL_ID}/requests", waiting_proc.pid,
                                       "submit, WAIT 1 replica"))
    emit("submit_throughput_wait_1_replica", v.rate, "req/s", b.rate)


@phase("replica_reads", "front", 45)
def replica_reads(ctx: Context) -> None:
    """The primary's CPU per status poll when a replica serves the reads (a front door with REDIS_READ_URL)
    against the same polls served by the primary (the plain front door)."""
    if _shared_redis("replica_reads"):
        return
    front, args = ctx.front, ctx.args
    path = f"/v2/models/{MODEL_ID}/requests/{front.queued_request('replica_reads')}/status"
    with _replica_front(ctx, "replica", lambda url: {"REDIS_READ_URL": url}) as (reading, reading_proc, replica_url):
        sides = (Target("status read, primary", "GET", front.url + path, 200, front.auth, front.proc.pid),
                 Target("status read, replica", "GET", reading + path, 200, front.auth, reading_proc.pid))
        primary, replica = front.services.redis, redis.Redis.from_url(replica_url)
        for target in sides:
            _run(ctx, target, args.warmup or 1)
        pairs = []
        for round_no in range(1, args.rounds + 1):
            per_poll = []
            for target in sides:
                before, replica_before = redis_cpu(primary), redis_cpu(replica)
                result, _ = _run(ctx, target, args.duration, f"replica_reads {target.label}")
                per_poll.append(1000.0 * (redis_cpu(primary) - before) / result.requests)
                replica_us = 1e6 * (redis_cpu(replica) - replica_before) / result.requests
                log(f"replica_reads round {round_no}/{args.rounds}: {target.label} {result.rate:.1f} req/s, "
                    f"CPU per poll: primary {1000 * per_poll[-1]:.1f} µs, replica {replica_us:.1f} µs")
            pairs.append(tuple(per_poll))
    b, v = median_round(pairs, lambda b, v: v / b)
    emit("status_primary_cpu_with_replica", v, "ms", b)


def _depth_side(ctx: Context, which: str, ahead: int, url: str, catalog_path: Path) -> tuple[Target, Any, str]:
    """Seed one side's database with ``ahead`` requests before the target and serve it: its target."""
    args, front = ctx.args, ctx.front
    started = time.monotonic()
    side = schedule.services_for(url, catalog_path)
    side.redis.flushdb()
    workspace_id, request_id = schedule.seed_behind(side, front.entry, ahead, args.depth_workspaces, SUBMIT_BODY)
    auth = {"X-API-Key": side.accounts.mint_key(workspace_id)}
    log(f"depth: {which}: seeded {ahead} queued requests over {max(1, min(args.depth_workspaces, ahead))} "
        f"workspace(s) ahead of {request_id} (position {ahead}: admit.lua, lib.lua's formula and the count "
        f"agree) in {time.monotonic() - started:.1f} s")
    side_front, side_proc = start_gunicorn(ctx.children, f"frontdoor-{which}", APP,
                                           dict(front.env, REDIS_URL=url, CATALOG_PATH=str(catalog_path)),
                                           args.workers)
    wait_http(f"{side_front}/healthz", side_proc)
    status_url = f"{side_front}/v2/models/{MODEL_ID}/requests/{request_id}/status"

    def position_holds() -> None:
        code, body = http_json("GET", status_url, auth)
        if code != 200 or body.get("queue_position") != ahead:
            raise MeasurementError(f"depth: a status read answered {code} with queue_position="
                                   f"{body.get('queue_position')}, expected {ahead}")

    return Target(f"behind {ahead}", "GET", status_url, 200, auth, side_proc.pid, enter=position_holds), side, \
        request_id


@phase("depth", "front", 50, side_dbs=True)
def depth(ctx: Context) -> None:
    """Each side gets its own database and front door, the provider capped at 1 and that slot held, so
    nothing is ever granted (bench/README.md)."""
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
