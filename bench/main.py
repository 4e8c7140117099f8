"""The router-queue benchmark: ``bench/run [options]``.

Starts a Redis (unless ``REDIS_URL`` is set), the real front door and a Flask
hello world under identical gunicorn settings, seeds a workspace and a key,
and measures with wrk, baseline and subject interleaved over a few rounds
(medians reported); the depth figure on two more front doors, each on its own
database holding one side's schedule. Then the schedule's dispatch cost driven
through the store alone (bench/schedule.py). Then, for the delivery figures
(dispatch, grant_to_start, inflight, sync_held, waiting_cpu), the whole stack on
a flushed database: stub provider, Celery workers, beat and gunicorn
(bench/fleet.py, bench/capped.py). Prints one ``BENCH`` line per figure on stdout and
everything else on stderr; stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from . import fleet, history, hostile, schedule
from .load import Driver, LoadResult, Shot
from .procs import ROOT, Children, cpu_seconds, ensure_tool, log, start_gunicorn, start_redis

MODEL_ID = "bfl/flux-2-pro"
SUBMIT_BODY = '{"prompt": "bench"}'
#: Phases on the front door alone (no Celery worker), on the store alone (Redis, no
#: server), then phases on the whole stack.
FRONT_PHASES = ("status_read", "floor", "submit", "replicated", "depth", "hostile_body_ratio", "history_paging")
STORE_PHASES = ("dispatch_cost", "waiting_memory")
PHASES = FRONT_PHASES + STORE_PHASES + fleet.PHASES
#: Phases that use the two side databases (``--side-dbs``).
SIDE_DB_PHASES = {"depth", "dispatch_cost", "waiting_memory"}


# -- arguments and small helpers ----------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2,
                        help="gunicorn gevent workers per app (default 2, the Procfile's WEB_CONCURRENCY)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (default 16)")
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per target (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved baseline/subject rounds; medians are reported (default 3)")
    parser.add_argument("--near", type=int, default=10, help="requests ahead for the cost baseline (default 10)")
    parser.add_argument("--depth", type=int, default=100_000, help="requests ahead for the deep read (default 100000)")
    parser.add_argument("--depth-rounds", type=int, default=5,
                        help="interleaved rounds of the depth figure (default 5: its A/A spread on this "
                             "machine is wider than the target)")
    parser.add_argument("--depth-workspaces", type=int, default=1000,
                        help="workspaces the requests ahead are spread over (default 1000; "
                             "the near side uses min(this, --near))")
    parser.add_argument("--redis-db", type=int, default=14,
                        help="database used (and flushed) on a shared server given by REDIS_URL (default 14)")
    parser.add_argument("--side-dbs", default="12,13",
                        help="two more databases (flushed before and after) holding the two sides of the depth "
                             "and dispatch_cost figures (default 12,13)")
    parser.add_argument("--only", "--phases", dest="only", default=",".join(PHASES),
                        help=f"comma-separated phases: {', '.join(PHASES)} (default all)")
    group = parser.add_argument_group("dispatch cost (dispatch_cost)")
    group.add_argument("--cost-workspaces", type=int, default=1000,
                       help="workspaces the waiting requests are spread over (default 1000)")
    group.add_argument("--cost-queue", type=int, default=10_000,
                       help="requests waiting behind the cap of 1, on each side, throughout (default 10000)")
    group.add_argument("--cost-cycles", type=int, default=2000,
                       help="complete -> grant -> claim cycles per run (default 2000)")
    group.add_argument("--cost-rounds", type=int, default=5,
                       help="interleaved (1 workspace, many) rounds; the median-ratio round is reported (default 5)")
    parser.add_argument("--hostile-rounds", type=int, default=15,
                        help="interleaved rounds of plain and hostile 1 MB submits (hostile_body_ratio; default 15)")
    group = parser.add_argument_group("request history (history_paging)")
    group.add_argument("--history-requests", type=int, default=100_000,
                       help="requests in the workspace's history (default 100000)")
    group.add_argument("--history-rounds", type=int, default=15,
                       help="interleaved rounds of first- and last-page reads (default 15)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with server logs")
    fleet.add_arguments(parser)
    args = parser.parse_args(argv)
    args.only = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = args.only - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    fleet.check_arguments(parser, args)
    try:
        args.side_dbs = tuple(int(d) for d in args.side_dbs.split(","))
    except ValueError:
        parser.error("--side-dbs takes two database numbers, e.g. 12,13")
    if len(args.side_dbs) != 2 or len(set(args.side_dbs)) != 2 or args.redis_db in args.side_dbs \
            or 0 in args.side_dbs:
        parser.error("--side-dbs takes two distinct database numbers, neither 0 nor --redis-db")
    if min(args.depth_rounds, args.depth_workspaces, args.near, args.depth, args.cost_workspaces, args.cost_queue,
           args.cost_cycles, args.cost_rounds, args.hostile_rounds, args.history_requests,
           args.history_rounds) < 1:
        parser.error("depth-workspaces, near, depth, hostile-rounds, the cost-* and history-* options must be at "
                     "least 1")
    if min(args.workers, args.threads, args.connections, args.duration, args.rounds) < 1:
        parser.error("workers, threads, connections, duration and rounds must be at least 1")
    if args.connections < args.threads:
        parser.error("connections must be at least threads (wrk)")
    return args


def with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db``."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        query["db"] = str(db)
        return f"unix://{parts.netloc}{parts.path}?{urlencode(query)}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "db"])
    return urlunsplit(parts._replace(path=f"/{db}", query=query))


def http_json(method: str, url: str, headers: dict[str, str], body: str | None = None) -> tuple[int, dict]:
    data = body.encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw[:300].decode(errors="replace")}


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until ``url`` answers 200 (gunicorn workers import the app after the bind)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn (pid {proc.pid}) exited with {proc.returncode} while booting {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s ({last})")


def label(count: int) -> str:
    if count >= 1000 and count % 1000 == 0:
        return f"{count // 1000}k"
    return str(count)


def fmt(value: float) -> str:
    if 0 < value < 0.1:
        return f"{value:.3g}"  # e.g. a few thousandths of a core: three significant digits
    return f"{value:.1f}" if value >= 100 else f"{value:.3f}" if value < 10 else f"{value:.2f}"


class MeasurementError(RuntimeError):
    """A figure could not be measured (e.g. most answers had the wrong status)."""


# -- measuring ------------------------------------------------------------------


@dataclass
class Pair:
    """Interleaved runs: ``baseline[i]`` and ``subject[i]`` ran back to back in round ``i``."""

    baseline: list[LoadResult]
    subject: list[LoadResult]

    def median_round(self) -> tuple[LoadResult, LoadResult]:
        """The (baseline, subject) of the round with the median subject/baseline rate ratio.

        Pairing runs that ran seconds apart cancels the slow drifts of a shared machine
        better than taking each side's median separately, and keeps value/baseline exact.
        """
        rounds = sorted(zip(self.baseline, self.subject), key=lambda bs: bs[1].rate / bs[0].rate)
        return rounds[(len(rounds) - 1) // 2]


def _check(result: LoadResult, what: str, expected_status: int) -> None:
    answered = result.expected + result.unexpected
    if answered == 0 or result.ok_fraction < 0.5:
        raise MeasurementError(
            f"{what}: only {result.expected} of {answered} answers were {expected_status} "
            f"({result.socket_errors} socket errors); the figure would be meaningless")
    if result.unexpected or result.socket_errors:
        log(f"warning: {what}: {result.unexpected} answers were not {expected_status}, "
            f"{result.socket_errors} socket errors")


@dataclass
class Target:
    """What one side of a pair loads: a shot at a server, with optional set-up around each run."""

    label: str
    shot: Shot
    server_pid: int
    enter: Callable[[], None] | None = None
    leave: Callable[[], None] | None = None


def run_target(driver: Driver, target: Target, seconds: int) -> tuple[LoadResult, float | None]:
    """One load run; also the server's CPU (master + workers) per completed request, in ms."""
    if target.enter:
        target.enter()
    try:
        before = cpu_seconds(target.server_pid)
        result = driver.run(target.shot, seconds)
        after = cpu_seconds(target.server_pid)
    finally:
        if target.leave:
            target.leave()
    cpu_ms = None
    if before is not None and after is not None and result.requests:
        cpu_ms = 1000.0 * (after - before) / result.requests
    return result, cpu_ms


def _describe(result: LoadResult, cpu_ms: float | None) -> str:
    cpu = f", {cpu_ms:.2f} ms server CPU/req" if cpu_ms is not None else ""
    return f"{result.rate:.1f} req/s (p50 {result.p50_ms:.2f} ms{cpu})"


def measure_pair(driver: Driver, args: argparse.Namespace, name: str, baseline: Target, subject: Target) -> Pair:
    """Warm both up, then ``rounds`` x (baseline, subject), interleaved; every run checked."""
    if args.warmup > 0:
        log(f"{name}: warm-up ({args.warmup} s each)")
        for target in (baseline, subject):
            run_target(driver, target, args.warmup)
    pair = Pair([], [])
    for round_no in range(1, args.rounds + 1):
        b, b_cpu = run_target(driver, baseline, args.duration)
        _check(b, f"{name} {baseline.label}", baseline.shot.expected_status)
        s, s_cpu = run_target(driver, subject, args.duration)
        _check(s, f"{name} {subject.label}", subject.shot.expected_status)
        pair.baseline.append(b)
        pair.subject.append(s)
        log(f"{name} round {round_no}/{args.rounds}: {baseline.label} {_describe(b, b_cpu)}; "
            f"{subject.label} {_describe(s, s_cpu)}")
    ratios = " ".join(f"{s.rate / b.rate:.3f}" for b, s in zip(pair.baseline, pair.subject))
    log(f"{name}: {subject.label} / {baseline.label} rate ratio per round: {ratios} (the median round is reported)")
    return pair


def emit(name: str, value: float, unit: str, baseline: float) -> None:
    ratio = value / baseline if baseline else float("nan")
    print(f"BENCH {name} value={fmt(value)} {unit} baseline={fmt(baseline)} ratio={ratio:.3f}", flush=True)


# -- the run ------------------------------------------------------------------------


def run(args: argparse.Namespace, children: Children, tmp: Path) -> int:
    import redis

    from router_queue.store import keys
    from router_queue.services import Services
    from router_queue.settings import Settings

    front_door = bool(args.only & set(FRONT_PHASES))
    wrk = ensure_tool("wrk", "wrk") if front_door else None
    if front_door and wrk is None:
        log("wrk unavailable (apt-get failed); falling back to the Python load generator, "
            "which saturates sooner: figures are not comparable with wrk runs")

    shared = bool(os.environ.get("REDIS_URL"))
    if shared:
        if args.redis_db == 0:
            raise SystemExit("refusing to use (and flush) db 0 of a shared server; pass --redis-db N")
        redis_url = with_db(os.environ["REDIS_URL"], args.redis_db)
        log(f"using the Redis at REDIS_URL, database {args.redis_db} (flushed before and after)")
    else:
        binary = ensure_tool("redis-server", "redis-server")
        if binary is None:
            raise SystemExit("redis-server is missing and apt-get could not install it; set REDIS_URL")
        redis_url, _ = start_redis(children, binary)
        log(f"private redis-server at {redis_url}")

    client = redis.Redis.from_url(redis_url)
    client.ping()
    side_urls = tuple(with_db(redis_url, db) for db in args.side_dbs)
    if shared and args.only & SIDE_DB_PHASES:
        log(f"databases {args.side_dbs[0]} and {args.side_dbs[1]} there hold the two sides of "
            f"{', '.join(sorted(args.only & SIDE_DB_PHASES))} (flushed before and after)")
        side_clients = [redis.Redis.from_url(url) for url in side_urls]
        for side in side_clients:
            side.flushdb()

        def flush_sides() -> None:
            for db, side in zip(args.side_dbs, side_clients):
                try:
                    side.flushdb()
                except redis.RedisError as exc:
                    log(f"could not flush database {db} at the end: {exc}")

        children.after_stop.append(flush_sides)
    if shared:
        client.flushdb()

        def flush_at_end() -> None:
            # after the servers stopped: requests still in their listen backlogs when the
            # last wrk run ended are answered after it, and write to Redis
            try:
                client.flushdb()
            except redis.RedisError as exc:
                log(f"could not flush database {args.redis_db} at the end: {exc}")

        children.after_stop.append(flush_at_end)
    failures: list[str] = []
    if front_door:
        failures += _measure(args, children, tmp, wrk, redis_url, side_urls, client, keys, Services, Settings)
    if "dispatch_cost" in args.only:
        try:
            schedule.measure_dispatch_cost(args, side_urls, tmp, emit)
        except (MeasurementError, schedule.MeasurementError) as exc:
            log(f"ERROR: {exc}")
            failures.append("dispatch_cost")
    if "waiting_memory" in args.only:
        try:
            schedule.measure_waiting_memory(args, side_urls[0], tmp, emit)
        except (MeasurementError, schedule.MeasurementError) as exc:
            log(f"ERROR: {exc}")
            failures.append("waiting_memory")
    if args.only & set(fleet.PHASES):
        if front_door:
            # what the front-door phases left (thousands of published deliveries, the parked
            # queues) must not reach the fleet's workers
            client.flushdb()
        failures += fleet.measure(args, children, redis_url, http_json=http_json, wait_http=wait_http,
                                  emit=emit, error_type=MeasurementError, with_db=with_db)
    if failures:
        log(f"ERROR: no figure for: {', '.join(failures)}; logs in {children.log_dir}")
        return 1
    return 0


def _measure(args, children, tmp, wrk, redis_url, side_urls, client, keys, Services, Settings) -> list[str]:
    """The front-door phases; the names of those that failed. Stops its servers at the end."""
    services = Services.build(Settings.from_env({"REDIS_URL": redis_url}))
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

    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL", "PUBLIC_BASE_URL")}
    env["REDIS_URL"] = redis_url
    env["TRUSTED_HOSTS"] = "127.0.0.1,localhost"  # the web process needs it or PUBLIC_BASE_URL
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    front, front_proc = start_gunicorn(children, "frontdoor", "router_queue.wsgi:app", env, args.workers)
    hello, hello_proc = start_gunicorn(children, "hello", "bench.hello:app", env, args.workers)
    wait_http(f"{front}/healthz", front_proc)
    wait_http(f"{hello}/hello", hello_proc)
    log(f"front door {front}, hello world {hello}, {args.workers} gevent workers each; "
        f"load: {'wrk' if wrk else 'python'} {args.threads} threads x {args.connections} connections, "
        f"{args.duration} s runs, {args.rounds} rounds")

    driver = Driver(wrk, tmp, threads=args.threads, connections=args.connections)
    auth = {"X-API-Key": api_key}
    post_headers = {**auth, "Content-Type": "application/json"}
    failures: list[str] = []

    def phase(name, fn) -> None:
        if name not in args.only:
            return
        try:
            fn()
        except (MeasurementError, schedule.MeasurementError) as exc:
            log(f"ERROR: {exc}")
            failures.append(name)

    submit_url = f"{front}/v2/models/{MODEL_ID}/requests"

    def status_url(request_id: str) -> str:
        return f"{submit_url}/{request_id}/status"

    def status_read() -> None:
        code, handle = http_json("POST", submit_url, post_headers, SUBMIT_BODY)
        if code != 201 or "request_id" not in handle:
            raise MeasurementError(f"status_read: the target submit answered {code}: {handle}")
        url = status_url(handle["request_id"])
        code, body = http_json("GET", url, auth)
        if code != 200:
            raise MeasurementError(f"status_read: a status read answered {code}: {body}")
        pair = measure_pair(driver, args, "status_read",
                            Target("hello GET", Shot("GET", f"{hello}/hello", 200, auth), hello_proc.pid),
                            Target("status read", Shot("GET", url, 200, auth), front_proc.pid))
        b, v = pair.median_round()
        emit("status_read_throughput", v.rate, "req/s", b.rate)

    def floor() -> None:
        # What one Redis round trip costs a hello world served this way: the
        # floor under any read that must touch Redis (stderr and its own line).
        pair = measure_pair(driver, args, "floor",
                            Target("hello GET", Shot("GET", f"{hello}/hello", 200, auth), hello_proc.pid),
                            Target("hello + one Redis INCR", Shot("GET", f"{hello}/hello/redis", 200, auth),
                                   hello_proc.pid))
        b, v = pair.median_round()
        emit("one_redis_round_trip_throughput", v.rate, "req/s", b.rate)

    def submit() -> None:
        queue_key = keys.queue(entry.provider)
        before = client.zcard(queue_key)
        pair = measure_pair(
            driver, args, "submit",
            Target("hello POST", Shot("POST", f"{hello}/hello", 201, post_headers, SUBMIT_BODY), hello_proc.pid),
            Target("submit", Shot("POST", submit_url, 201, post_headers, SUBMIT_BODY), front_proc.pid))
        measured = sum(r.expected for r in pair.subject)
        grown = client.zcard(queue_key) - before
        # warm-up submits grew the index too; every measured 201 must be in it
        if grown < measured:
            raise MeasurementError(f"submit: {measured} answers were 201 but the queue index grew by only {grown}")
        log(f"submit: queue index grew by {grown} (measured 201s: {measured}, the rest from warm-up)")
        b, v = pair.median_round()
        emit("submit_throughput", v.rate, "req/s", b.rate)

    def replicated() -> None:
        # What REDIS_WAIT_REPLICAS=1 costs a submit: a second front door that WAITs for a
        # replica (started here, replicating the bench's private Redis) after each admission.
        if os.environ.get("REDIS_URL"):
            log("replicated: skipped: the bench attaches a replica only to its own private Redis")
            return
        primary = urlsplit(redis_url)
        _, replica_proc = start_redis(children, shutil.which("redis-server"), "redis-replica",
                                      ("--replicaof", primary.hostname, str(primary.port)))
        try:
            deadline = time.monotonic() + 30
            while client.info("replication").get("connected_slaves") != 1:
                if time.monotonic() > deadline:
                    raise MeasurementError("replicated: the replica did not connect within 30 s")
                time.sleep(0.1)
            waiting, waiting_proc = start_gunicorn(children, "frontdoor-wait", "router_queue.wsgi:app",
                                                   dict(env, REDIS_WAIT_REPLICAS="1"), args.workers)
            wait_http(f"{waiting}/healthz", waiting_proc)
            pair = measure_pair(
                driver, args, "replicated",
                Target("submit", Shot("POST", submit_url, 201, post_headers, SUBMIT_BODY), front_proc.pid),
                Target("submit, WAIT 1 replica", Shot("POST", f"{waiting}/v2/models/{MODEL_ID}/requests", 201,
                                                      post_headers, SUBMIT_BODY), waiting_proc.pid))
        finally:
            children.stop({"frontdoor-wait", "redis-replica"})
        b, v = pair.median_round()
        emit("submit_throughput_wait_1_replica", v.rate, "req/s", b.rate)

    def depth() -> None:
        # The waiting requests live in the schedule (rq:sched:{provider} and the keys under
        # it), several keys: each side gets its own Redis database and its own front door
        # (same gunicorn settings, same code), served a catalog copy capping the provider
        # at 1 with one claimed request holding that slot, so nothing is ever granted.
        # The two front doors' runs interleave as every pair does; nothing moves between runs.
        catalog_path = schedule.capped_catalog(tmp, {entry.provider: 1})
        sides = {}
        alone = {}
        try:
            for which, ahead, url in (("near", args.near, side_urls[0]), ("deep", args.depth, side_urls[1])):
                started = time.monotonic()
                side = schedule.services_for(url, catalog_path)
                side.redis.flushdb()
                workspace_id, request_id, position = schedule.seed_behind(side, entry, ahead, args.depth_workspaces,
                                                                          SUBMIT_BODY)
                spread = max(1, min(args.depth_workspaces, ahead))
                if which == "deep" and args.depth >= 100_000 and position <= 99_000:
                    raise MeasurementError(f"depth: the deep target sits at position {position}, not above 99,000")
                side_key = side.accounts.mint_key(workspace_id)
                log(f"depth: {which}: seeded {ahead} queued requests over {spread} workspace(s) ahead of "
                    f"{request_id} (position {position}: admit.lua, lib.lua's formula and the count agree) in "
                    f"{time.monotonic() - started:.1f} s")
                alone[which] = (side, request_id)
                side_env = dict(env, REDIS_URL=url, CATALOG_PATH=str(catalog_path))
                side_front, side_proc = start_gunicorn(children, f"frontdoor-{which}", "router_queue.wsgi:app",
                                                       side_env, args.workers)
                wait_http(f"{side_front}/healthz", side_proc)
                side_auth = {"X-API-Key": side_key}
                url_of_status = f"{side_front}/v2/models/{MODEL_ID}/requests/{request_id}/status"

                def enter(url_of_status=url_of_status, side_auth=side_auth, ahead=ahead) -> None:
                    code, body = http_json("GET", url_of_status, side_auth)
                    if code != 200 or body.get("queue_position") != ahead:
                        raise MeasurementError(f"depth: a status read answered {code} with queue_position="
                                               f"{body.get('queue_position')}, expected {ahead}")

                sides[which] = Target(f"behind {ahead}", Shot("GET", url_of_status, 200, side_auth),
                                      side_proc.pid, enter)
            pair = measure_pair(driver, argparse.Namespace(**{**vars(args), "rounds": args.depth_rounds}),
                                "depth", sides["near"], sides["deep"])
        finally:
            children.stop({"frontdoor-near", "frontdoor-deep"})
        # status.lua alone, no HTTP: the schedule's own share of a read (stderr only)
        script_us: dict[str, list[float]] = {"near": [], "deep": []}
        for _ in range(3):
            for which, (side, request_id) in alone.items():
                wall_us, used_us = schedule.time_status_reads(side, request_id, entry.provider)
                script_us[which].append(used_us)
                log(f"depth: status.lua alone behind {args.near if which == 'near' else args.depth} "
                    f"(RequestStore.status_view, no HTTP): {wall_us:.0f} us per round trip, {used_us:.1f} us "
                    "in the script (INFO commandstats)")
        log(f"depth: the script's own cost behind {args.depth} / behind {args.near}, per round: "
            + " ".join(f"{d / n:.3f}" for n, d in zip(script_us["near"], script_us["deep"])))
        near, deep = pair.median_round()
        near_ms = 1000.0 / near.rate
        deep_ms = 1000.0 / deep.rate
        emit(f"status_read_cost_behind_{label(args.depth)}", deep_ms, "ms", near_ms)

    phase("status_read", status_read)
    phase("floor", floor)
    phase("submit", submit)
    phase("replicated", replicated)
    phase("depth", depth)
    phase("hostile_body_ratio", lambda: hostile.measure(front, post_headers, args.hostile_rounds, emit, log,
                                                        MeasurementError))
    # last of the front-door phases: it leaves 10,000 requests waiting on bfl
    phase("history_paging", lambda: history.measure(services, front, args.history_requests, args.history_rounds,
                                                    emit, log, MeasurementError))
    for name, proc in (("front door", front_proc), ("hello world", hello_proc)):
        if proc.poll() is not None:
            log(f"ERROR: the {name} gunicorn exited with {proc.returncode} during the run")
            failures.append(name)
    children.stop({"frontdoor", "hello"})
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def _terminate(signum, _frame):
        raise KeyboardInterrupt

    # Ctrl-C, kill and a closed terminal all end in the same clean-up (SIGINT explicitly,
    # as a shell starting us in the background leaves it ignored)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    tmp = Path(tempfile.mkdtemp(prefix="router-queue-bench-"))
    children = Children(tmp)
    code = 1
    try:
        code = run(args, children, tmp)
    except KeyboardInterrupt:
        log("interrupted; stopping what was started")
        code = 130
    except (MeasurementError, RuntimeError, TimeoutError, OSError) as exc:
        log(f"ERROR: {exc}")
        code = 1
    except Exception:  # noqa: BLE001 - report, then still clean up
        import traceback

        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        children.stop_all()
        if args.keep_logs or code != 0:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
