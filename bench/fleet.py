"""The delivery figures: the whole stack, measured end to end.

``router_queue.dev.stack.Stack`` starts the stub provider, Celery workers (thread
pool), beat and gunicorn, here as bench children (own session, stopped by PID
with everything else). Three figures:

* ``inflight_<n>_completion``: seconds from the first of ``n`` submits of a
  ``[stub:latency=L]`` generation until the last of them is COMPLETED, against
  the same for one generation alone.
* ``dispatch_latency``: ms from admission (``created_at``) to claim
  (``started_at``) of one request on an idle fleet, median of sequential
  submits, against the median bare Celery round trip (``bench.worker_app.ping``:
  publish -> run -> RPUSH -> BLPOP), the two interleaved.
* ``sync_held_status_p50`` / ``_p99`` (bench/sync_held.py): status-read latency
  while 200 synchronous calls are held open, against the same reads without them.
* ``grant_to_start_latency`` and ``waiting_cpu_<n>`` (bench/capped.py): behind
  vertexai's cap, which the fleet's catalog copy lowers to 1 (no other fleet
  figure uses vertexai): ms from one generation's end to the next one's start,
  against the bare Celery round trip; the workers' and beat's CPU while ``n``
  requests wait, against the same fleet idle.
* ``full_cycle_*`` and ``redis_*_per_delivery`` (bench/full_cycle.py, first, on a fleet of its
  own with the shipped caps): 32 clients looping submit -> poll -> collect on the fleet and
  on a minimal loop from the bare parts (bench/minimal_loop.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from router_queue.dev.stack import Stack

from . import capped, full_cycle, schedule, streams, sync_held
from .procs import ROOT, Children, cpu_seconds, free_port, log
from .worker_app import PING_TASK

#: The Celery app the fleet's workers run: production's, plus the bench's ping.
WORKER_APP = "bench.worker_app"

MODEL_ID = "bfl/flux-2-pro"
#: Phases measured on the whole stack (``--only``).
PHASES = ("inflight", "dispatch", "sync_held", "streams", "grant_to_start", "waiting_cpu", "full_cycle")
IN_PROGRESS, COMPLETED = "IN_PROGRESS", "COMPLETED"


class MeasurementError(RuntimeError):
    """A figure could not be measured (re-raised as bench.main's own by the caller)."""


class BenchStack(Stack):
    """``router_queue.dev.stack.Stack`` whose children are the bench's: own session, logged, stopped by PID."""

    def __init__(self, env: dict[str, str], children: Children, log_prefix: str = ""):
        super().__init__(env, log_dir=children.log_dir)
        self.children = children
        #: Prefix of the children's names (their logs) when a phase starts a fleet of its own.
        self.log_prefix = log_prefix

    def _spawn(self, name, argv):
        proc = self.children.spawn(self.log_prefix + name, argv, self.env)
        self.procs[name] = proc
        return proc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("delivery figures (inflight, dispatch, sync_held)")
    group.add_argument("--inflight", type=int, default=500,
                       help="generations submitted at once for the in-flight figure (default 500)")
    group.add_argument("--latency", type=float, default=5.0,
                       help="stub generation time in seconds, [stub:latency=...] (default 5)")
    group.add_argument("--submitters", type=int, default=32,
                       help="concurrent HTTP submitters for the in-flight burst (default 32)")
    group.add_argument("--inflight-rounds", type=int, default=1,
                       help="(one alone, n at once) rounds; the median-ratio round is reported (default 1)")
    group.add_argument("--inflight-timeout", type=float, default=300.0,
                       help="seconds the n generations may take before the figure fails (default 300)")
    group.add_argument("--fleet-workers", type=int, default=2, help="Celery worker processes (default 2)")
    group.add_argument("--worker-threads", type=int, default=256,
                       help="threads per Celery worker, --pool threads (default 256)")
    group.add_argument("--web-workers", type=int, default=2,
                       help="gunicorn gevent workers of the stack's front door (default 2, as router-queue dev)")
    group.add_argument("--samples", type=int, default=50,
                       help="dispatch samples (and as many pings), interleaved (default 50)")
    sync_held.add_arguments(group)
    streams.add_arguments(group)
    capped.add_arguments(group)
    full_cycle.add_arguments(parser.add_argument_group("full cycle against a minimal loop (full_cycle)"))


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.inflight, args.submitters, args.inflight_rounds, args.fleet_workers, args.worker_threads,
           args.web_workers, args.samples) < 1:
        parser.error("inflight, submitters, inflight-rounds, fleet-workers, worker-threads, web-workers "
                     "and samples must be at least 1")
    sync_held.check_arguments(parser, args)
    streams.check_arguments(parser, args)
    capped.check_arguments(parser, args)
    full_cycle.check_arguments(parser, args)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    if not values:
        return "none"
    v = [x * scale for x in values]
    return (f"p50 {_pct(v, 0.5):.3f} p90 {_pct(v, 0.9):.3f} max {max(v):.3f} {unit} "
            f"(min {min(v):.3f})")


class Fleet:
    """The started stack, its workspace and key, and what the figures need to reach them."""

    def __init__(self, args: argparse.Namespace, children: Children, redis_url: str, http_json, *,
                 caps: dict[str, int] | None = None, log_prefix: str = ""):
        from router_queue.services import Services
        from router_queue.settings import Settings

        self.args = args
        self.children = children
        self.http_json = http_json
        self.stub_port, self.web_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL", "PUBLIC_BASE_URL")}
        env.update({
            "REDIS_URL": redis_url,
            "PROVIDER_ORIGIN_OVERRIDE": f"http://127.0.0.1:{self.stub_port}",
            "BFL_API_KEY": "stub",
            "VERTEXAI_ACCESS_TOKEN": "stub",
            "OPENAI_API_KEY": "stub",
            "DEFAULT_RATE_LIMIT": "100000/second",
            "TRUSTED_HOSTS": "127.0.0.1,localhost",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        })
        # vertexai capped at 1 for the capped figures (bench/capped.py); no other figure uses it
        # but full_cycle, which starts a fleet of its own with the shipped caps (caps={})
        caps = {capped.PROVIDER: capped.CAP} if caps is None else caps
        if caps:
            env["CATALOG_PATH"] = str(schedule.capped_catalog(children.log_dir, caps))
        self.env = env
        self.settings = Settings.from_env(env)
        self.services = Services.build(self.settings)
        self.client = self.services.redis
        accounts = self.services.accounts
        self.workspace = accounts.create_workspace("bench-fleet", queue_enabled=True, credits=10**12)
        accounts.set_limits(self.workspace, max_queued=10**7, rate_limit="100000/second", max_held=10**6,
                            max_queued_bytes=10**12)
        self.api_key = accounts.mint_key(self.workspace)
        self.log_prefix = log_prefix
        self.stack = BenchStack(env, children, log_prefix)
        self.base = f"http://127.0.0.1:{self.web_port}"
        self.stub = f"http://127.0.0.1:{self.stub_port}"
        self.submit_url = f"{self.base}/v2/models/{MODEL_ID}/requests"
        self.auth = {"X-API-Key": self.api_key}
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.workers: list[str] = []

    # -- starting ---------------------------------------------------------------

    def start(self, wait_http) -> None:
        args = self.args
        self.stack.start_stub(self.stub_port)
        providers = self.services.catalog.providers()
        for number in range(1, args.fleet_workers + 1):
            name = f"worker{number}"
            self.stack.start_worker(providers, name=name, pool="threads", concurrency=args.worker_threads,
                                    app=WORKER_APP)
            self.workers.append(name)
        self.stack.start_beat()
        web = self.stack.start_web(self.web_port, workers=args.web_workers)
        wait_http(f"{self.base}/healthz", web)
        self._wait_workers_ready()
        started = time.monotonic()
        request_id = self.submit(self.prompt("probe", 0))
        self.wait_records([request_id], (COMPLETED,), timeout_s=60, interval_s=0.05)
        log(f"fleet up: front door {self.base} ({args.web_workers} gevent workers), stub {self.stub}, "
            f"{args.fleet_workers} Celery workers x {args.worker_threads} threads, beat; "
            f"a probe request completed in {time.monotonic() - started:.2f} s")

    def _wait_workers_ready(self, timeout_s: float = 90.0) -> None:
        """Until every worker's log says ``ready`` (each consumes its queues)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.workers)
        while waiting:
            dead = self.stack.exited()
            if dead is not None:
                raise RuntimeError(f"{dead} exited while the fleet started; see "
                                   f"{self.children.log_dir}/{self.log_prefix}{dead}.log")
            waiting = [w for w in waiting
                       if " ready." not in (self.children.log_dir / f"{self.log_prefix}{w}.log")
                       .read_text(errors="replace")]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(waiting)} not ready within {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.2)

    def alive(self) -> None:
        dead = self.stack.exited()
        if dead is not None:
            raise MeasurementError(f"{dead} exited during the run; see "
                                   f"{self.children.log_dir}/{self.log_prefix}{dead}.log")

    # -- requests ------------------------------------------------------------------

    @staticmethod
    def prompt(label: str, latency: float) -> str:
        """A prompt no other request sends (the stub keys its tasks on the body)."""
        return f"bench {label} {uuid.uuid4().hex} [stub:latency={latency:g}]"

    def submit(self, prompt: str) -> str:
        body = json.dumps({"prompt": prompt})
        code, answer = self.http_json("POST", self.submit_url, self.post_headers, body)
        if code != 201 or "request_id" not in answer:
            raise MeasurementError(f"a submit answered {code}: {answer}")
        return answer["request_id"]

    def submit_to(self, model_id: str, body: str) -> str:
        """Submit ``body`` to ``model_id``'s queued route; the request id."""
        code, answer = self.http_json("POST", f"{self.base}/v2/models/{model_id}/requests", self.post_headers, body)
        if code != 201 or "request_id" not in answer:
            raise MeasurementError(f"a submit to {model_id} answered {code}: {answer}")
        return answer["request_id"]

    def status(self, request_id: str) -> str:
        code, answer = self.http_json("GET", f"{self.submit_url}/{request_id}/status", self.auth)
        if code != 200:
            raise MeasurementError(f"a status read answered {code}: {answer}")
        return answer.get("status", "")

    def records(self, ids: list[str]) -> dict[str, dict[str, str | None]]:
        """status, created_at, started_at, completed_at, error_type of each id, one round trip."""
        from router_queue.store import keys

        fields = ("status", "created_at", "started_at", "completed_at", "error_type")
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), fields)
        out = {}
        for request_id, values in zip(ids, pipe.execute()):
            out[request_id] = {f: (v.decode() if v is not None else None) for f, v in zip(fields, values)}
        return out

    def wait_records(self, ids: list[str], wanted: tuple[str, ...], *, timeout_s: float, interval_s: float,
                     progress_s: float = 0.0) -> dict[str, dict[str, str | None]]:
        """Poll the records (pipelined) until every one's status is in ``wanted``."""
        deadline = time.monotonic() + timeout_s
        done: dict[str, dict[str, str | None]] = {}
        pending = list(ids)
        next_report = time.monotonic() + progress_s
        while True:
            rows = self.records(pending)
            for request_id, row in rows.items():
                if row["status"] in wanted:
                    done[request_id] = row
            pending = [i for i in pending if i not in done]
            if not pending:
                return done
            now = time.monotonic()
            if now > deadline:
                states: dict[str, int] = {}
                for row in rows.values():
                    states[str(row["status"])] = states.get(str(row["status"]), 0) + 1
                raise MeasurementError(f"{len(pending)} of {len(ids)} requests not {'/'.join(wanted)} within "
                                       f"{timeout_s:.0f} s (pending: {states})")
            if progress_s and now >= next_report:
                running = sum(1 for i in pending if rows[i]["status"] == IN_PROGRESS)
                log(f"  {len(done)}/{len(ids)} completed, {running} in progress, "
                    f"{len(pending) - running} in queue")
                next_report = now + progress_s
            self.alive()
            time.sleep(interval_s)

    def stub_calls(self) -> dict[str, int]:
        code, answer = self.http_json("GET", f"{self.stub}/stub/calls", {})
        return answer.get("total", {}) if code == 200 else {}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of every fleet child (gunicorn: master + workers), and this process."""
        out = {}
        for name, proc in self.stack.procs.items():
            seconds = cpu_seconds(proc.pid)
            if seconds is not None:
                out[name] = seconds
        for name, proc in self.children.procs:
            if name == "redis" and (seconds := cpu_seconds(proc.pid)) is not None:
                out["redis"] = seconds
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["bench"] = usage.ru_utime + usage.ru_stime
        return out

    def redis_commands(self) -> int:
        return int(self.client.info("stats").get("total_commands_processed", 0))


# -- inflight ---------------------------------------------------------------------


def one_alone(fleet: Fleet, latency: float) -> float:
    """Seconds from submit to COMPLETED of one generation, the status read over HTTP every 0.1 s.

    Returns the record's ``completed_at`` minus the submit time (what the 0.1 s polling
    observed is logged): the same clock the n-at-once figure reads.
    """
    began = time.time()
    request_id = fleet.submit(fleet.prompt("alone", latency))
    deadline = time.monotonic() + latency + 120
    while fleet.status(request_id) != COMPLETED:
        if time.monotonic() > deadline:
            raise MeasurementError(f"the lone generation {request_id} did not complete")
        fleet.alive()
        time.sleep(0.1)
    seen = time.time() - began
    row = fleet.records([request_id])[request_id]
    if row["error_type"]:
        raise MeasurementError(f"the lone generation completed with {row['error_type']}")
    value = float(row["completed_at"]) - began
    log(f"inflight: one alone completed {value:.3f} s after its submit (seen by 0.1 s polling at "
        f"{seen:.3f} s; admitted->claimed {float(row['started_at']) - float(row['created_at']):.3f} s, "
        f"claimed->completed {float(row['completed_at']) - float(row['started_at']):.3f} s)")
    return value


def many_at_once(fleet: Fleet, count: int, latency: float) -> float:
    """Seconds from the first of ``count`` submits until the last of them is COMPLETED."""
    args = fleet.args
    lock = threading.Lock()
    ids: list[str] = []
    prompts = [fleet.prompt(f"inflight{i}", latency) for i in range(count)]
    calls_before, cpu_before, commands_before = fleet.stub_calls(), fleet.cpu(), fleet.redis_commands()

    def one(prompt: str) -> None:
        request_id = fleet.submit(prompt)
        with lock:
            ids.append(request_id)

    began = time.time()
    wall_began = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.submitters, thread_name_prefix="submit") as pool:
        for future in [pool.submit(one, p) for p in prompts]:
            future.result()
    submitted_s = time.time() - began
    log(f"inflight: {count} submits ({args.submitters} concurrent) took {submitted_s:.2f} s "
        f"({count / submitted_s:.0f}/s)")
    rows = fleet.wait_records(ids, (COMPLETED,), timeout_s=args.inflight_timeout, interval_s=0.5, progress_s=2.0)
    seen_s = time.monotonic() - wall_began
    cpu_after, calls_after, commands_after = fleet.cpu(), fleet.stub_calls(), fleet.redis_commands()

    failed: dict[str, int] = {}
    for row in rows.values():
        if row["error_type"]:
            failed[row["error_type"]] = failed.get(row["error_type"], 0) + 1
    if failed:
        raise MeasurementError(f"inflight: of {count} generations, some completed with errors: {failed}")
    created = [float(r["created_at"]) for r in rows.values()]
    started = [float(r["started_at"]) for r in rows.values()]
    completed = [float(r["completed_at"]) for r in rows.values()]
    value = max(completed) - began

    # where the time went, for reading the figure (stderr only)
    log(f"inflight: last of {count} completed {value:.3f} s after the first submit "
        f"(seen by 0.5 s record polling at {seen_s:.2f} s)")
    log(f"  admitted, after the first submit: {_spread([c - began for c in created])}")
    log(f"  admitted -> claimed: {_spread([s - c for s, c in zip(started, created)])}")
    log(f"  claimed -> completed: {_spread([d - s for d, s in zip(completed, started)])} "
        f"(the stub's generation takes {latency:g} s)")
    # the most generations running at one moment, from the records' own times
    events = sorted([(s, 1) for s in started] + [(d, -1) for d in completed])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    log(f"  most generations claimed at once: {peak}")
    polls = calls_after.get("bfl_poll", 0) - calls_before.get("bfl_poll", 0)
    submits = calls_after.get("bfl_submit", 0) - calls_before.get("bfl_submit", 0)
    log(f"  stub calls: {submits} submits, {polls} polls ({polls / count:.1f} per generation)")
    wall = time.monotonic() - wall_began
    used = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    total = sum(used.values())
    cores = os.cpu_count() or 1
    log(f"  CPU s over {wall:.1f} s wall ({cores} cores = {cores * wall:.1f} CPU s): "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(used.items(), key=lambda kv: -kv[1]))
        + f"; total {total:.1f}")
    log(f"  Redis commands: {commands_after - commands_before} "
        f"({(commands_after - commands_before) / count:.0f} per generation, bench polling included)")
    return value


def measure_inflight(fleet: Fleet, emit) -> None:
    args = fleet.args
    rounds = []
    for round_no in range(1, args.inflight_rounds + 1):
        alone = one_alone(fleet, args.latency)
        many = many_at_once(fleet, args.inflight, args.latency)
        rounds.append((alone, many))
        log(f"inflight round {round_no}/{args.inflight_rounds}: one alone {alone:.3f} s; "
            f"{args.inflight} at once {many:.3f} s; ratio {many / alone:.3f}")
    rounds.sort(key=lambda am: am[1] / am[0])
    alone, many = rounds[(len(rounds) - 1) // 2]
    emit(f"inflight_{args.inflight}_completion", many, "s", alone)


# -- dispatch ---------------------------------------------------------------------


class Pinger:
    """The bare Celery round trip: ``send_task(bench.worker_app.ping, [reply_key])`` on the
    maintenance queue, then ``BLPOP reply_key``, timed around both; the baseline of the
    dispatch and grant-to-start figures."""

    def __init__(self, fleet: Fleet):
        from router_queue.broker.celery_app import make_celery

        self.app = make_celery(fleet.settings)
        self.client = fleet.client

    def __call__(self) -> float:
        """One round trip, in seconds."""
        from router_queue.broker.celery_app import MAINTENANCE_QUEUE

        reply_key = f"bench:ping:{uuid.uuid4().hex}"
        began = time.perf_counter()
        self.app.send_task(PING_TASK, args=[reply_key], queue=MAINTENANCE_QUEUE)
        answer = self.client.blpop([reply_key], timeout=10)
        elapsed = time.perf_counter() - began
        if answer is None:
            raise MeasurementError("a ping got no answer within 10 s (no worker consumes "
                                   f"{MAINTENANCE_QUEUE}?)")
        return elapsed

    def close(self) -> None:
        self.app.close()


def measure_dispatch(fleet: Fleet, emit) -> None:
    """Admitted -> claimed of sequential submits vs publish -> run -> answer of a ping, interleaved."""
    args = fleet.args
    ping = Pinger(fleet)

    def dispatch() -> tuple[float, float]:
        """(admitted -> claimed, HTTP submit) in seconds; waits for COMPLETED so the fleet is idle again."""
        began = time.perf_counter()
        request_id = fleet.submit(fleet.prompt("dispatch", 0))
        submit_s = time.perf_counter() - began
        row = fleet.wait_records([request_id], (COMPLETED,), timeout_s=30, interval_s=0.005)[request_id]
        if row["error_type"] or not row["started_at"]:
            raise MeasurementError(f"dispatch: request {request_id} completed with {row['error_type']} "
                                   f"(started_at {row['started_at']})")
        return float(row["started_at"]) - float(row["created_at"]), submit_s

    warm = 5
    log(f"dispatch: warm-up ({warm} pings, {warm} submits)")
    try:
        for _ in range(warm):
            ping()
            dispatch()
        pings, claims, submits = [], [], []
        for _ in range(args.samples):
            time.sleep(0.05)  # idle between samples: no sample starts while the last one winds down
            pings.append(ping())
            time.sleep(0.05)
            claim_s, submit_s = dispatch()
            claims.append(claim_s)
            submits.append(submit_s)
    finally:
        ping.close()
    log(f"dispatch: ping round trip {_spread(pings, 'ms', 1000)}")
    log(f"dispatch: admitted -> claimed {_spread(claims, 'ms', 1000)}")
    log(f"dispatch: HTTP submit (answered 201) {_spread(submits, 'ms', 1000)}")
    emit("dispatch_latency", 1000 * statistics.median(claims), "ms", 1000 * statistics.median(pings))


# -- the phase ----------------------------------------------------------------------


def measure(args: argparse.Namespace, children: Children, redis_url: str, *, http_json, wait_http, emit,
            error_type: type[Exception], with_db=None) -> list[str]:
    """Start the fleet, measure the selected delivery figures; the names of those that failed."""
    failures = []
    if "full_cycle" in args.only:
        # first, on a fleet of its own (the shipped catalog's caps), stopped before the next one
        try:
            full_cycle.measure(
                args, children, redis_url, with_db=with_db, wait_http=wait_http, emit=emit,
                make_fleet=lambda: Fleet(args, children, redis_url, http_json, caps={}, log_prefix="cycle-"))
        except (MeasurementError, full_cycle.MeasurementError, error_type) as exc:
            log(f"ERROR: {exc}")
            failures.append("full_cycle")
        # what the phase left (records, its workspace) must not reach the next fleet
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        if not args.only & (set(PHASES) - {"full_cycle"}):
            return failures
    fleet = Fleet(args, children, redis_url, http_json)
    fleet.start(wait_http)
    # sync_held near the end: its held generations occupy the workers' threads while they run;
    # waiting_cpu last: it leaves vertexai's one slot held by a long generation
    for name, fn in (("dispatch", measure_dispatch), ("grant_to_start", capped.measure_grant_to_start),
                     ("inflight", measure_inflight), ("sync_held", sync_held.measure), ("streams", streams.measure),
                     ("waiting_cpu", capped.measure_waiting_cpu)):
        if name not in args.only:
            continue
        try:
            fn(fleet, emit)
        except (MeasurementError, sync_held.MeasurementError, capped.MeasurementError, schedule.MeasurementError,
                error_type) as exc:
            log(f"ERROR: {exc}")
            failures.append(name)
    dead = fleet.stack.exited()
    if dead is not None:
        log(f"ERROR: {dead} exited during the run; see {Path(children.log_dir) / (dead + '.log')}")
        failures.append(dead)
    return failures
