"""A broker apart from the store, gone and back, strands nothing (issue 23).

A stack of our own on a private redis-server (the store) and a private
RabbitMQ node or a second private redis-server (the broker), the Procfile's
processes, and a caller submitting BFL requests the whole time. The broker
is stopped (``rabbitmqctl stop_app``; a Redis hung by SIGSTOP) or SIGKILLed
for 10 s and brought back. Admissions go on meanwhile (the store
is fine); their grants cannot be published, so they are made due at once and
published by the first sweep after the return. What is measured: how long
after the broker's return work starts again (target: 10 s), how many
requests that waited through the outage started later than that, and that
every request admitted completes once, charged once, run once upstream.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

import pytest

from router_queue.dev.stack import free_port
from router_queue.settings import DEFAULT_CATALOG
from tests.rabbitmq_nodes import PrivateRabbitMQ
from tests.redis_servers import PrivateRedis

from .harness import FLUX, ApiClient, RunningStack, stack_env, unique_prompt, wait_for

OUTAGE_S = 10.0
#: Seconds after the broker's return within which work must start again.
RESUME_TARGET_S = 10.0

pytestmark = pytest.mark.slow


Broker = PrivateRabbitMQ | PrivateRedis


@pytest.fixture(scope="module")
def apart(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Broker, RunningStack]]:
    """The store on a redis-server of its own, the broker on a RabbitMQ node or
    a second redis-server of its own (append-only file on), as ``request.param`` says."""
    store = PrivateRedis(tmp_path_factory.mktemp("apart-redis"))
    broker: Broker
    if request.param == "rabbitmq":
        # not under pytest's tmp (mode 0700): the node runs as the rabbitmq user
        broker = PrivateRabbitMQ(Path(tempfile.mkdtemp(prefix="rq-rabbitmq-")))
    else:
        broker = PrivateRedis(tmp_path_factory.mktemp("apart-broker"))
    store.start()
    try:
        broker.start()
        # production's grant lease: a grant whose publish failed must not wait for it
        env = stack_env(store.url, stub_port=free_port(), broker_url=broker.url, catalog=DEFAULT_CATALOG,
                        REPUBLISH_AFTER_SECONDS="30")
        with RunningStack.start(env, tmp_path_factory.mktemp("apart-logs"), label="broker-apart stack") as running:
            yield broker, running
    finally:
        broker.stop()
        store.stop()
        if isinstance(broker, PrivateRabbitMQ):
            shutil.rmtree(broker.directory, ignore_errors=True)


def _fault(broker: Broker, away: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """How the broker goes away and comes back: stopped (RabbitMQ's ``stop_app``;
    a Redis hung by SIGSTOP, which accepts connections and never answers) or
    killed (SIGKILL, then started on its data)."""
    if away == "killed":
        return broker.kill, broker.start
    if isinstance(broker, PrivateRabbitMQ):
        return broker.stop_app, broker.start_app
    return broker.pause, broker.resume


def _started_at(body: dict) -> float:
    return datetime.fromisoformat(body["started_at"].replace("Z", "+00:00")).timestamp()


class Submitter:
    """One caller submitting a short BFL generation every ``every_s``, in a thread."""

    def __init__(self, caller: ApiClient, every_s: float = 0.5):
        self.caller, self.every_s = caller, every_s
        self.admitted: list[tuple[str, float]] = []  # (request id, when admitted: wall clock)
        self.slowest_s = 0.0  # the longest a submit took to answer
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            response = self.caller.submit(FLUX, {"prompt": unique_prompt("through the outage", "[stub:latency=0.5]")})
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
            assert response.status_code == 201, (response.status_code, response.text)
            self.admitted.append((response.json()["request_id"], time.time()))
            self.stop.wait(self.every_s)

    def __enter__(self) -> "Submitter":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.parametrize(("apart", "away"), [("rabbitmq", "stopped"), ("rabbitmq", "killed"), ("redis", "stopped"),
                                             ("redis", "killed")], indirect=["apart"])
def test_work_resumes_within_10_s_of_the_brokers_return(apart: tuple[Broker, RunningStack], away: str) -> None:
    broker, running = apart
    leave, come_back = _fault(broker, away)
    caller = running.caller(f"apart-{away}")
    with Submitter(caller) as submitter:
        time.sleep(2.0)
        leave()
        gone_at = time.time()
        time.sleep(OUTAGE_S)
        come_back()
        back_at = time.time()
        time.sleep(3.0)
    context = f"\n\n{running.log_tails()}"
    assert running.stack.exited() is None, f"{running.stack.exited()} exited{context}"

    finals = {}
    for request_id, _ in submitter.admitted:
        finals[request_id] = caller.wait_status(FLUX, request_id, timeout_s=90)
    assert all("error_type" not in body for body in finals.values()), [
        b for b in finals.values() if "error_type" in b][:3]
    # Waited through the outage: admitted before the return and not started before the broker left.
    waited = {rid: _started_at(finals[rid]) - back_at for rid, at in submitter.admitted
              if at < back_at and _started_at(finals[rid]) > gone_at}
    assert waited, "nothing waited through the outage: it was not exercised"
    resumed_s = min(waited.values())
    late = {rid: round(s, 1) for rid, s in waited.items() if s > RESUME_TARGET_S}
    print(f"{type(broker).__name__} broker {away} for {OUTAGE_S:g} s: {len(submitter.admitted)} admitted, {len(waited)} waited through it, "
          f"work resumed {resumed_s:.1f} s after the broker's return, {len(late)} started later than "
          f"{RESUME_TARGET_S:g} s after it, the last {max(waited.values()):.1f} s after; the slowest submit "
          f"answered in {submitter.slowest_s:.1f} s")
    assert resumed_s < RESUME_TARGET_S, f"work resumed {resumed_s:.1f} s after the broker came back{context}"
    assert not late, f"started more than {RESUME_TARGET_S:g} s after the broker came back: {late}"

    # Once: one charge per request, none run twice upstream.
    ledger = running.services.accounts.ledger(caller.workspace, count=100_000)
    charged = [e.request_id for e in ledger if e.type == "charge"]
    assert sorted(charged) == sorted(finals), "a request not charged exactly once"
    twice = {k: n for k, n in running.stub.calls()["submits"].items() if k.startswith("bfl_submit:") and n > 1}
    assert not twice, f"generations submitted upstream twice: {twice}"
    wait_for(lambda: running.services.store.in_flight("bfl") == 0, timeout_s=30, what="no bfl slot held")
