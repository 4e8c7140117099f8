"""Tools and child processes the bench starts; each child in its own session, remembered by PID,
and only those PIDs stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from router_queue.dev.stack import WEB_SERVING, free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


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
    """The processes this run started, by PID, stopped in reverse order."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        #: Run once every child has stopped (e.g. flushing a shared Redis database).
        self.after_stop: list = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        self.procs.append((name, proc))
        log(f"started {name} (pid {proc.pid}), log {self.log_dir / (name + '.log')}")
        return proc

    def stop(self, names: set[str] | None = None, timeout_s: float = 15.0) -> None:
        """Stop the children named in ``names`` (all when None), newest first, by PID."""
        chosen = [(name, proc) for name, proc in self.procs if names is None or name in names]
        for name, proc in reversed(chosen):
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for name, proc in reversed(chosen):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{name} (pid {proc.pid}) ignored SIGTERM; killing it")
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.procs = [(name, proc) for name, proc in self.procs if (name, proc) not in chosen]

    def stop_all(self, timeout_s: float = 15.0) -> None:
        self.stop(None, timeout_s)
        while self.after_stop:
            self.after_stop.pop()()


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU of ``pid`` and its direct children (gunicorn master + workers), from /proc."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0
        for p in [pid, *map(int, children)]:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def precise_cpu_seconds(pid: int) -> float | None:
    """CPU of ``pid`` and its direct children in ns resolution: the on-CPU time of every
    live thread, from /proc/<tid>/schedstat (the time /proc/<pid>/stat reports in 10 ms
    clock ticks, without threads that already exited); None when unreadable."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0
        for p in [pid, *map(int, children)]:
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    total += int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[0])
                except FileNotFoundError:  # the thread ended since the listing
                    continue
        return total / 1e9
    except (OSError, ValueError, IndexError):
        return None


def start_redis(children: Children, binary: str, name: str = "redis",
                extra: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """A private, non-persistent redis-server on a free port (``extra``: more
    arguments, a replica's ``--replicaof``); returns (URL, process)."""
    port = free_port()
    proc = children.spawn(name, [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(children.log_dir), "--daemonize", "no", *extra,
    ], dict(os.environ))
    wait_for_port(port, timeout_s=30.0, proc=proc)
    return f"redis://127.0.0.1:{port}/0", proc


def start_gunicorn(children: Children, name: str, app: str, env: dict[str, str],
                   workers: int) -> tuple[str, subprocess.Popen]:
    """``gunicorn app`` served as the Procfile serves the front door (gevent workers,
    long keep-alive) on a free local port; returns (base URL, master)."""
    port = free_port()
    proc = children.spawn(name, [
        sys.executable, "-m", "gunicorn", "--workers", str(workers), *WEB_SERVING,
        "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5", "--log-level", "warning", app,
    ], env)
    wait_for_port(port, timeout_s=30.0, proc=proc)
    return f"http://127.0.0.1:{port}", proc
