"""The Procfile: its commands, and (integration) each process started from a
clean environment against a real Redis: it answers or logs that it is ready,
passes the probe the manifests give it, and stops on SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis

from router_queue import metrics as process_metrics
from router_queue.broker.celery_app import MAINTENANCE_QUEUE, queue_name
from router_queue.dev.stack import WEB_SERVING, WEB_WORKER_CLASS, free_port, redis_answers
from router_queue.settings import Settings
from tests.deploy.deploy_support import (
    DEPLOY,
    PROVIDERS,
    ROOT,
    _container,
    _k8s_files,
    _option,
    _procfile,
    _shell_words,
    _worker_deployments,
)


def _metric_names_used() -> set[str]:
    text = "".join(p.read_text() for p in [*_k8s_files(), *(DEPLOY / "monitoring").glob("*.yaml"), DEPLOY / "README.md"])
    return set(re.findall(r"\brouter_queue_[a-z_]*[a-z]\b", text))


def test_procfile_commands() -> None:
    procfile = _procfile()
    assert {"web", "worker", "webhooks", "beat"} <= set(procfile)
    web = _shell_words(procfile["web"])
    assert web[0] == "gunicorn" and _option(web, "--worker-class") == WEB_WORKER_CLASS
    assert web[-1] == "router_queue.wsgi:app"
    sync_deadline = Settings().sync_deadline_s
    assert float(_option(web, "--graceful-timeout")) > sync_deadline
    assert float(_option(web, "--timeout")) > float(_option(web, "--graceful-timeout"))
    assert _option(web, "--bind") == "0.0.0.0:8000"
    # router-queue dev and the bench serve as the Procfile does; gunicorn's own
    # 414/431 would come before the app, so over-long ids and keys must reach it
    assert [_option(web, flag) for flag in WEB_SERVING[::2]] == list(WEB_SERVING[1::2])
    assert _option(_shell_words(procfile["web"], {"PORT": "5001"}), "--bind") == "0.0.0.0:5001"
    worker = _shell_words(procfile["worker"])
    assert worker[:4] == ["celery", "-A", "workers.main", "worker"]
    assert _option(worker, "--pool") == "threads"
    assert int(_option(worker, "--concurrency")) == 64
    assert {"--without-gossip", "--without-mingle"} <= set(worker)
    assert set(_option(worker, "--queues").split(",")) == {queue_name(p) for p in PROVIDERS} | {MAINTENANCE_QUEUE}
    assert _option(_shell_words(procfile["worker"], {"WORKER_QUEUES": "provider.bfl"}), "--queues") == "provider.bfl"
    beat = _shell_words(procfile["beat"], {"BEAT_SCHEDULE_FILE": "/x/schedule"})
    assert beat[:4] == ["celery", "-A", "workers.main", "beat"] and _option(beat, "--schedule") == "/x/schedule"


DEPLOY_TEST_REDIS_URL = os.environ.get("DEPLOY_TEST_REDIS_URL", "redis://127.0.0.1:6379/12")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """Db 12 of the Redis on 127.0.0.1:6379 (a private redis-server if none
    answers), flushed before and after."""
    url, server = DEPLOY_TEST_REDIS_URL, None
    if not redis_answers(url):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("no Redis answers and redis-server is not installed")
        port = free_port()
        server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/12"
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            assert time.monotonic() < deadline, "private redis-server did not start"
            time.sleep(0.1)
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
        if server is not None:
            server.terminate()
            server.wait(10)


@dataclass
class Process:
    """A Procfile process started through bash, its output collected by a thread."""

    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, env: dict[str, str]) -> "Process":
        command = _procfile()[name]
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        process = cls(name, proc)
        process.reader = threading.Thread(target=process._read, daemon=True)
        process.reader.start()
        return process

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.log()}")
            time.sleep(0.2)
        pytest.fail(f"{self.name}: no {what} within {timeout_s} s:\n{self.log()}")

    def logged(self, pattern: str) -> Callable[[], bool]:
        regex = re.compile(pattern)
        return lambda: any(regex.search(line) for line in list(self.lines))

    def stop(self, timeout_s: float = 20.0) -> bool:
        """SIGTERM, then SIGKILL (the process group it leads) after ``timeout_s``.
        True when it exited on SIGTERM alone."""
        graceful = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                graceful = False
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.reader is not None:
            self.reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return graceful


def _clean_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """PATH (this interpreter's scripts first), HOME, REDIS_URL: nothing else."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"PATH": path, "HOME": str(home), "REDIS_URL": redis_url, **extra}


@pytest.fixture
def started() -> Iterator[list[Process]]:
    processes: list[Process] = []
    yield processes
    for process in processes:
        process.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.integration
def test_procfile_web_answers_the_probes_and_serves_the_metrics_the_autoscalers_use(
        tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    port, ops_port = free_port(), free_port()
    web = Process.start("web", _clean_env(tmp_path, redis_url, PORT=str(port), OPS_PORT=str(ops_port),
                                          PUBLIC_BASE_URL="https://router.example.com"))
    started.append(web)
    base, ops = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}"

    def healthy() -> bool:
        try:
            return _get(f"{base}/healthz")[0] == 200
        except OSError:
            return False

    web.wait_for(healthy, 20, "200 from /healthz")
    assert any(f"Using worker: {WEB_WORKER_CLASS}" in line for line in web.lines), web.log()
    # the master gave its workers one metrics directory, and removes it when it stops
    (shared,) = [m.group(1) for m in map(re.compile(r"Counting the workers' metrics in (\S+)").search, web.lines) if m]
    assert Path(shared).is_dir()
    assert _get(f"{base}/readyz")[0] == 200, web.log()
    # The operator surfaces: on OPS_PORT (the Procfile's second bind) only.
    for path in ("/metrics", "/ops", "/ops/summary.json"):
        assert _get(f"{base}{path}")[0] == 404, path
        assert _get(f"{ops}{path}")[0] == 200, path
    status, metrics = _get(f"{ops}/metrics")
    assert status == 200
    # what the web serves, and the counters any process serves once it counted
    # them (a worker's on WORKER_METRICS_PORT; router_queue/metrics.py)
    families = set(re.findall(r"^# TYPE (\S+) ", metrics, flags=re.M)) | {
        family.name + ("_total" if family.type == "counter" else "") for family in process_metrics.REGISTRY.collect()}
    for provider in PROVIDERS:
        assert f'router_queue_depth{{provider="{provider}"}}' in metrics
        assert f'router_queue_in_flight{{provider="{provider}"}}' in metrics
    unknown = {name for name in _metric_names_used()
               if name not in families and re.sub(r"_(bucket|sum|count|created)$", "", name) not in families}
    assert not unknown, f"deploy/ refers to metrics no /metrics serves: {sorted(unknown)}"
    assert web.stop(), f"web did not stop on SIGTERM:\n{web.log()}"
    assert not Path(shared).exists()


@pytest.mark.integration
def test_procfile_web_refuses_to_start_without_a_public_origin(tmp_path: Path, redis_url: str,
                                                              started: list[Process]) -> None:
    """Neither PUBLIC_BASE_URL nor TRUSTED_HOSTS: gunicorn exits, and says which to set."""
    web = Process.start("web", _clean_env(tmp_path, redis_url, PORT=str(free_port()), OPS_PORT=str(free_port())))
    started.append(web)
    try:
        web.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"web started without PUBLIC_BASE_URL or TRUSTED_HOSTS:\n{web.log()}")
    assert web.proc.returncode != 0
    assert web.logged(r"PUBLIC_BASE_URL .* or TRUSTED_HOSTS .* must be set")(), web.log()


@pytest.mark.integration
def test_procfile_worker_gets_ready_and_passes_its_liveness_probe(
        tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    metrics_port = free_port()
    env = _clean_env(tmp_path, redis_url, WORKER_METRICS_PORT=str(metrics_port))
    worker = Process.start("worker", env)
    started.append(worker)
    worker.wait_for(worker.logged(r"\bready\b"), 30, '"ready" in the log')
    # its own counters, on WORKER_METRICS_PORT, for Prometheus to scrape pod by pod
    status, metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert status == 200, worker.log()
    assert 'router_queue_sweeper_actions_total{action="reaped"} 0.0' in metrics, metrics

    # The Kubernetes liveness probe, as the kubelet runs it (HOSTNAME is the pod's).
    probe = _container(_worker_deployments()["bfl"])["livenessProbe"]["exec"]["command"]
    probe_env = {**env, "HOSTNAME": socket.gethostname()}
    alive = subprocess.run(probe, cwd=ROOT, env=probe_env, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0, alive.stdout + alive.stderr + worker.log()

    assert worker.stop(), f"worker did not finish a warm shutdown on SIGTERM:\n{worker.log()}"
    assert worker.logged(r"[Ww]arm shutdown")(), worker.log()
    dead = subprocess.run(probe, cwd=ROOT, env=probe_env, capture_output=True, text=True, timeout=60)
    assert dead.returncode != 0, "the liveness probe passed with no worker running"


@pytest.mark.integration
def test_procfile_beat_starts(tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    schedule = tmp_path / "celerybeat-schedule"
    beat = Process.start("beat", _clean_env(tmp_path, redis_url, BEAT_SCHEDULE_FILE=str(schedule)))
    started.append(beat)
    beat.wait_for(beat.logged(r"beat: Starting"), 20, '"beat: Starting" in the log')
    beat.wait_for(lambda: any(tmp_path.glob("celerybeat-schedule*")), 20, "the schedule file from BEAT_SCHEDULE_FILE")
    assert beat.stop(), f"beat did not stop on SIGTERM:\n{beat.log()}"
