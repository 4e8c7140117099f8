"""A RabbitMQ node of our own, for the tests that stop and kill the broker.

The machine's RabbitMQ (port 5672) serves every other test and is never
touched: this node has its own name, ports, data directory and
configuration. ``rabbitmq-server`` run as root drops to the ``rabbitmq``
user, so the node's directory is handed to that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router_queue.dev.stack import free_port, wait_for_port

from .redis_servers import wait_for

#: Seconds a node may take to start (about 6 s here, much more on a loaded machine).
START_S = 90


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class PrivateRabbitMQ:
    directory: Path
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    node: str = field(default_factory=lambda: f"rq{uuid.uuid4().hex[:8]}@localhost")
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _env(self) -> dict[str, str]:
        d = self.directory
        return {**os.environ, "RABBITMQ_NODENAME": self.node, "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"), "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"), "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "plugins"),
                "RABBITMQ_PID_FILE": str(d / "pid"), "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags")}

    def start(self) -> None:
        """Start the node (again, on the same data, after a kill) and wait for its AMQP port."""
        if shutil.which("rabbitmq-server") is None:
            pytest.fail("no rabbitmq-server binary on PATH (scripts/test installs it)")
        for sub in ("mnesia", "log"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        (self.directory / "plugins").write_text("[].\n")
        (self.directory / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        if os.getuid() == 0:
            try:
                user = pwd.getpwnam("rabbitmq")
            except KeyError:
                pass
            else:
                for path in [self.directory, *self.directory.rglob("*")]:
                    os.chown(path, user.pw_uid, user.pw_gid)
        log = open(self.directory / "server.log", "ab")
        try:
            self.proc = subprocess.Popen(["rabbitmq-server"], env=self._env(), stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        wait_for_port(self.port, proc=self.proc, timeout_s=START_S)

    def ctl(self, *args: str) -> None:
        subprocess.run(["rabbitmqctl", "-n", self.node, *args], env=self._env(), check=True,
                       capture_output=True, timeout=60)

    def stop_app(self) -> None:
        """The broker application stopped, the Erlang node up: connections closed, new ones refused."""
        self.ctl("stop_app")
        wait_for(lambda: not _port_open(self.port), timeout_s=30, what="the AMQP port closed")

    def start_app(self) -> None:
        self.ctl("start_app")
        wait_for(lambda: _port_open(self.port), timeout_s=START_S, what="the AMQP port open again")

    def kill(self) -> None:
        """SIGKILL the node: a crash. ``start`` brings it back on the same data."""
        pid = int((self.directory / "pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _port_open(self.port), timeout_s=30, what="the AMQP port closed")
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> None:
        try:
            self.ctl("stop")
        except (subprocess.SubprocessError, OSError):
            pid_file = self.directory / "pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
