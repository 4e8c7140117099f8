"""Starting the whole stack on one machine: ``router-queue dev`` and the
integration tests both use ``Stack``.

The stack is real processes: gunicorn serving the front door, a Celery worker
consuming every provider queue, a Celery worker of its own delivering
webhooks (the Procfile's ``webhooks``), Celery beat running the sweeper, and
the stub providers. With no ``REDIS_URL`` set, ``dev`` serves an embedded
Redis-compatible server (fakeredis over TCP) from its own process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from ..broker.celery_app import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE, queue_name

ROOT = Path(__file__).resolve().parents[2]
#: gunicorn's limits on the request line and on one header field, as in the
#: Procfile: gunicorn's defaults (4094, 8190 bytes) answer an over-long id or
#: Idempotency-Key itself, in HTML, before the app can give its contract error.
#: 8190 is the most gunicorn allows for a request line.
REQUEST_LIMITS = ("--limit-request-line", "8190", "--limit-request-field_size", "16384")
#: The front door's gunicorn worker (gevent's; gunicorn's own refusals of bad
#: input in the contract's shape), as in the Procfile.
WEB_WORKER_CLASS = "router_queue.web.gunicorn_worker.GeventWorker"
#: How the Procfile serves the front door, as (option, value) pairs: its worker
#: class, greenlets per worker (10,000: an idle one costs a few KB, and idle or
#: slow connections, which the worker cuts after WEB_HEADER_TIMEOUT, must not
#: use them all up before it does), a keep-alive longer than clients' own idle
#: expiry (httpx: 5 s, so a client never reuses a connection the server is
#: closing at that instant) and the request limits. ``router-queue dev`` and
#: the bench serve the same way.
WEB_SERVING = ("--worker-class", WEB_WORKER_CLASS, "--worker-connections", "10000", "--keep-alive", "75",
               *REQUEST_LIMITS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_port() -> int:
    """A free port for a Redis Cluster node: at most 55535, its cluster bus
    port (10,000 above it) free too."""
    while True:
        port = free_port()
        if port <= 55535 and port_free(port + 10000):
            return port


def port_free(port: int) -> bool:
    """Whether this machine's loopback port is free to listen on: a readiness
    check by connecting would be answered by whatever holds it already."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_port(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s} s")


def redis_answers(url: str) -> bool:
    """Whether a Redis at ``url`` answers PING within half a second."""
    import redis

    from ..store.connect import connect

    client = connect(url, wait_s=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_embedded_redis(port: int) -> None:
    """A fakeredis server over TCP in a daemon thread of this process."""
    from fakeredis import TcpFakeServer

    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True).start()
    wait_for_port(port)


@dataclass
class Stack:
    """A set of child processes sharing one environment; stopped together."""

    env: dict[str, str]
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="router-queue-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    quiet: bool = True
    _argv: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One metrics directory for every child (router_queue/metrics.py): the
        # front door's /metrics then shows the workers' counters too, as one
        # machine's fleet. Not the parent's: it is a directory of this stack.
        directory = self.log_dir / "metrics"
        directory.mkdir(exist_ok=True)
        self.env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self._argv[name] = argv
        if not self.quiet:
            proc = subprocess.Popen(argv, env=self.env, cwd=ROOT)
        else:
            # the child keeps its own copy of the file; ours closes at once, so a
            # supervisor restarting a crash-looping child leaks nothing
            with open(self.log_dir / f"{name}.log", "ab") as out:
                proc = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_stub(self, port: int) -> subprocess.Popen:
        proc = self._spawn("stub", [sys.executable, "-m", "stub_provider", "--host", "127.0.0.1", "--port", str(port)])
        wait_for_port(port, proc=proc)
        return proc

    def start_web(self, port: int, workers: int = 2, ops_port: int | None = None) -> subprocess.Popen:
        """gunicorn as the Procfile runs it (:data:`WEB_SERVING`): gevent workers,
        so held synchronous calls cost a greenlet each rather than a whole worker;
        with ``ops_port``, the operator listener too (the environment's
        ``OPS_PORT`` must name the same port for the app to serve it there)."""
        binds = ["--bind", f"127.0.0.1:{port}"] + (["--bind", f"127.0.0.1:{ops_port}"] if ops_port else [])
        proc = self._spawn("web", [
            sys.executable, "-m", "gunicorn", "--workers", str(workers), *WEB_SERVING, "--timeout", "660",
            *binds, "--access-logfile", "-", "router_queue.wsgi:app",
        ])
        wait_for_port(port, proc=proc)
        return proc

    def start_worker(self, providers: list[str], name: str = "worker", pool: str = "threads",
                     concurrency: int = 8, app: str = "workers.main") -> subprocess.Popen:
        """A Celery worker consuming ``providers``' queues and the maintenance
        queue (never the webhooks': :meth:`start_webhooks`); ``app`` is the
        Celery app module (the bench adds a task of its own)."""
        queues = ",".join([queue_name(p) for p in providers] + [MAINTENANCE_QUEUE])
        return self._spawn_worker(name, queues, pool, concurrency, app)

    def start_webhooks(self, name: str = "webhooks", pool: str = "threads", concurrency: int = 32) -> subprocess.Popen:
        """The webhooks worker, as the Procfile's ``webhooks``: ``router.webhooks``
        only, on threads of its own, so a slow receiver never holds a provider's."""
        return self._spawn_worker(name, WEBHOOKS_QUEUE, pool, concurrency, "workers.main")

    def _spawn_worker(self, name: str, queues: str, pool: str, concurrency: int, app: str) -> subprocess.Popen:
        return self._spawn(name, [
            sys.executable, "-m", "celery", "-A", app, "worker", "--queues", queues,
            "--pool", pool, "--concurrency", str(concurrency), "--loglevel", "INFO",
            "--hostname", f"{name}-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
        ])

    def start_beat(self) -> subprocess.Popen:
        return self._spawn("beat", [
            sys.executable, "-m", "celery", "-A", "workers.main", "beat", "--loglevel", "INFO",
            "--schedule", str(self.log_dir / "celerybeat-schedule"),
        ])

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart(self, name: str) -> subprocess.Popen:
        """Start ``name`` again as it was first started (its log goes on)."""
        return self._spawn(name, self._argv[name])

    def exited(self) -> str | None:
        """The name of a child that exited, if any did."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name
        return None


#: The cURL walkthrough's steps, as the README's "Walkthrough (cURL)" has them
#: (a test holds the two equal). The prompt asks the stub for a 20 s generation,
#: so the poll, the 202 collect and the 202 cancel can all be seen by hand.
CURL_STEPS = """\
BASE="$COMFY_ROUTER_BASE_URL/v2/models/bfl/flux-2-pro"

# 1. Submit. 201 with request_id, status_url, response_url and cancel_url (printed), and
#    REQUEST_ID set from it. [stub:latency=20] asks the stub for a 20 s generation.
REQUEST_ID=$(curl -sS "$BASE/requests" \\
  -H "X-API-Key: $COMFY_API_KEY" \\
  -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\
  -H "Content-Type: application/json" \\
  -d '{"prompt": "a red teapot on a windowsill, morning light [stub:latency=20]"}' \\
  | tee /dev/stderr | python3 -c 'import json, sys; print(json.load(sys.stdin)["request_id"])')

# 2. Poll until COMPLETED, waiting the Retry-After each answer names (a finished one names 0).
curl -i "$BASE/requests/$REQUEST_ID/status" -H "X-API-Key: $COMFY_API_KEY"

# 3. Collect: 202 with the status body while it runs; 200 with the model's native output once done.
curl -i "$BASE/requests/$REQUEST_ID" -H "X-API-Key: $COMFY_API_KEY"

# 4. Cancel: 202 CANCELLATION_REQUESTED within its 20 s, 409 ALREADY_COMPLETED after.
curl -i -X PUT "$BASE/requests/$REQUEST_ID/cancel" -H "X-API-Key: $COMFY_API_KEY"
"""

WALKTHROUGH = """
router-queue is up.
  front door   {base}
  stub         {stub}   (stands in for bfl, vertexai, openai)
  redis        {redis}
  objects      {objects}   (results over RESULT_INLINE_MAX_BYTES)
  workspace    {workspace}   (the demo workspace, for the workspace and key commands)
  logs         {logs}

The operator listener (not the front door's port; see docs/OPERATIONS.md, "Operating it"):
  ops page     {ops}/ops
  metrics      {ops}/metrics

export COMFY_API_KEY={key}
export COMFY_ROUTER_BASE_URL={base}
{steps}
The operator commands reach this stack's Redis (and its webhook secrets' key) with:
export REDIS_URL={redis}
export WEBHOOK_SECRETS_KEY={secrets_key}
export WORKSPACE_ID={workspace}
router-queue ops depths
router-queue workspace webhook-secret "$WORKSPACE_ID"   # before a submit names a webhook

Ctrl-C stops everything.
"""


#: Children ``router-queue dev`` starts again when they exit (a worker or beat
#: that died with its broker connection); the web and the stub exiting is fatal.
RESTARTED = ("worker", "webhooks", "beat")
#: Seconds before a child is started again, doubling while it keeps exiting
#: within a minute of its start, up to the last.
RESTART_BACKOFF_S = (1.0, 30.0)


def _supervise(stack: Stack) -> None:
    """Keep the stack running: restart what may be restarted, fail on the rest."""
    started: dict[str, float] = {}
    delay: dict[str, float] = {}
    while True:
        name = stack.exited()
        if name is None:
            time.sleep(0.5)
            continue
        code = stack.procs[name].returncode
        if name not in RESTARTED:
            raise click.ClickException(f"{name} exited ({code}); see {stack.log_dir}/{name}.log")
        quick = time.monotonic() - started.get(name, 0.0) < 60
        delay[name] = min(delay.get(name, RESTART_BACKOFF_S[0] / 2) * 2, RESTART_BACKOFF_S[1]) if quick \
            else RESTART_BACKOFF_S[0]
        click.echo(f"{name} exited ({code}); starting it again in {delay[name]:.0f} s "
                   f"(see {stack.log_dir}/{name}.log)", err=True)
        time.sleep(delay[name])
        stack.restart(name)
        started[name] = time.monotonic()


#: Where ``dev`` keeps the webhook secrets' key it made for a Redis of yours
#: (``REDIS_URL`` set), so the next run opens the secrets this one sealed.
DEV_KEY_FILE = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") \
    / "router-queue" / "webhook-secrets.key"


def dev_secrets_key(*, embedded: bool) -> str:
    """A ``WEBHOOK_SECRETS_KEY`` for a run that was given none: a new one for
    the embedded Redis (its data lives as long as the run), else the one in
    :data:`DEV_KEY_FILE`, made there (mode 0600) the first time."""
    from cryptography.fernet import Fernet

    if embedded:
        return Fernet.generate_key().decode()
    if not DEV_KEY_FILE.exists():
        DEV_KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(DEV_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(Fernet.generate_key().decode())
    return DEV_KEY_FILE.read_text().strip()


@click.command("dev")
@click.option("--port", type=int, default=8000, show_default=True, help="Front door port.")
@click.option("--stub-port", type=int, default=8300, show_default=True, help="Stub provider port.")
@click.option("--ops-port", type=int, default=8900, show_default=True,
              help="Operator listener port (/ops, /metrics).")
def dev(port: int, stub_port: int, ops_port: int) -> None:
    """Run the front door, a worker, the webhooks worker, beat and the stub providers, and seed a demo key."""
    from ..catalog import Catalog
    from ..services import Services
    from ..settings import DEFAULT_CATALOG, Settings

    for option, wanted in (("--port", port), ("--stub-port", stub_port), ("--ops-port", ops_port)):
        if not port_free(wanted):
            raise click.ClickException(f"port {wanted} on 127.0.0.1 is already in use; pass {option} N "
                                       "with a free one")

    env = dict(os.environ)
    embedded = "REDIS_URL" not in env
    if embedded:
        redis_port = free_port()
        start_embedded_redis(redis_port)
        env["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    if "OBJECT_STORE_URL" not in env:  # big results in a directory of this run (set it empty: all in Redis)
        env["OBJECT_STORE_URL"] = f"file://{tempfile.mkdtemp(prefix='router-queue-objects-')}"
    env.setdefault("PROVIDER_ORIGIN_OVERRIDE", f"http://127.0.0.1:{stub_port}")
    env.setdefault("WEBHOOK_ALLOW_LOOPBACK_HTTP", "1")  # a receiver of your own on this machine
    if not env.get("WEBHOOK_SECRETS_KEY"):
        env["WEBHOOK_SECRETS_KEY"] = dev_secrets_key(embedded=embedded)
    if not env.get("PUBLIC_BASE_URL"):
        env.setdefault("TRUSTED_HOSTS", "127.0.0.1,localhost")  # absolute URLs on the origin you call
    env["OPS_PORT"] = str(ops_port)
    for name in Catalog.credential_variables(env.get("CATALOG_PATH") or DEFAULT_CATALOG):
        env.setdefault(name, "stub-key")  # the stub takes any key, for every provider the catalog names
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    settings = Settings.from_env(env)
    services = Services.build(settings)
    workspace_id = services.accounts.create_workspace("demo", queue_enabled=True, credits=1_000_000)
    api_key = services.accounts.mint_key(workspace_id)

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    stack = Stack(env)
    try:
        stack.start_stub(stub_port)
        stack.start_worker(services.catalog.providers())
        stack.start_webhooks()
        stack.start_beat()
        stack.start_web(port, ops_port=ops_port)
        click.echo(WALKTHROUGH.format(base=f"http://127.0.0.1:{port}", stub=f"http://127.0.0.1:{stub_port}",
                                      ops=f"http://127.0.0.1:{ops_port}", workspace=workspace_id,
                                      redis=env["REDIS_URL"], logs=stack.log_dir, key=api_key,
                                      secrets_key=env["WEBHOOK_SECRETS_KEY"],
                                      objects=env["OBJECT_STORE_URL"] or "none: every result stays in Redis",
                                      steps=CURL_STEPS))
        _supervise(stack)
    except KeyboardInterrupt:
        click.echo("stopping")
    finally:
        stack.stop()
