"""What every phase shares: the one error, the BENCH line, HTTP helpers, the fleet and the pinger,
and the registry each phase module adds its phases to with ``@phase``."""

from __future__ import annotations

import http.client
import json
import os
import resource
import statistics
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from router_queue.dev.stack import Stack

from .procs import ROOT, Children, cpu_seconds, free_port, log

MODEL_ID = "bfl/flux-2-pro"
#: The provider the fleet's catalog copy caps at 1 for the capped figures (no other fleet figure uses it).
CAPPED_PROVIDER, CAPPED_MODEL_ID, CAP = "vertexai", "vertexai/gemini-3.1-flash-image", 1
#: The Celery app the fleet's workers run: production's, plus the bench's ping.
WORKER_APP = "bench.worker_app"
IN_PROGRESS, COMPLETED = "IN_PROGRESS", "COMPLETED"


class MeasurementError(RuntimeError):
    """A figure could not be measured (e.g. most answers had the wrong status)."""


# -- the phase registry ---------------------------------------------------------------

#: When a phase runs, in this order: on the front door alone (no Celery worker), on the store
#: alone (Redis, no server), on a fleet of its own, then on the shared fleet (the whole stack).
STAGES = ("front", "store", "own_fleet", "fleet")


@dataclass(frozen=True)
class Phase:
    name: str
    stage: str
    run: Callable[["Context"], None]
    #: Position within the stage (phases of one stage live in several modules).
    order: int
    #: Uses the two side databases (``--side-dbs``).
    side_dbs: bool


PHASES: dict[str, Phase] = {}


def phase(name: str, stage: str, order: int, *, side_dbs: bool = False):
    """Register the decorated ``fn(ctx)`` as phase ``name`` (``--only name``)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage}")

    def register(fn: Callable[["Context"], None]) -> Callable[["Context"], None]:
        PHASES[name] = Phase(name, stage, fn, order, side_dbs)
        return fn

    return register


def ordered() -> list[Phase]:
    """Every registered phase in the order ``bench/run`` runs them."""
    return sorted(PHASES.values(), key=lambda p: (STAGES.index(p.stage), p.order))


@dataclass
class Context:
    """What a phase is handed: the arguments, the processes, the bench's Redis and, while their
    stage runs, the front door (bench/front.py) or the fleet."""

    args: Any
    children: Children
    tmp: Path
    redis_url: str
    side_urls: tuple[str, str]
    front: Any = None
    fleet: "Fleet | None" = None


#: Option (dest) -> (its lowest accepted value, whether that value itself is refused).
LIMITS: dict[str, tuple[float, bool]] = {}


def option(group, flag: str, default, help: str, *, minimum: float | None = 1, above: bool = False,
           **kwargs) -> None:
    """``--flag``, typed as ``default``; ``bench/run`` refuses a value under ``minimum`` (or at it, ``above``)."""
    kwargs.setdefault("type", type(default) if default is not None else int)
    action = group.add_argument(flag, default=default, help=help, **kwargs)
    if minimum is not None:
        LIMITS[action.dest] = (minimum, above)


def check_limits(parser, args) -> None:
    """``parser.error`` for the first option outside its limit."""
    for dest, (low, above) in LIMITS.items():
        value = getattr(args, dest)
        if value is not None and (value <= low if above else value < low):
            parser.error(f"--{dest.replace('_', '-')} must be {'above' if above else 'at least'} {low:g}")


# -- figures --------------------------------------------------------------------------


def label(count: int) -> str:
    """``100000`` -> ``100k``: the count in a figure's name."""
    return f"{count // 1000}k" if count >= 1000 and count % 1000 == 0 else str(count)


def fmt(value: float) -> str:
    if 0 < value < 0.1:
        return f"{value:.3g}"  # e.g. a few thousandths of a core: three significant digits
    return f"{value:.1f}" if value >= 100 else f"{value:.3f}" if value < 10 else f"{value:.2f}"


def emit(name: str, value: float, unit: str, baseline: float) -> None:
    """The one stdout line of a figure."""
    ratio = value / baseline if baseline else float("nan")
    print(f"BENCH {name} value={fmt(value)} {unit} baseline={fmt(baseline)} ratio={ratio:.3f}", flush=True)


def pct(values: list[float], q: float) -> float:
    ordered_values = sorted(values)
    return ordered_values[min(len(ordered_values) - 1, max(0, round(q * (len(ordered_values) - 1))))]


def median_round(pairs: list[tuple[Any, Any]], key: Callable[[Any, Any], float]) -> tuple[Any, Any]:
    """The (baseline, subject) of the round with the median ``key(baseline, subject)``: pairing runs
    seconds apart cancels a shared machine's slow drifts better than two separate medians, and keeps
    value/baseline exact."""
    return sorted(pairs, key=lambda bs: key(*bs))[(len(pairs) - 1) // 2]


def redis_cpu(client) -> float:
    """Redis's CPU seconds so far (``INFO cpu``, user + sys)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def script_usec(client) -> int:
    """µs Redis has spent in Lua scripts so far (``INFO commandstats``)."""
    stats = client.info("commandstats")
    return sum(int(v.get("usec", 0)) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    if not values:
        return "none"
    v = [x * scale for x in values]
    return f"p50 {pct(v, 0.5):.3f} p90 {pct(v, 0.9):.3f} max {max(v):.3f} {unit} (min {min(v):.3f}, n {len(v)})"


def summary(values_ms: list[float]) -> str:
    return (f"p50 {pct(values_ms, 0.5):.3f} p90 {pct(values_ms, 0.9):.3f} p99 {pct(values_ms, 0.99):.3f} "
            f"max {max(values_ms):.3f} ms (mean {statistics.fmean(values_ms):.3f}, n={len(values_ms)})")


# -- HTTP and Redis URLs --------------------------------------------------------------


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


def wait_http(url: str, proc, timeout_s: float = 60.0) -> None:
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


class KeepAlive:
    """One keep-alive HTTP/1.1 connection; each call timed to the answer's last byte."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0):
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        self.headers = headers or {}

    def call(self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
             ) -> tuple[float, int, bytes]:
        """(ms, status, answer bytes)."""
        started = time.perf_counter()
        self.conn.request(method, path, body=body, headers=headers or self.headers)
        response = self.conn.getresponse()
        data = response.read()
        return (time.perf_counter() - started) * 1000, response.status, data

    def get_json(self, path: str) -> tuple[float, int, Any]:
        """(ms, status, JSON body)."""
        ms, status, data = self.call("GET", path)
        return ms, status, json.loads(data)

    def close(self) -> None:
        self.conn.close()


def server_env(redis_url: str, **extra: str) -> dict[str, str]:
    """The environment of a server the bench starts: ours, minus what would point it elsewhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL", "PUBLIC_BASE_URL")}
    env.update(REDIS_URL=redis_url, TRUSTED_HOSTS="127.0.0.1,localhost",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)
    return env


def capped_catalog(directory: Path, caps: dict[str, int], source: str | Path | None = None) -> Path:
    """A copy of the catalog (``source``, else ``CATALOG_PATH``'s or the shipped one) whose providers in
    ``caps`` have that ``max_in_flight``; written in ``directory``, its path returned."""
    source = Path(source or os.environ.get("CATALOG_PATH") or ROOT / "router_queue" / "catalog.json")
    catalog = json.loads(source.read_text())
    for provider, cap in caps.items():
        if provider not in catalog.get("providers", {}):
            raise MeasurementError(f"{provider} is not a provider of {source}")
        catalog["providers"][provider]["max_in_flight"] = int(cap)
    name = "catalog-" + "-".join(f"{p}{c}" for p, c in sorted(caps.items())) + ".json"
    path = Path(directory) / name
    path.write_text(json.dumps(catalog, indent=2))
    return path


# -- the fleet ------------------------------------------------------------------------


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


def add_fleet_arguments(parser) -> None:
    group = parser.add_argument_group("the fleet (every delivery phase)")
    option(group, "--fleet-workers", 2, "Celery worker processes (default 2)")
    option(group, "--worker-threads", 256, "threads per Celery worker, --pool threads (default 256)")
    option(group, "--web-workers", 2,
           "gunicorn gevent workers of the stack's front door (default 2, as router-queue dev)")


@dataclass
class Fleet:
    """The whole stack (stub provider, Celery workers, beat, gunicorn), its workspace and key."""

    args: Any
    children: Children
    redis_url: str
    #: Providers capped in the fleet's catalog copy; ``{}``: the shipped caps.
    caps: dict[str, int] = field(default_factory=lambda: {CAPPED_PROVIDER: CAP})
    #: Prefix of the children's names (their logs) when a phase starts a fleet of its own.
    log_prefix: str = ""
    #: Celery's broker when it is not the store (a store on a cluster needs one).
    broker_url: str = ""

    def __post_init__(self) -> None:
        from router_queue.services import Services
        from router_queue.settings import Settings

        self.stub_port, self.web_port = free_port(), free_port()
        self.env = server_env(self.redis_url, PROVIDER_ORIGIN_OVERRIDE=f"http://127.0.0.1:{self.stub_port}",
                              BFL_API_KEY="stub", VERTEXAI_ACCESS_TOKEN="stub", OPENAI_API_KEY="stub",
                              DEFAULT_RATE_LIMIT="100000/second")
        if self.caps:
            self.env["CATALOG_PATH"] = str(capped_catalog(self.children.log_dir, self.caps))
        if self.broker_url:
            self.env["CELERY_BROKER_URL"] = self.broker_url
        self.settings = Settings.from_env(self.env)
        self.services = Services.build(self.settings)
        self.client = self.services.redis
        accounts = self.services.accounts
        self.workspace = accounts.create_workspace("bench-fleet", queue_enabled=True, credits=10**12)
        accounts.set_limits(self.workspace, max_queued=10**7, rate_limit="100000/second", max_held=10**6,
                            max_queued_bytes=10**12)
        self.api_key = accounts.mint_key(self.workspace)
        self.stack = BenchStack(self.env, self.children, self.log_prefix)
        self.base = f"http://127.0.0.1:{self.web_port}"
        self.stub = f"http://127.0.0.1:{self.stub_port}"
        self.submit_url = f"{self.base}/v2/models/{MODEL_ID}/requests"
        self.auth = {"X-API-Key": self.api_key}
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.workers: list[str] = []

    def start(self) -> None:
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

    def stop(self) -> None:
        self.children.stop({self.log_prefix + name for name in self.stack.procs})

    def _log(self, name: str) -> Path:
        return self.children.log_dir / f"{self.log_prefix}{name}.log"

    def _wait_workers_ready(self, timeout_s: float = 90.0) -> None:
        """Until every worker's log says ``ready`` (each consumes its queues)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.workers)
        while waiting:
            dead = self.stack.exited()
            if dead is not None:
                raise RuntimeError(f"{dead} exited while the fleet started; see {self._log(dead)}")
            waiting = [w for w in waiting if " ready." not in self._log(w).read_text(errors="replace")]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(waiting)} not ready within {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.2)

    def alive(self) -> None:
        dead = self.stack.exited()
        if dead is not None:
            raise MeasurementError(f"{dead} exited during the run; see {self._log(dead)}")

    @staticmethod
    def prompt(label: str, latency: float) -> str:
        """A prompt no other request sends (the stub keys its tasks on the body)."""
        return f"bench {label} {uuid.uuid4().hex} [stub:latency={latency:g}]"

    def submit(self, prompt: str) -> str:
        return self.submit_to(MODEL_ID, json.dumps({"prompt": prompt}))

    def submit_to(self, model_id: str, body: str) -> str:
        """Submit ``body`` to ``model_id``'s queued route; the request id."""
        code, answer = http_json("POST", f"{self.base}/v2/models/{model_id}/requests", self.post_headers, body)
        if code != 201 or "request_id" not in answer:
            raise MeasurementError(f"a submit to {model_id} answered {code}: {answer}")
        return answer["request_id"]

    def status(self, request_id: str) -> str:
        code, answer = http_json("GET", f"{self.submit_url}/{request_id}/status", self.auth)
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
        return {request_id: {f: (v.decode() if v is not None else None) for f, v in zip(fields, values)}
                for request_id, values in zip(ids, pipe.execute())}

    def wait_records(self, ids: list[str], wanted: tuple[str, ...], *, timeout_s: float, interval_s: float,
                     progress_s: float = 0.0) -> dict[str, dict[str, str | None]]:
        """Poll the records (pipelined) until every one's status is in ``wanted``."""
        deadline = time.monotonic() + timeout_s
        done: dict[str, dict[str, str | None]] = {}
        pending = list(ids)
        next_report = time.monotonic() + progress_s
        while True:
            rows = self.records(pending)
            done.update({i: row for i, row in rows.items() if row["status"] in wanted})
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
                log(f"  {len(done)}/{len(ids)} completed, {running} in progress, {len(pending) - running} in queue")
                next_report = now + progress_s
            self.alive()
            time.sleep(interval_s)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of every fleet child (gunicorn: master + workers), Redis and this process."""
        out = {name: s for name, proc in self.stack.procs.items() if (s := cpu_seconds(proc.pid)) is not None}
        for name, proc in self.children.procs:
            if name == "redis" and (seconds := cpu_seconds(proc.pid)) is not None:
                out["redis"] = seconds
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["bench"] = usage.ru_utime + usage.ru_stime
        return out


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

        from .worker_app import PING_TASK

        reply_key = f"bench:ping:{uuid.uuid4().hex}"
        began = time.perf_counter()
        self.app.send_task(PING_TASK, args=[reply_key], queue=MAINTENANCE_QUEUE)
        answer = self.client.blpop([reply_key], timeout=10)
        elapsed = time.perf_counter() - began
        if answer is None:
            raise MeasurementError(f"a ping got no answer within 10 s (no worker consumes {MAINTENANCE_QUEUE}?)")
        return elapsed

    def close(self) -> None:
        self.app.close()
