"""The fair queue behind a provider's cap, on a real stack.

A stack of our own (``chaos_support``: redis-server, two Celery workers, beat,
gunicorn, the stub provider) whose catalog ("cap1") lets one Vertex AI
generation run at a time and two OpenAI ones. A long generation (the
"blocker") holds the only slot while the tests queue requests behind it; the
stub's ``[stub:latency=S]`` sets how long each one runs. The order requests
started in is read from their records' ``started_at``.

The policy under test (``router_queue/store/lua/lib/schedule.lua``, the schedule): a freed
slot goes to the waiting request with the lowest virtual-time tag; a workspace
of weight w that queues a request gets the tag max(vtime, its last tag) +
720720 // w; ties go to the older slot; within a workspace requests take its
slots in priority order (high, normal, low), FIFO within a priority; a
workspace at its own max_in_flight is skipped until one of its requests ends.
``queue_position`` is how many requests start before this one if nothing else
arrives. :class:`FairModel` is that policy written out in Python, so a test
can name the exact order it expects besides the property it checks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from comfy_sdk import Comfy

from router_queue.store import keys

from .chaos_support import ChaosStack, StackPool, assert_not_running
from .harness import GEMINI, TTS, ApiClient, forget_pace, unique_prompt

#: The catalog of every stack here: vertexai capped at 1, openai at 2.
CATALOG = "cap1"
#: Seconds the blocker holds the only slot: every submission of a test ends well within it.
BLOCKER_S = 2.0
#: Seconds a queued request runs when its length does not matter.
SHORT_S = 0.05
#: Bound (s) on a test's requests all completing.
DONE_WITHIN_S = 60.0
#: Virtual time one request of a weight-1 workspace takes (lib/schedule.lua QUANTUM).
QUANTUM = 720720
BANDS = {"high": 0, "normal": 1, "low": 2}


# -- the stack ---------------------------------------------------------------------------------


def _stack(pool: StackPool, broker: str = "redis") -> ChaosStack:
    """The capped stack on ``broker``, with nothing of an earlier test still queued or running."""
    running = pool.get(broker, CATALOG)
    catalog = running.services.catalog
    assert (catalog.max_in_flight("vertexai"), catalog.max_in_flight("openai")) == (1, 2)
    client = running.services.redis
    deadline = time.monotonic() + 30
    while any(client.zcard(keys.queue(p)) or client.zcard(keys.running(p)) for p in ("vertexai", "openai")):
        assert time.monotonic() < deadline, "an earlier test's requests are still queued or running"
        time.sleep(0.1)
    return running


@pytest.fixture
def running(pool: StackPool) -> ChaosStack:
    return _stack(pool)


# -- requests --------------------------------------------------------------------------------


def gemini(text: str, latency_s: float) -> dict[str, Any]:
    """A Vertex AI body no other test sends (the stub keys on the body), running ``latency_s``."""
    return {"contents": [{"role": "user", "parts": [{"text": unique_prompt(text, f"[stub:latency={latency_s}]")}]}]}


def speech(text: str, latency_s: float) -> dict[str, Any]:
    return {"input": unique_prompt(text, f"[stub:latency={latency_s}]"), "voice": "alloy"}


def submit(caller: ApiClient, model: str, body: dict[str, Any], priority: str | None = None) -> str:
    return caller.submit_ok(model, body, headers={"X-Comfy-Priority": priority} if priority else None)


def records(running: ChaosStack, request_ids: list[str]) -> dict[str, dict[str, str]]:
    pipe = running.services.redis.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hgetall(keys.request(request_id))
    return {rid: {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"body"}
            for rid, raw in zip(request_ids, pipe.execute())}


def wait_completed(running: ChaosStack, request_ids: list[str],
                   timeout_s: float = DONE_WITHIN_S) -> dict[str, dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = records(running, request_ids)
        open_ = {rid: rec.get("status") for rid, rec in found.items() if rec.get("status") != "COMPLETED"}
        if not open_:
            return found
        if time.monotonic() > deadline:
            running.assert_alive()
            raise AssertionError(f"{len(open_)} of {len(request_ids)} requests not COMPLETED within "
                                 f"{timeout_s} s: {open_}")
        time.sleep(0.1)


def start_order(running: ChaosStack, request_ids: list[str], *, cap: int = 1,
                timeout_s: float = DONE_WITHIN_S) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Every request COMPLETED without an error, each run once under the provider's cap;
    their ids in the order they started (``started_at``), and their records."""
    found = wait_completed(running, request_ids, timeout_s)
    for request_id, rec in found.items():
        assert not rec.get("error_type"), (request_id, rec)
        assert rec.get("started_at"), f"{request_id} completed without starting: {rec}"
    order = sorted(request_ids, key=lambda rid: float(found[rid]["started_at"]))
    # No more than ``cap`` ran at once: none started while ``cap`` others still ran.
    start = {rid: float(found[rid]["started_at"]) for rid in request_ids}
    end = {rid: float(found[rid]["completed_at"]) for rid in request_ids}
    for rid in request_ids:
        beside = [other for other in request_ids if start[other] < start[rid] < end[other]]
        assert len(beside) < cap, f"{rid} started while {len(beside)} others ran (cap {cap})"
    assert_not_running(running.services, request_ids)
    return order, found


def assert_queued_while_blocked(found: dict[str, dict[str, str]], blocker: str, submitted_at: float) -> None:
    """The premise of a test: every submission ended while the blocker still ran."""
    assert float(found[blocker]["completed_at"]) > submitted_at, (
        "the blocker ended before the submissions did; the machine is too slow for BLOCKER_S")


def label(order: list[str], names: dict[str, str]) -> list[str]:
    return [names[rid] for rid in order]


# -- the policy, written out -----------------------------------------------------------------


@dataclass
class FairModel:
    """lib/schedule.lua's schedule for one provider with a cap of 1, in Python.

    ``submit`` what a test submitted, in its order; the first submission takes
    the free slot at once. ``order()`` grants the rest one by one, as each
    running request ends with nothing else arriving.
    """

    weights: dict[str, int] = field(default_factory=dict)
    vtime: int = 0
    last: dict[str, int] = field(default_factory=dict)
    slots: list[tuple[int, int, str]] = field(default_factory=list)       # (tag, slot seq, ws)
    waiting: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # ws: (band, seq, id)
    seq: int = 0
    started: list[str] = field(default_factory=list)

    def submit(self, ws: str, request_id: str, priority: str = "normal") -> None:
        self.seq += 1
        tag = max(self.vtime, self.last.get(ws, 0)) + QUANTUM // self.weights.get(ws, 1)
        self.last[ws] = tag
        self.slots.append((tag, self.seq, ws))
        self.waiting.setdefault(ws, []).append((BANDS[priority], self.seq, request_id))
        if len(self.started) == 0:
            self.grant()

    def grant(self) -> None:
        """The running request ended: the next one starts."""
        self.slots.sort()
        tag, _, ws = self.slots.pop(0)
        self.vtime = max(self.vtime, tag)
        mine = sorted(self.waiting[ws])
        self.started.append(mine.pop(0)[2])
        self.waiting[ws] = mine
        if not mine:  # idle: its last tag is forgotten
            del self.waiting[ws]
            self.last.pop(ws, None)

    def cancel(self, ws: str, request_id: str) -> None:
        """A waiting request leaves: its workspace gives back its last slot."""
        self.waiting[ws] = [item for item in self.waiting[ws] if item[2] != request_id]
        self.slots.remove(max(slot for slot in self.slots if slot[2] == ws))
        if not self.waiting[ws]:
            del self.waiting[ws]
            self.last.pop(ws, None)
        else:
            self.last[ws] = max(slot[0] for slot in self.slots if slot[2] == ws)

    def order(self) -> list[str]:
        while self.slots:
            self.grant()
        return self.started


# -- 1. FIFO within a workspace ------------------------------------------------------------------


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_one_workspaces_requests_start_in_submission_order(pool: StackPool, broker: str) -> None:
    running = _stack(pool, broker)
    with running.caller("fifo") as caller:
        blocker = submit(caller, GEMINI, gemini("fifo blocker", BLOCKER_S))
        ids = [submit(caller, GEMINI, gemini(f"fifo {i}", SHORT_S)) for i in range(29)]
        submitted_at = time.time()

        order, found = start_order(running, [blocker, *ids])

        assert_queued_while_blocked(found, blocker, submitted_at)
        names = {rid: f"#{i}" for i, rid in enumerate([blocker, *ids])}
        assert label(order, names) == label([blocker, *ids], names)


# -- 2. a newcomer is not stuck behind a backlog -----------------------------------------------------


def test_a_second_workspace_is_not_stuck_behind_anothers_backlog(running: ChaosStack) -> None:
    with running.caller("backlog a") as a, running.caller("backlog b") as b:
        model = FairModel()
        a_ids = [submit(a, GEMINI, gemini("backlog a blocker", BLOCKER_S))]
        a_ids += [submit(a, GEMINI, gemini(f"backlog a {i}", SHORT_S)) for i in range(29)]
        b_ids = [submit(b, GEMINI, gemini(f"backlog b {i}", SHORT_S)) for i in range(3)]
        submitted_at = time.time()
        for rid in a_ids:
            model.submit("A", rid)
        for rid in b_ids:
            model.submit("B", rid)

        order, found = start_order(running, a_ids + b_ids)

        assert_queued_while_blocked(found, a_ids[0], submitted_at)
        names = {rid: f"A{i + 1}" for i, rid in enumerate(a_ids)} | {rid: f"B{i + 1}" for i, rid in enumerate(b_ids)}
        tenth_a = order.index(a_ids[9])
        late = [names[rid] for rid in b_ids if order.index(rid) > tenth_a]
        assert not late, f"{late} started after A's 10th request: {label(order, names)}"
        # A1, A2, B1, A3, B2, A4, B3, A5, ...: B's first slot ties with A's second; the older wins.
        assert label(order, names) == label(model.order(), names)


def test_a_workspace_arriving_late_joins_the_current_round(running: ChaosStack) -> None:
    """No credit for having been idle, and no waiting behind the whole backlog:
    B's first slot is tagged just after the slot granted last."""
    with running.caller("late a") as a, running.caller("late b") as b:
        a_ids = [submit(a, GEMINI, gemini(f"late a {i}", 0.5)) for i in range(10)]
        a.wait_status(GEMINI, a_ids[3], "IN_PROGRESS", timeout_s=20)
        b_ids = [submit(b, GEMINI, gemini(f"late b {i}", SHORT_S)) for i in range(3)]

        order, found = start_order(running, a_ids + b_ids)

        # How many of A's had been granted when B arrived (A4 ran then; A5 is
        # granted when A4 ends, half a second later).
        arrived = float(found[b_ids[0]]["created_at"])
        granted = sum(1 for rid in a_ids if float(found[rid]["granted_at"]) < arrived)
        assert 3 <= granted <= 5, f"B arrived after {granted} of A's were granted (A4 was running)"
        model = FairModel()
        for rid in a_ids:
            model.submit("A", rid)
        for _ in range(granted - 1):
            model.grant()
        for rid in b_ids:
            model.submit("B", rid)
        names = {rid: f"A{i + 1}" for i, rid in enumerate(a_ids)} | {rid: f"B{i + 1}" for i, rid in enumerate(b_ids)}
        assert label(order, names) == label(model.order(), names)


# -- 3. weights --------------------------------------------------------------------------------------


def test_weights_3_to_1_share_the_slot_3_to_1_within_every_round(running: ChaosStack) -> None:
    accounts = running.services.accounts
    with running.caller("weight c") as c, running.caller("weight a") as a, running.caller("weight b") as b:
        accounts.set_limits(a.workspace, weight=3)
        model = FairModel(weights={"A": 3})
        blocker = submit(c, GEMINI, gemini("weights blocker", BLOCKER_S))
        model.submit("C", blocker)
        a_ids, b_ids = [], []
        for i in range(12):  # interleaved, so neither is queued whole before the other
            a_ids.append(submit(a, GEMINI, gemini(f"weight a {i}", SHORT_S)))
            model.submit("A", a_ids[-1])
            if i % 3 == 0:
                b_ids.append(submit(b, GEMINI, gemini(f"weight b {i}", SHORT_S)))
                model.submit("B", b_ids[-1])
        submitted_at = time.time()

        order, found = start_order(running, [blocker, *a_ids, *b_ids])

        assert_queued_while_blocked(found, blocker, submitted_at)
        assert order[0] == blocker
        names = ({blocker: "C"} | {rid: f"A{i + 1}" for i, rid in enumerate(a_ids)}
                 | {rid: f"B{i + 1}" for i, rid in enumerate(b_ids)})
        seq = "".join(names[rid][0] for rid in order[1:])
        # While both have requests waiting: up to the first of their last starts.
        both = min(seq.rindex("A"), seq.rindex("B")) + 1
        windows = {seq[i:i + 4] for i in range(both - 3)}
        wrong = sorted(w for w in windows if (w.count("A"), w.count("B")) != (3, 1))
        assert not wrong, f"windows of 4 starts not 3 A : 1 B: {wrong}; order {seq}"
        assert label(order, names) == label(model.order(), names)


# -- 4. positions tell the start order -----------------------------------------------------------------


def _read_positions(owners: dict[str, ApiClient], request_ids: list[str],
                    model: str = GEMINI) -> dict[str, tuple[str, int | None]]:
    out = {}
    for request_id in request_ids:
        body = owners[request_id].status_body(model, request_id)
        out[request_id] = (body["status"], body.get("queue_position"))
    return out


def test_reported_positions_match_the_order_requests_start(running: ChaosStack) -> None:
    accounts = running.services.accounts
    with running.caller("pos a") as a, running.caller("pos b") as b, running.caller("pos c") as c:
        accounts.set_limits(b.workspace, weight=2)
        callers = {"A": a, "B": b, "C": c}
        model = FairModel(weights={"B": 2})
        blocker = submit(c, GEMINI, gemini("positions blocker", BLOCKER_S))
        model.submit("C", blocker)
        # Interleaved, some high (A, B) and low (C).
        plan = [("A", None), ("B", None), ("C", "low"), ("A", None), ("B", None), ("A", "high"),
                ("B", None), ("C", "low"), ("A", None), ("B", "high"), ("C", None), ("A", "high"),
                ("B", None), ("A", None), ("C", "high"), ("B", None), ("A", "low")]
        owners: dict[str, ApiClient] = {}
        names: dict[str, str] = {blocker: "C-blocker"}
        for ws, priority in plan:
            rid = submit(callers[ws], GEMINI, gemini(f"positions {ws}", 0.4), priority)
            owners[rid] = callers[ws]
            names[rid] = f"{ws}{len(owners)}{'-' + priority if priority else ''}"
            model.submit(ws, rid, priority or "normal")
        submitted_at = time.time()
        queued = list(owners)

        # Read every waiting request's position twice in a row. Positions only
        # go down while nothing is submitted, so when both reads agree, each
        # held its value across the moment between the two passes: the pair is
        # a snapshot of that moment.
        snapshots: list[dict[str, int]] = []
        history: dict[str, list[int]] = {rid: [] for rid in queued}
        waiting = list(queued)
        deadline = time.monotonic() + DONE_WITHIN_S
        while waiting:
            assert time.monotonic() < deadline, f"still waiting: {[names[r] for r in waiting]}"
            first = _read_positions(owners, waiting)
            second = _read_positions(owners, waiting)
            for reads in (first, second):
                for rid, (status, position) in reads.items():
                    if status == "IN_QUEUE":
                        assert isinstance(position, int), (names[rid], status, position)
                        history[rid].append(position)
            if first == second:
                snapshot = {rid: pos for rid, (status, pos) in first.items() if status == "IN_QUEUE"}
                if snapshot:
                    snapshots.append(snapshot)
            waiting = [rid for rid in waiting if second[rid][0] == "IN_QUEUE"]

        order, found = start_order(running, [blocker, *queued])

        assert_queued_while_blocked(found, blocker, submitted_at)
        assert order[0] == blocker
        rank = {rid: i for i, rid in enumerate(order[1:])}
        assert len(snapshots) >= 5, f"only {len(snapshots)} consistent snapshots"
        assert len(snapshots[0]) == len(queued), "the first snapshot came after requests had started"
        for n, snapshot in enumerate(snapshots):
            by_position = sorted(snapshot, key=lambda rid: snapshot[rid])
            by_start = sorted(snapshot, key=lambda rid: rank[rid])
            shown = {names[rid]: snapshot[rid] for rid in by_start}
            assert len(set(snapshot.values())) == len(snapshot), f"snapshot {n}: positions not distinct: {shown}"
            assert label(by_position, names) == label(by_start, names), (
                f"snapshot {n}: position order != start order; positions in start order: {shown}")
            # Exactly: how many of the waiting ones started before it.
            assert [snapshot[rid] for rid in by_start] == list(range(len(snapshot))), (
                f"snapshot {n}: positions in start order: {shown}")
        rising = {names[rid]: seen for rid, seen in history.items() if seen != sorted(seen, reverse=True)}
        assert not rising, f"queue positions went up: {rising}"
        assert label(order, names) == label(model.order(), names)


def _snapshot(owners: dict[str, ApiClient], model: str, request_ids: list[str]) -> dict[str, int]:
    """Positions of the waiting ones at one moment: two passes that read the same (see test 4)."""
    deadline = time.monotonic() + 5
    while True:
        first = _read_positions(owners, request_ids, model)
        if first == _read_positions(owners, request_ids, model):
            return {rid: pos for rid, (status, pos) in first.items() if status == "IN_QUEUE"}
        assert time.monotonic() < deadline, "positions kept changing"


def test_cancelling_a_waiting_request_moves_nobody_back(running: ChaosStack) -> None:
    with running.caller("cancel c") as c, running.caller("cancel a") as a, running.caller("cancel b") as b:
        model = FairModel()
        blocker = submit(c, GEMINI, gemini("cancel blocker", BLOCKER_S))
        model.submit("C", blocker)
        owners: dict[str, ApiClient] = {}
        names = {blocker: "C-blocker"}
        for ws, caller in (("A", a), ("B", b)):
            for i in range(3):
                rid = submit(caller, GEMINI, gemini(f"cancel {ws}{i + 1}", SHORT_S))
                owners[rid], names[rid] = caller, f"{ws}{i + 1}"
                model.submit(ws, rid)
        a_ids, b_ids = list(owners)[:3], list(owners)[3:]
        before = _snapshot(owners, GEMINI, list(owners))

        # A cancels its last waiting request: A gives back its last slot, so A1
        # keeps its turn (A1, B1, A2, B2, B3), nobody moves back.
        cancelled = a.cancel(GEMINI, a_ids[2])
        model.cancel("A", a_ids[2])
        after = _snapshot(owners, GEMINI, [rid for rid in owners if rid != a_ids[2]])
        cancelled_at = time.time()

        assert cancelled.status_code == 202, (cancelled.status_code, cancelled.text)
        rest = [blocker, *a_ids[:2], *b_ids]
        order, found = start_order(running, rest)
        assert_queued_while_blocked(found, blocker, cancelled_at)
        gone = records(running, [a_ids[2]])[a_ids[2]]
        assert gone.get("error_type") == "cancelled" and not gone.get("started_at"), gone
        assert len(before) == 6 and len(after) == 5, (before, after)
        rose = {names[rid]: (before[rid], after[rid]) for rid in after if after[rid] > before[rid]}
        assert not rose, f"positions went up when A cancelled its last waiting request: {rose}"
        expected = label(model.order(), names)
        assert sorted(after, key=after.get) == [rid for rid in model.order() if rid in after], (
            f"positions after the cancel {({names[r]: p for r, p in after.items()})}, expected order {expected}")
        assert label(order, names) == expected


# -- 5. a workspace's own cap ----------------------------------------------------------------------------


def test_a_workspace_at_its_own_cap_waits_while_others_pass_it(running: ChaosStack) -> None:
    accounts = running.services.accounts
    with running.caller("own cap a") as a, running.caller("own cap b") as b:
        accounts.set_limits(a.workspace, max_in_flight=1)
        a1 = submit(a, TTS, speech("own cap a1", 2.5))
        a2 = submit(a, TTS, speech("own cap a2", SHORT_S))
        b_ids = [submit(b, TTS, speech(f"own cap b{i}", 0.3)) for i in range(4)]
        submitted_at = time.time()

        order, found = start_order(running, [a1, a2, *b_ids], cap=2)

        assert_queued_while_blocked(found, a1, submitted_at)
        names = {a1: "A1", a2: "A2"} | {rid: f"B{i + 1}" for i, rid in enumerate(b_ids)}
        start = {rid: float(found[rid]["started_at"]) for rid in found}
        end = {rid: float(found[rid]["completed_at"]) for rid in found}
        assert start[a2] >= end[a1], f"A ran two at once against its max_in_flight=1: {label(order, names)}"
        assert all(start[rid] < start[a2] for rid in b_ids), f"B did not pass A2: {label(order, names)}"
        assert all(start[rid] < end[a1] for rid in b_ids), f"B waited for A1: {label(order, names)}"
        # The provider's cap of 2 was used: B1 ran beside A1.
        assert start[b_ids[0]] < end[a1] and start[a1] < end[b_ids[0]]
        assert label(order, names) == ["A1", "B1", "B2", "B3", "B4", "A2"]


# -- 6. priority within a workspace -------------------------------------------------------------------------


def _sync_run(base_url: str, api_key: str, model: str, body: dict[str, Any], priority: str) -> requests.Response:
    return requests.post(f"{base_url}/v2/models/{model}", json=body, timeout=60,
                         headers={"X-API-Key": api_key, "X-Comfy-Priority": priority})


def test_priority_orders_a_workspaces_own_requests(running: ChaosStack) -> None:
    services = running.services
    with running.caller("priority") as caller:
        blocker = submit(caller, GEMINI, gemini("priority blocker", BLOCKER_S))
        normals = [submit(caller, GEMINI, gemini(f"priority normal {i}", SHORT_S)) for i in range(10)]
        high = submit(caller, GEMINI, gemini("priority high", SHORT_S), "high")

        # An unknown priority queues nothing, on either route.
        before = services.accounts.get(caller.workspace)
        depth = services.redis.zcard(keys.queue("vertexai"))
        ledger = len(services.accounts.ledger(caller.workspace, count=100_000))
        refused = caller.submit(GEMINI, gemini("priority urgent", SHORT_S), headers={"X-Comfy-Priority": "urgent"})
        refused_sync = _sync_run(running.base_url, caller.api_key, GEMINI, gemini("sync urgent", SHORT_S), "urgent")
        for response in (refused, refused_sync):
            assert response.status_code == 400, (response.status_code, response.text)
            assert response.json()["error_type"] == "invalid_input", response.text
            assert "request_id" not in response.json()
        after = services.accounts.get(caller.workspace)
        assert (after.queued, after.held) == (before.queued, before.held)
        assert services.redis.zcard(keys.queue("vertexai")) == depth
        assert len(services.accounts.ledger(caller.workspace, count=100_000)) == ledger

        # The synchronous route takes the header too: its high request goes
        # after the queued high one (FIFO within a priority), before the normals.
        sync_body = gemini("priority sync high", SHORT_S)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_sync_run, running.base_url, caller.api_key, GEMINI, sync_body, "high")
            response = held.result(timeout=DONE_WITHIN_S)
        assert response.status_code == 200, (response.status_code, response.text[:300])
        assert response.json()["candidates"][0]["content"]["parts"][0]["inlineData"]["data"]
        sync_id = response.headers["X-Comfy-Request-Id"]

        order, found = start_order(running, [blocker, high, sync_id, *normals])

        assert float(found[sync_id]["created_at"]) < float(found[blocker]["completed_at"]), (
            "the synchronous request was admitted after the blocker ended")
        assert found[high]["priority"] == "high" and found[sync_id]["priority"] == "high"
        names = {blocker: "blocker", high: "high", sync_id: "sync-high"} | {
            rid: f"normal{i + 1}" for i, rid in enumerate(normals)}
        assert order.index(high) == 1, f"the high request did not start right after the blocker: {label(order, names)}"
        assert label(order, names) == label([blocker, high, sync_id, *normals], names)


# -- the published client, unchanged ---------------------------------------------------------------------------


def test_comfy_sdk_submits_and_collects_behind_the_cap(running: ChaosStack, monkeypatch: pytest.MonkeyPatch) -> None:
    forget_pace(running.services)
    with running.caller("sdk") as caller:
        monkeypatch.setenv("COMFY_ROUTER_BASE_URL", running.base_url)
        monkeypatch.setenv("COMFY_API_KEY", caller.api_key)
        monkeypatch.delenv("COMFY_BASE_URL", raising=False)
        blocker = submit(caller, GEMINI, gemini("sdk blocker", 1.5))
        with Comfy() as client:
            handles = [client.models.submit(GEMINI, gemini(f"sdk {i}", SHORT_S)) for i in range(2)]
            updates = list(handles[1].iter_events(timeout=30))
            results = [handle.get(timeout=30) for handle in handles]

        assert updates[0].status == "IN_QUEUE" and updates[0].queue_position in (0, 1), updates
        assert updates[-1].status == "COMPLETED" and updates[-1].error_type is None, updates
        for result in results:
            assert isinstance(result, dict)
            assert result["candidates"][0]["content"]["parts"][0]["inlineData"]["data"]
        ids = [handle.request_id for handle in handles]
        order, found = start_order(running, [blocker, *ids])
        assert order == [blocker, *ids]
        assert [found[rid]["priority"] for rid in ids] == ["normal", "normal"]
