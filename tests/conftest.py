"""Fixtures every suite shares: the session's Redis server."""

from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from router_queue.dev.stack import redis_answers

from .object_stores import S3Server, s3_server
from .redis_servers import TEST_REDIS_URL, PrivateRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL (database 0, which no test flushes) of the Redis server this
    session owns: a private ``redis-server`` started on first use, or the one
    ``TEST_REDIS_URL`` names. Unit tests on a real Redis skip without either."""
    if TEST_REDIS_URL:
        if not redis_answers(TEST_REDIS_URL):
            pytest.fail(f"TEST_REDIS_URL={TEST_REDIS_URL} does not answer PING")
        yield TEST_REDIS_URL
        return
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary on PATH (scripts/test installs it) and no TEST_REDIS_URL")
    server = PrivateRedis(tmp_path_factory.mktemp("session-redis"), persist=False)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's S3-compatible server (moto's, in a subprocess: ``object_stores.py``)."""
    with s3_server(tmp_path_factory.mktemp("s3-server")) as server:
        yield server
