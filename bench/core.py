"""What every phase shares: the one error, the BENCH line, child processes, HTTP helpers, the fleet,
the pinger, and the registry each phase module adds its phases to with ``@phase``."""

from __future__ import annotations

import http.client
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from router_queue.dev.stack import WEB_SERVING, Stack, free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "bfl/flux-2-pro"
#: The provider the fleet's catalog copy caps at 1 for the capped figures (no other fleet figure uses it).
CAPPED_PROVIDER, CAPPED_MODEL_ID, CAP = "vertexai", "vertexai/gemini-3.1-flash-image", 1
IN_PROGRESS, COMPLETED = "IN_PROGRESS", "COMPLETED"


class MeasurementError(RuntimeError):
    """A figure could not be measured (e.g. most answers had the wrong status)."""


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- the phase registry ---------------------------------------------------------------

#: The stages, in the order they run: the front door alone, the store alone, a fleet of its own, the shared fleet.
STAGES = ("front", "store", "own_fleet", "fleet")


@dataclass(frozen=True)
class Phase:
    name: str
    stage: str
    run: Callable[[Context], None]
    order: int  # position within the stage
    side_dbs: bool  # uses the two side databases (--side-dbs)


PHASES: dict[str, Phase] = {}


def phase(name: str, stage: str, order: int, *, side_dbs: bool = False):
    """Register the decorated ``fn(ctx)`` as phase ``name`` (``--only name``)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage}")

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        PHASES[name] = Phase(name, stage, fn, order, side_dbs)
        return fn

    return register


def ordered() -> list[Phase]:
    """Every registered phase in the order ``bench/run`` runs them."""
    return sorted(PHASES.values(), key=lambda p: (STAGES.index(p.stage), p.order))


@dataclass
class Context:
    """What a phase is handed; ``front`` or ``fleet`` is set while its stage runs."""

    args: Any
    children: Children
    tmp: Path
    redis_url: str
    side_urls: tuple[str, str]
    front: Any = None
    fleet: Fleet | None = None


#: Option (dest) -> (its lowest accepted value, whether that value itself is refused).
LIMITS: dict[str, tuple[float, bool]] = {}


def option(group, flag: str, default, help: str, *, minimum: float | None = 1, above: bool = False,
           **kwargs) -> None:
    """``--flag``, typed as ``default``; ``bench/run`` refuses a value under ``minimum`` (or at it, ``above``)."""
    kwargs.setdefault("type", type(default) if default is not None else int)
    if "(default" not in help:
        help += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
    action = group.add_argument(flag, default=default, help=help, **kwargs)
    if minimum is not None:
        LIMITS[action.dest] = (minimum, above)


def check_limits(parser, args) -> None:
    for dest, (low, above) in LIMITS.items():
        value = getattr(args, dest)
        if value is not None and (value <= low if above else value < low):
            parser.error(f"--{dest.replace('_', '-')} must be {'above' if above else 'at least'} {low:g}")


# -- figures and statistics -----------------------------------------------------------


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
    """The nearest-rank ``q`` quantile."""
    ordered_values = sorted(values)
    return ordered_values[min(len(ordered_values) - 1, max(0, round(q * (len(ordered_values) - 1))))]


def median_round(pairs: list[tuple[Any, Any]], key: Callable[[Any, Any], float]) -> tuple[Any, Any]:
    """The (baseline, subject) of the round with the median ``key(baseline, subject)`` (bench/README.md)."""
    return sorted(pairs, key=lambda bs: key(*bs))[(len(pairs) - 1) // 2]


def spread(values: list[float], unit: str = "ms", scale: float = 1.0) -> str:
    if not values:
        return "none"
    v = [x * scale for x in values]
    return (f"p50 {pct(v, 0.5):.3f} p90 {pct(v, 0.9):.3f} p99 {pct(v, 0.99):.3f} max {max(v):.3f} {unit} "
            f"(min {min(v):.3f}, mean {statistics.fmean(v):.3f}, n {len(v)})")


def redis_cpu(client) -> float:
    """Redis's CPU seconds so far (``INFO cpu``, user + sys)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def script_usec(client) -> int:
    """µs Redis has spent in Lua scripts so far (``INFO commandstats``)."""
    stats = client.info("commandstats")
    return sum(int(v.get("usec", 0)) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def schedule_counts(client, provider: str) -> dict[str, int]:
    """How many of ``provider``'s requests are queued, running, granted not started, and over how many workspaces."""
    from router_queue.store import keys

    pipe = client.pipeline(transaction=False)
    for key in (keys.queue(provider), keys.running(provider), f"{keys.schedule(provider)}:granted",
                keys.schedule_workspaces(provider)):
        pipe.zcard(key)
    return dict(zip(("queued", "running", "granted", "workspaces"), pipe.execute()))


def cpu_seconds(pid: int, precise: bool = False) -> float | None:
    """CPU of ``pid`` and its direct children (gunicorn master + workers): /proc stat's 10 ms ticks, or with
    ``precise`` every live thread's schedstat (ns); None when unreadable."""
    try:
        total = 0.0
        for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
            if not precise:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                continue
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    total += int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
                except FileNotFoundError:  # the thread ended since the listing
                    continue
        return total
    except (OSError, ValueError, IndexError):
        return None


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- child processes ------------------------------------------------------------------


def ensure_tool(binary: str, package: str) -> str | None:
    """The path of ``binary``, installing ``package`` with apt-get if missing; None if that fails."""
    path = shutil.which(binary)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if path is None and shutil.which("apt-get") and (not sudo or shutil.which("sudo")):
        log(f"installing {package} with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", package]):
            subprocess.run(sudo + argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        path = shutil.which(binary)
    return path


class Children:
    """The processes this run started, each in its own session, stopped by PID, newest first."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.after_stop: list[Callable[[], None]] = []  # run once every child stopped

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))
        log(f"started {name} (pid {proc.pid}), log {self.log_dir / (name + '.log')}")
        return proc

    def stop(self, names: set[str] | None = None, timeout_s: float = 15.0) -> None:
        """Stop the children named in ``names`` (all when None): SIGTERM, then SIGKILL after ``timeout_s``."""
        chosen = [(name, proc) for name, proc in reversed(self.procs) if names is None or name in names]
        for _, proc in chosen:
            if proc.poll() is None:
                _kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in chosen:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{name} (pid {proc.pid}) ignored SIGTERM; killing it")
                _kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = [child for child in self.procs if child not in chosen]

    def stop_all(self) -> None:
        self.stop()
        while self.after_stop:
            self.after_stop.pop()()


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start_redis(children: Children, binary: str, name: str = "redis", extra: tuple[str, ...] = ()) -> str:
    """A private, non-persistent redis-server on a free port (``extra``: e.g. ``--replicaof``); its URL."""
    port = free_port()
    proc = children.spawn(name, [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", str(children.log_dir), "--daemonize", "no", *extra], dict(os.environ))
    wait_for_port(port, timeout_s=30.0, proc=proc)
    return f"redis://127.0.0.1:{port}/0"


def start_gunicorn(children: Children, name: str, app: str, env: dict[str, str], workers: int,
                   serving: tuple[str, ...] = (*WEB_SERVING, "--graceful-timeout", "5", "--log-level", "warning"),
                   ) -> tuple[str, subprocess.Popen]:
    """``gunicorn app`` served as the Procfile serves the front door, on a free local port: (base URL, master)."""
    port = free_port()
    proc = children.spawn(name, [sys.executable, "-m", "gunicorn", "--workers", str(workers), *serving,
                                 "--bind", f"127.0.0.1:{port}", app], env)
    wait_for_port(port, timeout_s=30.0, proc=proc)
    return f"http://127.0.0.1:{port}", proc


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2,
               alive: Callable[[], None] | None = None) -> None:
    """Poll ``ready()`` (and ``alive()``) until it is true; ``what`` "within" ``timeout_s`` is the error after."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise MeasurementError(f"{what} within {timeout_s:g} s")
        time.sleep(interval_s)


# -- HTTP and Redis URLs --------------------------------------------------------------


def with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db``."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.netloc}{parts.path}?{urlencode({**dict(parse_qsl(parts.query)), 'db': str(db)})}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "db"])
    return urlunsplit(parts._replace(path=f"/{db}", query=query))


def flush_quietly(client, db: int) -> None:
    try:
        client.flushdb()
    except Exception as exc:  # noqa: BLE001 - best effort at the end
        log(f"could not flush database {db} at the end: {exc}")


def http_json(method: str, url: str, headers: dict[str, str], body: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=None if body is None else body.encode(), method=method,
                                     headers=headers)
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
    deadline, last = time.monotonic() + timeout_s, ""
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
        data = (response := self.conn.getresponse()).read()
        return (time.perf_counter() - started) * 1000, response.status, data

    def get_json(self, path: str) -> tuple[float, int, Any]:
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


def capped_catalog(directory: Path, caps: dict[str, int]) -> Path:
    """A copy of the catalog (``CATALOG_PATH``'s or the shipped one) with these providers' ``max_in_flight``."""
    source = Path(os.environ.get("CATALOG_PATH") or ROOT / "router_queue" / "catalog.json")
    catalog = json.loads(source.read_text())
    for provider, cap in caps.items():
        if provider not in catalog.get("providers", {}):
            raise MeasurementError(f"{provider} is not a provider of {source}")
        catalog["providers"][provider]["max_in_flight"] = int(cap)
    path = directory / ("catalog-" + "-".join(f"{p}{c}" for p, c in sorted(caps.items())) + ".json")
    path.write_text(json.dumps(catalog, indent=2))
    return path


def new_workspace(services, name: str, **limits) -> str:
    """A workspace with queued delivery on, credits and ``limits`` (default: out of reach of any run)."""
    workspace = services.accounts.create_workspace(name, queue_enabled=True, credits=10**12)
    services.accounts.set_limits(workspace, **(limits or {"max_queued": 10**9, "rate_limit": "10000000/second",
                                                          "max_queued_bytes": 10**12}))
    return workspace


# -- the fleet ------------------------------------------------------------------------


class BenchStack(Stack):
    """``router_queue.dev.stack.Stack`` whose children are the bench's (``Children``), names prefixed."""

    def __init__(self, env: dict[str, str], children: Children, log_prefix: str = ""):
        super().__init__(env, log_dir=children.log_dir)
        self.children, self.log_prefix = children, log_prefix

    def _spawn(self, name, argv):
        self.procs[name] = self.children.spawn(self.log_prefix + name, argv, self.env)
        return self.procs[name]


def add_fleet_arguments(parser) -> None:
    group = parser.add_argument_group("the fleet (every delivery phase)")
    option(group, "--fleet-workers", 2, "Celery worker processes")
    option(group, "--worker-threads", 256, "threads per Celery worker, --pool threads")
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
    log_prefix: str = ""  # of the children's names (their logs), for a phase's fleet of its own
    broker_url: str = ""  # Celery's broker when it is not the store (a store on a cluster needs one)

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
        self.workspace = new_workspace(self.services, "bench-fleet", max_queued=10**7, rate_limit="100000/second",
                                       max_held=10**6, max_queued_bytes=10**12)
        self.api_key = self.services.accounts.mint_key(self.workspace)
        self.stack = BenchStack(self.env, self.children, self.log_prefix)
        self.base = f"http://127.0.0.1:{self.web_port}"
        self.stub = f"http://127.0.0.1:{self.stub_port}"
        self.auth = {"X-API-Key": self.api_key}
        self.post_headers = {**self.auth, "Content-Type": "application/json"}

    def start(self) -> None:
        args = self.args
        self.stack.start_stub(self.stub_port)
        providers = self.services.catalog.providers()
        workers = [f"worker{number}" for number in range(1, args.fleet_workers + 1)]
        for name in workers:
            # the Celery app: production's plus the bench's ping (bench/worker_app.py)
            self.stack.start_worker(providers, name=name, pool="threads", concurrency=args.worker_threads,
                                    app="bench.worker_app")
        self.stack.start_beat()
        wait_http(f"{self.base}/healthz", self.stack.start_web(self.web_port, workers=args.web_workers))
        wait_until(lambda: all(" ready." in self._log(w).read_text(errors="replace") for w in workers), 90,
                   "the workers were not ready", alive=self.alive)
        started = time.monotonic()
        self.wait_records([self.submit(self.prompt("probe", 0))], (COMPLETED,), timeout_s=60, interval_s=0.05)
        log(f"fleet up: front door {self.base} ({args.web_workers} gevent workers), stub {self.stub}, "
            f"{args.fleet_workers} Celery workers x {args.worker_threads} threads, beat; "
            f"a probe request completed in {time.monotonic() - started:.2f} s")

    def stop(self) -> None:
        self.children.stop({self.log_prefix + name for name in self.stack.procs})

    def _log(self, name: str) -> Path:
        return self.children.log_dir / f"{self.log_prefix}{name}.log"

    def alive(self) -> None:
        if (dead := self.stack.exited()) is not None:
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
        code, answer = http_json("GET", f"{self.base}/v2/models/{MODEL_ID}/requests/{request_id}/status", self.auth)
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
        deadline, next_report = time.monotonic() + timeout_s, time.monotonic() + progress_s
        done: dict[str, dict[str, str | None]] = {}
        pending = list(ids)
        while True:
            rows = self.records(pending)
            done.update({i: row for i, row in rows.items() if row["status"] in wanted})
            if not (pending := [i for i in pending if i not in done]):
                return done
            if (now := time.monotonic()) > deadline:
                states = Counter(str(row["status"]) for row in rows.values())
                raise MeasurementError(f"{len(pending)} of {len(ids)} requests not {'/'.join(wanted)} within "
                                       f"{timeout_s:.0f} s (pending: {dict(states)})")
            if progress_s and now >= next_report:
                running = sum(1 for i in pending if rows[i]["status"] == IN_PROGRESS)
                log(f"  {len(done)}/{len(ids)} completed, {running} in progress, {len(pending) - running} in queue")
                next_report = now + progress_s
            self.alive()
            time.sleep(interval_s)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of every fleet child (gunicorn: master + workers), Redis and this process."""
        procs = [*self.stack.procs.items(), *((n, p) for n, p in self.children.procs if n == "redis")]
        out = {name: s for name, proc in procs if (s := cpu_seconds(proc.pid)) is not None}
        out["bench"] = own_cpu()
        return out


class Pinger:
    """The bare Celery round trip (baseline of the dispatch and grant-to-start figures):
    ``send_task(bench.ping, [reply_key])`` on the maintenance queue, then ``BLPOP reply_key``."""

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

    def sample(self, count: int) -> list[float]:
        """``count`` round trips, 50 ms apart (no sample starts while the last one winds down)."""
        samples = []
        for _ in range(count):
            time.sleep(0.05)
            samples.append(self())
        return samples

    def close(self) -> None:
        self.app.close()
