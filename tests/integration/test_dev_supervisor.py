"""``router-queue dev`` heals its fleet: a worker or beat that exits (a crash,
a broker connection lost the hard way) is started again, and work resumes
with no person involved."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from router_queue.dev.stack import ROOT, free_port

from .harness import FLUX, children, unique_prompt, wait_for

pytestmark = pytest.mark.slow

#: Seconds ``router-queue dev`` may take to print its walkthrough.
UP_S = 60.0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _child(dev: subprocess.Popen, needle: str) -> int | None:
    found = [pid for pid in children(dev.pid) if needle in _cmdline(pid)]
    return found[0] if found else None


def test_dev_starts_a_killed_worker_again_and_work_resumes() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    port, stub_port, ops_port = free_port(), free_port(), free_port()
    dev = subprocess.Popen(
        [sys.executable, "-c", "from router_queue.cli import main; main()", "dev", "--port", str(port),
         "--stub-port", str(stub_port), "--ops-port", str(ops_port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        key, redis_url, ops_page, deadline = None, None, None, time.monotonic() + UP_S
        while (key is None or redis_url is None) and time.monotonic() < deadline:
            line = dev.stdout.readline()
            assert line or dev.poll() is None, f"router-queue dev exited: {dev.stderr.read()[-2000:]}"
            if match := re.match(r"\s*ops page\s+(\S+)", line):
                ops_page = match.group(1)
            if match := re.match(r"export COMFY_API_KEY=(\S+)", line):
                key = match.group(1)
            if match := re.match(r"export REDIS_URL=(\S+)", line):
                redis_url = match.group(1)
        assert key, "router-queue dev printed no key"
        base = f"http://127.0.0.1:{port}"
        # The operator page where dev says it is, and not on the front door's port.
        assert ops_page == f"http://127.0.0.1:{ops_port}/ops", ops_page
        assert requests.get(ops_page, timeout=10).status_code == 200
        assert requests.get(f"{base}/ops", timeout=10).status_code == 404
        # The operator CLI, in another shell, reaches the embedded Redis it printed.
        depths = subprocess.run([sys.executable, "-c", "from router_queue.cli import main; main()", "ops", "depths"],
                                cwd=ROOT, env={**env, "REDIS_URL": redis_url}, capture_output=True, text=True,
                                timeout=30)
        assert depths.returncode == 0, depths.stderr
        assert {line.split("\t")[0] for line in depths.stdout.splitlines()[1:]} == {"bfl", "vertexai", "openai"}
        first = wait_for(lambda: _child(dev, " worker "), timeout_s=10, what="the dev worker")

        os.kill(first, signal.SIGKILL)
        killed_at = time.monotonic()
        second = wait_for(lambda: (pid := _child(dev, " worker ")) not in (None, first) and pid,
                          timeout_s=15, what="a new dev worker")
        assert dev.poll() is None

        submitted = requests.post(f"{base}/v2/models/{FLUX}/requests", headers={"X-API-Key": key},
                                  json={"prompt": unique_prompt("after the worker was killed")}, timeout=10)
        assert submitted.status_code == 201, submitted.text
        status_url = submitted.json()["status_url"]
        # a liveness bound, not a figure: the restarted worker boots (Celery, the
        # providers' modules) before it consumes, which took over 30 s on a loaded machine
        body = wait_for(lambda: (b := requests.get(status_url, headers={"X-API-Key": key}, timeout=10).json())
                        ["status"] == "COMPLETED" and b, timeout_s=90, what="the request completed")
        assert "error_type" not in body
        resumed_s = time.monotonic() - killed_at
        assert resumed_s < 90, resumed_s
        assert second != first
    finally:
        dev.send_signal(signal.SIGTERM)
        try:
            dev.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            dev.kill()
            dev.communicate()
