"""``router-queue dev`` fails fast, and says why, when it cannot serve."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from router_queue.dev.stack import ROOT, free_port


@pytest.mark.parametrize("option", ["--port", "--stub-port"])
def test_a_busy_port_is_named_and_dev_exits_non_zero_at_once(option: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        other = "--stub-port" if option == "--port" else "--port"
        done = subprocess.run([sys.executable, "-c", "from router_queue.cli import main; main()", "dev", option,
                               str(port), other, str(free_port())], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"port {port} on 127.0.0.1 is already in use; pass {option} N" in done.stderr
    assert "router-queue is up" not in done.stdout
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 30
