"""A real S3-compatible server of the tests' own: moto's standalone server, in
a subprocess on a free loopback port (not an in-process mock), with one bucket.

:func:`s3_env` is the environment that points obstore (and any AWS client) at
it: the standard ``AWS_*`` variables, as a deployment would set them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import boto3

from router_queue.dev.stack import free_port, wait_for_port

from .redis_servers import terminate

#: The bucket each server starts with.
BUCKET = "rq-test-results"


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        """The AWS variables that name this server."""
        return {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def client(self):  # a boto3 S3 client: the tests look at the bucket through another client than ours
        env = self.env()
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=env["AWS_REGION"],
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


@contextlib.contextmanager
def s3_server(log_dir: Path) -> Iterator[S3Server]:
    """moto's server, up with :data:`BUCKET`, stopped at exit."""
    port = free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MOTO_CALL_RESET_API": "false"})
    try:
        wait_for_port(port, timeout_s=30, proc=proc)
        server = S3Server(f"http://127.0.0.1:{port}", proc)
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        terminate(proc)
        log.close()


@contextlib.contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` for the block (obstore reads AWS_* there)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
