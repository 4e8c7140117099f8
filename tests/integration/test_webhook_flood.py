"""One workspace floods a blackhole with webhooks; another's still arrive
within 2 s (issue 20, item 1), against real processes.

A stack of our own on a private ``redis-server``: the stub, a provider worker,
the webhooks worker (the Procfile's ``webhooks``: ``router.webhooks`` only,
16 threads), beat sweeping every second, gunicorn; the receiver process of
``test_webhooks.py`` for the good workspace. The blackhole runs in this
process, one of two kinds:

* **accepts, never answers**: every connection is accepted and held open,
  read until the sender hangs up, never answered;
* **never accepts**: a listener whose accept queue is full, so the kernel
  drops every further SYN: a connect neither completes nor is refused.

The flood workspace submits 300 Gemini requests naming the blackhole. Before
the flood and while it lasts, the good workspace submits requests naming the
receiver; the figure is each webhook's arrival at the receiver less its
request's ``completed_at``. The target is 2 s, the most of any, during the
flood (printed with the figure before it).

Nothing is lost: every request completes and is charged once (one hold, one
charge each in the ledger); every good webhook arrives exactly once; every
flood event is still pending (waiting its turn, its circuit open, or between
attempts), none given up or dropped. The flood never had more than
``WEBHOOK_MAX_IN_FLIGHT_PER_WORKSPACE`` attempts at once (from the attempt
log's intervals), its endpoint's circuit is open in ``router-queue ops
webhooks`` (by origin only), and no provider worker ran a webhook task.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, Iterator

import pytest
import requests

from router_queue.webhooks.event import new_secret

from .chaos_support import assert_settled_once
from .harness import GEMINI, START_CREDITS, ApiClient, RunningStack, make_caller, private_stack, unique_prompt, wait_for
from .webhook_support import Receiver, cli_ok

pytestmark = pytest.mark.slow

#: Requests whose webhooks the flood aims at the blackhole.
FLOOD = 300
#: The target: the good workspace's webhooks arrive within this many seconds of completing.
TARGET_S = 2.0
CAP = 4
TIMEOUT_S = 2.0
SETTINGS = {
    "WEBHOOK_ALLOW_LOOPBACK_HTTP": "1",
    "WEBHOOK_TIMEOUT_SECONDS": f"{TIMEOUT_S:g}",
    "WEBHOOK_LEASE_SECONDS": "6",
    "WEBHOOK_RETRY_SCHEDULE": "1,2,4",
    # Long enough that nothing of the flood is given up while the test looks.
    "WEBHOOK_RETRY_FOR_SECONDS": "600",
    "WEBHOOK_MAX_IN_FLIGHT_PER_WORKSPACE": str(CAP),
    "WEBHOOK_WAIT_SECONDS": "1",
    "WEBHOOK_CIRCUIT_FAILURES": "5",
    "WEBHOOK_CIRCUIT_COOLING_SECONDS": "5",
}
#: Seconds the good workspace keeps submitting once the whole flood is owed.
DURING_S = 10.0
#: Seconds between two of the good workspace's submits.
EVERY_S = 0.5


# -- blackholes ----------------------------------------------------------------------------


class Holding:
    """Accepts every connection and never answers; counts them open at once."""

    kind = "accepts, never answers"

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.open = self.most_open = self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.open += 1
                self.accepted += 1
                self.most_open = max(self.most_open, self.open)
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                pass  # the request, read and never answered
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.listener.close()


class Unaccepting:
    """A listener whose accept queue is full: further SYNs are dropped."""

    kind = "never accepts"

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(filler)
        time.sleep(0.2)
        probe = socket.socket()
        probe.settimeout(0.5)
        with pytest.raises(TimeoutError):
            probe.connect(("127.0.0.1", self.port))
        probe.close()

    def close(self) -> None:
        for s in (self.listener, *self.fillers):
            s.close()


# -- the stack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flood_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with private_stack(tmp_path_factory, "webhook flood", SETTINGS, webhooks=True) as running:
        yield running


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("flood-receiver"))
    try:
        yield made
    finally:
        made.stop()


def hooked_caller(stack: RunningStack, name: str) -> tuple[ApiClient, str]:
    caller = make_caller(stack, name)
    secret = new_secret()
    assert stack.services.accounts.webhook_secret(caller.workspace, secret) == "CREATED"
    return caller, secret


def gemini(label: str) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": unique_prompt(label)}]}]}


def _iso(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def latencies(receiver: Receiver, name: str, request_ids: list[str]) -> dict[str, float]:
    """Seconds from each request's completion to its webhook's arrival."""
    arrived = {a["webhook_id"]: a for a in receiver.attempts(name)}
    return {rid: arrived[f"msg_{rid}"]["arrived_at"] - _iso(arrived[f"msg_{rid}"]["event"]["completed_at"])
            for rid in request_ids}


def most_at_once(attempts: list[Any]) -> int:
    """The most attempts of the log that overlapped in time."""
    edges = sorted([(a.at - a.seconds, 1) for a in attempts] + [(a.at, -1) for a in attempts])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


# -- the scenario -------------------------------------------------------------------------------


@pytest.mark.parametrize("blackhole_kind", [Holding, Unaccepting], ids=["accepts-never-answers", "never-accepts"])
def test_a_flood_at_a_blackhole_does_not_delay_another_workspaces_webhooks(
        flood_stack: RunningStack, receiver: Receiver, blackhole_kind: type) -> None:
    services = flood_stack.services
    blackhole = blackhole_kind()
    good, good_secret = hooked_caller(flood_stack, "good")
    flood, _ = hooked_caller(flood_stack, "flood")
    name = f"good-{good.workspace}"
    good_url = receiver.configure(name, secrets={"current": good_secret})
    hole_origin = f"http://127.0.0.1:{blackhole.port}"
    good_ids: list[str] = []
    flood_ids: list[str] = []

    def submit_good(label: str) -> str:
        request_id = good.submit_ok(GEMINI, gemini(label), headers={"X-Comfy-Webhook-Url": good_url})
        good_ids.append(request_id)
        return request_id

    def delivered(ids: list[str]) -> bool:
        return {a["webhook_id"] for a in receiver.attempts(name)} >= {f"msg_{rid}" for rid in ids}

    try:
        with good, flood:
            # Before the flood.
            before = [submit_good(f"before {n}") for n in range(5)]
            wait_for(lambda: delivered(before), timeout_s=20, what="the good webhooks before the flood")
            before_s = latencies(receiver, name, before)

            # The flood: 300 requests whose webhooks go to the blackhole, from 16 threads.
            def submit_flood(n: int) -> str:
                response = requests.post(flood.url(GEMINI), json=gemini(f"flood {n}"), timeout=30,
                                         headers=flood.headers({"X-Comfy-Webhook-Url": f"{hole_origin}/hook/{n}?token=s3cr3t"}))
                assert response.status_code == 201, (response.status_code, response.text)
                return response.json()["request_id"]

            with ThreadPoolExecutor(16) as pool:
                flooding = pool.map(submit_flood, range(FLOOD))
                # The good workspace's requests while the flood is admitted, run and owed...
                during = []
                started = time.monotonic()
                collector = threading.Thread(target=lambda: flood_ids.extend(flooding), daemon=True)
                collector.start()
                while collector.is_alive():
                    during.append(submit_good(f"during {len(during)}"))
                    time.sleep(EVERY_S)
                    assert time.monotonic() - started < 120, "the flood was not admitted within 2 min"
            assert len(flood_ids) == FLOOD, "a flood submit was refused (see above)"
            owed_all = wait_for(lambda: all(services.webhooks.event(rid).get("state") for rid in flood_ids)
                                and time.monotonic(), timeout_s=60, interval_s=0.5, what="the whole flood owed")
            # ...and while its events wait, retry and probe the blackhole.
            while time.monotonic() - owed_all < DURING_S:
                during.append(submit_good(f"during {len(during)}"))
                time.sleep(EVERY_S)
            wait_for(lambda: delivered(during), timeout_s=30, what="the good webhooks during the flood")
            during_s = latencies(receiver, name, during)

            # Nothing lost: every request completed, each good webhook arrived exactly once.
            for rid in good_ids:
                assert good.status_body(GEMINI, rid)["status"] == "COMPLETED"
            statuses = [flood.status_body(GEMINI, rid) for rid in flood_ids]
            assert {s["status"] for s in statuses} == {"COMPLETED"}
            attempts = receiver.attempts(name)
            assert sorted(a["webhook_id"] for a in attempts) == sorted(f"msg_{rid}" for rid in good_ids)
            assert all(a["verified"] and a["answered"] == 204 for a in attempts)
            # Every flood event is still owed: waiting, retrying or between attempts; none given up.
            events = [services.webhooks.event(rid) for rid in flood_ids]
            assert {e["state"] for e in events} == {"pending"}, {e["state"] for e in events}
            assert all(services.webhooks.owed(rid) for rid in flood_ids)
            tried = sum(int(e["attempts"]) for e in events)
            # Nothing charged twice: one hold and one charge per request.
            price = services.catalog.by_id(GEMINI).price_credits
            assert_settled_once(services, good.workspace, set(good_ids), set(), price, START_CREDITS)
            assert_settled_once(services, flood.workspace, set(flood_ids), set(), price, START_CREDITS)

            # The flood's share: never more than its cap at once; its circuit open, shown by origin.
            log = services.webhooks.attempts(flood.workspace, count=200)
            assert most_at_once(log) <= CAP, [(a.at, a.seconds) for a in log]
            if isinstance(blackhole, Holding):
                # Every connection the blackhole saw was an attempt counted in Redis. (Its own count
                # of connections open at once lags: it sees a hang-up only when its thread runs.)
                assert blackhole.accepted <= tried
            (circuit,) = [c for c in services.webhooks.open_circuits() if c.workspace == flood.workspace]
            assert circuit.origin == hole_origin
            shown = cli_ok(flood_stack.env, "ops", "webhooks").stdout
            assert f"{flood.workspace}\t{hole_origin}\topen" in shown and "s3cr3t" not in shown
            assert "/hook/" not in shown
            # Delivered by the webhooks worker, never on a provider worker's thread.
            task = "workers.tasks.deliver_webhook["  # a task run, not the banner's list of tasks
            assert task not in flood_stack.log_text("worker")
            assert task in flood_stack.log_text("webhooks")

            worst_before, worst_during = max(before_s.values()), max(during_s.values())
            print(f"\nBLACKHOLE ({blackhole.kind}): {FLOOD} webhooks from one workspace; the other's "
                  f"{len(during_s)} during the flood arrived at most {worst_during:.3f} s after completing "
                  f"(median {sorted(during_s.values())[len(during_s) // 2]:.3f} s; before the flood: at most "
                  f"{worst_before:.3f} s over {len(before_s)}); flood attempts made {tried} for {FLOOD} events, "
                  f"at most {most_at_once(log)} at once; its circuit open ({circuit.failures} failures in a row)")
            # The target, with no margin added: 2 s is the figure the issue names.
            assert worst_during <= TARGET_S, sorted(during_s.values())[-5:]
    finally:
        # This flood's events stay owed and meet a closed port from now on (refused at once).
        blackhole.close()
