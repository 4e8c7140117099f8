"""What every phase shares: the one error, the phase registry, the BENCH line and its statistics, child
processes, HTTP helpers, the fleet and the pinger (bench/README.md)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple
from urllib.parse import urlsplit

import requests

from router_queue.broker.celery_app import MAINTENANCE_QUEUE, make_celery
from router_queue.dev.stack import WEB_SERVING, Stack, free_port, wait_for_port
from router_queue.services import Services
from router_queue.settings import Settings
from router_queue.store import keys

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "bfl/flux-2-pro"
#: The provider the fleet's catalog copy caps at 1 (no other fleet figure uses it).
CAPPED_PROVIDER, CAPPED_MODEL_ID, CAP = "vertexai", "vertexai/gemini-3.1-flash-image", 1
IN_PROGRESS, COMPLETED = "IN_PROGRESS", "COMPLETED"
#: The stages, in the order they run (bench/README.md).
STAGES = ("front", "store", "own_fleet", "objects", "fleet")
#: The bench Redis's databases holding the two sides of the depth and dispatch_cost figures.
SIDE_DBS = (12, 13)
#: gunicorn workers of every app served: the Procfile's default WEB_CONCURRENCY.
WEB_WORKERS = 2


class MeasurementError(RuntimeError):
    """A figure could not be measured (e.g. most answers had the wrong status)."""


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class Phase(NamedTuple):
    name: str
    stage: str
    order: int  # within the stage
    run: Callable[[Context], None]


PHASES: dict[str, Phase] = {}


def phase(name: str, stage: str, order: int):
    """Register the decorated ``fn(ctx)`` as phase ``name`` (``--only name``), ``order`` within ``stage``."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        PHASES[name] = Phase(name, stage, order, fn)
        return fn

    return register


def ordered() -> list[Phase]:
    """Every registered phase in the order ``bench/run`` runs them."""
    return sorted(PHASES.values(), key=lambda p: (STAGES.index(p.stage), p.order))


@dataclass
class Context:
    """What a phase is handed; ``front`` or ``fleet`` is set while its stage runs."""

    children: Children
    tmp: Path
    redis_url: str  # database 0 of the bench's private redis-server
    front: Any = None  # a front.FrontDoor
    fleet: Any = None  # a Fleet
    objects: Any = None  # an objects.ObjectStore, while the objects stage runs

    def db_url(self, db: int) -> str:
        return f"{self.redis_url.rsplit('/', 1)[0]}/{db}"


def fmt(v: float) -> str:
    return f"{v:.3g}" if 0 < v < 0.1 else f"{v:.1f}" if v >= 100 else f"{v:.3f}" if v < 10 else f"{v:.2f}"


def emit(name: str, value: float, unit: str, baseline: float) -> None:
    """The one stdout line of a figure."""
    ratio = value / baseline if baseline else float("nan")
    print(f"BENCH {name} value={fmt(value)} {unit} baseline={fmt(baseline)} ratio={ratio:.3f}", flush=True)


def pct(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1)."""
    return sorted(values)[round(q * (len(values) - 1))]


def median_round(name: str, pairs: list[tuple[Any, Any]], key: Callable[[Any, Any], float] = lambda b, s: s / b
                 ) -> tuple[Any, Any]:
    """The (baseline, subject) of the round with the median ``key(baseline, subject)``; logs every round's."""
    log(f"{name}: per-round ratios " + " ".join(f"{key(*pair):.3f}" for pair in pairs) + " (the median is reported)")
    return sorted(pairs, key=lambda pair: key(*pair))[(len(pairs) - 1) // 2]


def redis_cpu(client) -> float:
    """Redis's CPU seconds so far (``INFO cpu``, user + sys)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def schedule_counts(client, provider: str) -> dict[str, int]:
    """How many of ``provider``'s requests are queued, running, and granted but not started."""
    pipe = client.pipeline(transaction=False)
    for key in (keys.queue(provider), keys.running(provider), f"{keys.schedule(provider)}:granted"):
        pipe.zcard(key)
    return dict(zip(("queued", "running", "granted"), pipe.execute()))


def cpu_seconds(pids: list[int]) -> float:
    """CPU s of ``pids`` and their direct children: their live threads' schedstat (finer than stat's ticks)."""
    total = 0.0
    for pid in pids:
        for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    total += int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
                except FileNotFoundError:  # the thread ended since the listing
                    pass
    return total


def cores_used(pids: list[int], window_s: float) -> float:
    """The cores ``pids`` (``cpu_seconds``) used over the next ``window_s`` seconds."""
    began, before = time.monotonic(), cpu_seconds(pids)
    time.sleep(window_s)
    return (cpu_seconds(pids) - before) / (time.monotonic() - began)


def tool(binary: str) -> str:
    """The path of ``binary``; the run stops if it is missing."""
    if (path := shutil.which(binary)) is None:
        raise SystemExit(f"bench: {binary} is missing (apt-get install -y wrk redis-server installs all it needs)")
    return path


class Children:
    """The processes this run started, each in its own session, stopped by PID, newest first."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(argv, env=env or dict(os.environ), cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))
        log(f"started {name} (pid {proc.pid})")
        return proc

    def stop(self, first: int = 0, timeout_s: float = 15.0) -> None:
        """Stop the children started since the ``first``-th: SIGTERM, then SIGKILL after ``timeout_s``."""
        chosen = self.procs[first:][::-1]
        for _, proc in chosen:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for name, proc in chosen:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{name} (pid {proc.pid}) ignored SIGTERM; killing it")
                proc.kill()
                proc.wait()
        del self.procs[first:]

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Every child started inside the block is stopped on leaving it."""
        first = len(self.procs)
        try:
            yield
        finally:
            self.stop(first)

    def alive(self, prefix: str = "") -> None:
        """Raise if a child whose name starts with ``prefix`` has exited."""
        for name, proc in self.procs:
            if name.startswith(prefix) and proc.poll() is not None:
                raise MeasurementError(f"{name} exited during the run; see {self.log_dir / name}.log")


def start_redis(children: Children, name: str = "redis", *extra: str, port: int = 0) -> str:
    """A private, non-persistent redis-server on ``port`` (default: a free one), ``extra`` its options; its URL."""
    port = port or free_port()
    proc = children.spawn(name, [tool("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(children.log_dir), "--dbfilename", f"{name}.rdb",
                                 *extra])
    wait_for_port(port, timeout_s=30.0, proc=proc)
    return f"redis://127.0.0.1:{port}/0"


def start_gunicorn(children: Children, name: str, app: str, env: dict[str, str], workers: int,
                   serving: tuple[str, ...] = (*WEB_SERVING, "--graceful-timeout", "5", "--log-level", "warning"),
                   ) -> str:
    """``gunicorn app`` served as the Procfile serves the front door; its URL once it answers ``/healthz``."""
    port = free_port()
    proc = children.spawn(name, [sys.executable, "-m", "gunicorn", "--workers", str(workers), *serving,
                                 "--bind", f"127.0.0.1:{port}", app], env)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc)
    return f"http://127.0.0.1:{port}"


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str | Callable[[], str], interval_s: float = 0.2,
               alive: Callable[[], None] | None = None) -> None:
    """Poll ``ready()`` (and ``alive()``) until it is true; ``what`` "within" ``timeout_s`` is the error after."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise MeasurementError(f"{what() if callable(what) else what} within {timeout_s:g} s")
        time.sleep(interval_s)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until ``url`` answers 200 (gunicorn workers import the app after the bind)."""

    def answers() -> bool:
        if proc.poll() is not None:
            raise MeasurementError(f"pid {proc.pid} exited with {proc.returncode} while booting {url}")
        try:
            return requests.get(url, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    wait_until(answers, timeout_s, f"{url} did not answer 200")


def http_json(method: str, url: str, headers: dict[str, str], body: str | None = None, status: int = 200) -> dict:
    """The JSON answer of a call (a connection of its own) that must answer ``status``."""
    answer = requests.request(method, url, headers=headers, data=None if body is None else body.encode(), timeout=10)
    if answer.status_code != status:
        raise MeasurementError(f"{method} {url} answered {answer.status_code}, not {status}: {answer.content[:300]!r}")
    return json.loads(answer.content or b"{}")


class KeepAlive:
    """One keep-alive HTTP/1.1 connection; each call timed to the answer's last byte."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0):
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(str(parts.hostname), parts.port, timeout=timeout_s)
        self.headers = headers or {}

    def call(self, method: str, path: str, status: int | None = None, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[float, int, bytes]:
        """(ms, status, answer bytes) of a call that must answer ``status`` if given."""
        started = time.perf_counter()
        self.conn.request(method, path, body=body, headers=headers or self.headers)
        data = (response := self.conn.getresponse()).read()
        ms = (time.perf_counter() - started) * 1000
        if status is not None and response.status != status:
            raise MeasurementError(f"{method} {path} answered {response.status}, not {status}: {data[:200]!r}")
        return ms, response.status, data

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
        catalog["providers"][provider]["max_in_flight"] = cap
    path = directory / ("catalog-" + "-".join(f"{p}{c}" for p, c in sorted(caps.items())) + ".json")
    path.write_text(json.dumps(catalog, indent=2))
    return path


def services_for(redis_url: str, catalog_path: Path | None = None, env: dict[str, str] | None = None):
    """``Services`` of ``env`` (default: none) on ``redis_url``, with the catalog at ``catalog_path`` if given."""
    catalog = {"CATALOG_PATH": str(catalog_path)} if catalog_path else {}
    return Services.build(Settings.from_env({**(env or {}), "REDIS_URL": redis_url, **catalog}))


def new_workspace(services, name: str, **limits) -> str:
    """A workspace with queued delivery on, credits and ``limits`` (default: out of reach of any run)."""
    workspace = services.accounts.create_workspace(name, queue_enabled=True, credits=10**12)
    services.accounts.set_limits(workspace, **(limits or {"max_queued": 10**9, "rate_limit": "10000000/second",
                                                          "max_queued_bytes": 10**12}))
    return workspace


class BenchStack(Stack):
    """``router_queue.dev.stack.Stack`` whose children are the bench's (``Children``), names prefixed."""

    def __init__(self, env: dict[str, str], children: Children, log_prefix: str):
        super().__init__(env, log_dir=children.log_dir)
        self.children, self.log_prefix = children, log_prefix

    def _spawn(self, name, argv):
        self.procs[name] = self.children.spawn(self.log_prefix + name, argv, self.env)
        return self.procs[name]


@dataclass
class Fleet:
    """The whole stack (stub provider, Celery workers, beat, gunicorn), its workspace and key."""

    children: Children
    redis_url: str
    #: Providers capped in the fleet's catalog copy; ``{}``: the shipped caps.
    caps: dict[str, int] = field(default_factory=lambda: {CAPPED_PROVIDER: CAP})
    log_prefix: str = ""  # of the children's names (their logs), for a phase's fleet of its own
    broker_url: str = ""  # Celery's broker when it is not the store (a store on a cluster needs one)
    extra_env: dict[str, str] = field(default_factory=dict)  # of every child (e.g. OBJECT_STORE_URL)

    def __post_init__(self) -> None:
        self.stub_port, self.web_port = free_port(), free_port()
        self.env = server_env(self.redis_url, PROVIDER_ORIGIN_OVERRIDE=f"http://127.0.0.1:{self.stub_port}",
                              BFL_API_KEY="stub", VERTEXAI_ACCESS_TOKEN="stub", OPENAI_API_KEY="stub",
                              DEFAULT_RATE_LIMIT="100000/second")
        if self.caps:
            self.env["CATALOG_PATH"] = str(capped_catalog(self.children.log_dir, self.caps))
        if self.broker_url:
            self.env["CELERY_BROKER_URL"] = self.broker_url
        self.env.update(self.extra_env)
        self.services = services_for(self.redis_url, env=self.env)
        self.client = self.services.redis
        self.workspace = new_workspace(self.services, "bench-fleet", max_queued=10**7, rate_limit="100000/second",
                                       max_held=10**6, max_queued_bytes=10**12)
        self.api_key = self.services.accounts.mint_key(self.workspace)
        self.stack = BenchStack(self.env, self.children, self.log_prefix)
        self.base, self.stub = f"http://127.0.0.1:{self.web_port}", f"http://127.0.0.1:{self.stub_port}"
        self.auth = {"X-API-Key": self.api_key}
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.celery: Any = None  # the Celery app of ping(), made at its first call

    def start(self) -> Fleet:
        self.stack.start_stub(self.stub_port)
        workers = ["worker1", "worker2"]
        for name in workers:  # production's Celery app plus the bench's ping (bench/worker_app.py)
            self.stack.start_worker(self.services.catalog.providers(), name=name, pool="threads", concurrency=256,
                                    app="bench.worker_app")
        self.stack.start_beat()
        wait_http(f"{self.base}/healthz", self.stack.start_web(self.web_port, workers=WEB_WORKERS))
        logs = [self.children.log_dir / f"{self.log_prefix}{name}.log" for name in workers]
        wait_until(lambda: all(" ready." in log.read_text(errors="replace") for log in logs), 90,
                   "the workers were not ready", alive=self.alive)
        probe = self.submit(json.dumps({"prompt": self.prompt("probe", 0)}))
        self.wait_records([probe], timeout_s=60)
        log(f"fleet up at {self.base}: a probe request completed")
        return self

    def alive(self) -> None:
        self.children.alive(self.log_prefix)

    def pids(self, *names: str) -> list[int]:
        """The PIDs of the children whose names start with one of ``names``."""
        return [proc.pid for name, proc in self.stack.procs.items() if name.startswith(names)]

    @staticmethod
    def prompt(label: str, latency: float) -> str:
        """A prompt no other request sends (the stub keys its tasks on the body)."""
        return f"bench {label} {uuid.uuid4().hex} [stub:latency={latency:g}]"

    def submit(self, body: str, model_id: str = MODEL_ID, headers: dict[str, str] | None = None) -> str:
        """Submit ``body`` to ``model_id``'s queued route; the request id."""
        url = f"{self.base}/v2/models/{model_id}/requests"
        return http_json("POST", url, headers or self.post_headers, body, 201)["request_id"]

    def submit_all(self, bodies: list[str], model_id: str, threads: int) -> list[str]:
        """Submit ``bodies`` to ``model_id`` from ``threads`` threads; their ids, in order."""
        with ThreadPoolExecutor(threads, thread_name_prefix="submit") as pool:
            return list(pool.map(lambda body: self.submit(body, model_id), bodies))

    def records(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """status, created_at, started_at, completed_at, error_type of each id, one round trip."""
        fields = ("status", "created_at", "started_at", "completed_at", "error_type")
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), fields)
        return {request_id: {f: (v.decode() if v is not None else None) for f, v in zip(fields, values)}
                for request_id, values in zip(ids, pipe.execute())}

    def wait_records(self, ids: list[str], wanted: str = COMPLETED, timeout_s: float = 30.0,
                     interval_s: float = 0.05) -> dict[str, dict[str, Any]]:
        """Poll the records until every one is ``wanted``; a COMPLETED one must have started, without error."""
        done: dict[str, dict[str, Any]] = {}

        def all_done() -> bool:
            rows = self.records([i for i in ids if i not in done])
            done.update({i: row for i, row in rows.items() if row["status"] == wanted})
            return len(done) == len(ids)

        wait_until(all_done, timeout_s, lambda: f"{len(ids) - len(done)} of {len(ids)} requests not {wanted}",
                   interval_s, self.alive)
        if wanted == COMPLETED and (failed := {i: r["error_type"] for i, r in done.items()
                                               if r["error_type"] or not r["started_at"]}):
            raise MeasurementError(f"some generations failed: {dict(list(failed.items())[:3])}")
        return done

    def ping(self, count: int) -> list[float]:
        """s of ``count`` bare Celery round trips, 50 ms apart: ``send_task(bench.ping, [reply_key])``, ``BLPOP``."""
        self.celery = self.celery or make_celery(self.services.settings)
        samples = []
        for _ in range(count):
            time.sleep(0.05)  # no round trip starts while the last one winds down
            reply_key = f"bench:ping:{uuid.uuid4().hex}"
            began = time.perf_counter()
            self.celery.send_task("bench.ping", args=[reply_key], queue=MAINTENANCE_QUEUE)
            if self.client.blpop([reply_key], timeout=10) is None:
                raise MeasurementError(f"a ping got no answer within 10 s (no worker consumes {MAINTENANCE_QUEUE}?)")
            samples.append(time.perf_counter() - began)
        return samples
