"""Fallback between models on the real stack (docs/POOLS.md): Vertex AI as
a pool of two locations, gemini-3.1-flash-image answering 429 in both (the
stub's ``429_model``) for as long as the test runs. A request naming
gemini-2.5-flash-image in X-Comfy-Fallback-Models completes on it once
FALLBACK_AFTER_SECONDS have passed, charged its own (lower) price; one naming
none waits on its pool."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from router_queue.store.members import read_states
from tests.integration.harness import RunningStack, unique_prompt, wait_for
from tests.integration.pool_support import pooled_stack

NEW, OLD = "vertexai/gemini-3.1-flash-image", "vertexai/gemini-2.5-flash-image"
LOCATIONS = ("us-central1", "europe-west4")
AFTER_S = 3.0
EVERYWHERE_429 = "[stub:429_model=gemini-3.1-flash-image]"
#: The fallback's price here, under the path model's 39: the charge is the price of the model that ran.
OLD_PRICE = 20


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    members = [{"name": loc, "max_in_flight": 4, "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"},
                "project": "comfy-router", "location": loc} for loc in LOCATIONS]
    with pooled_stack(tmp_path_factory, "fallback", "vertexai", members, prices={OLD: OLD_PRICE},
                      MEMBER_GROW_SECONDS="1", FALLBACK_AFTER_SECONDS=str(AFTER_S)) as running:
        yield running


def gemini(text: str) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}]}


def by_model(running: RunningStack) -> dict[str, int]:
    return {key.split(":", 1)[1]: n for key, n in running.stub.calls()["by_key"].items()
            if key.startswith("vertex_model:")}


def test_a_model_429_everywhere_runs_the_named_fallback_after_the_wait(pooled: RunningStack) -> None:
    with pooled.caller("fallback") as caller:
        started = time.monotonic()
        ids = [caller.submit_ok(NEW, gemini(unique_prompt("fallback", EVERYWHERE_429)),
                                headers={"X-Comfy-Fallback-Models": OLD}) for _ in range(3)]
        finals = [caller.wait_status(NEW, request_id, timeout_s=60) for request_id in ids]
        waited = time.monotonic() - started
        for final in finals:
            assert final.get("error_type") is None, final
            assert final["model_ran"] == OLD
            [left] = final["tried"]
            assert left["model"] == NEW and left["member"] in LOCATIONS and left["error_type"] == "rate_limited"
            assert final["cost"] == {"credits": OLD_PRICE, "state": "charged"}
        assert waited >= AFTER_S
        result = caller.result(NEW, ids[0])
        assert result.status_code == 200 and result.headers["Content-Type"].startswith("application/json")
        assert result.json()["modelVersion"] == "gemini-2.5-flash-image"  # the output of the model that ran
        records = [pooled.services.store.status_view(i, "vertexai").record for i in ids]
        assert [r.attempts for r in records if r] == [0, 0, 0]  # 429s are the pool's, never an attempt
        charged = [e for e in pooled.services.accounts.ledger(caller.workspace) if e.type == "charge"]
        assert sorted(e.request_id for e in charged) == sorted(ids) and {e.amount for e in charged} == {OLD_PRICE}
        # the rest of each 39 held goes back (on a Redis Cluster, by the workspace's own step just after)
        wait_for(lambda: pooled.services.accounts.get(caller.workspace).held == 0, timeout_s=10, what="the holds settled")
    print(f"fallback: 3 requests, {NEW} answering 429 in both locations: each completed on {OLD} "
          f"after {waited:.1f} s (FALLBACK_AFTER_SECONDS={AFTER_S:g}), charged {OLD_PRICE} (of 39 held) once, "
          "no attempt counted")


def test_without_the_header_a_request_waits_on_its_pool_and_never_changes_model(pooled: RunningStack) -> None:
    with pooled.caller("no-fallback") as caller:
        before = by_model(pooled).get("gemini-2.5-flash-image", 0)
        request_id = caller.submit_ok(NEW, gemini(unique_prompt("no fallback", EVERYWHERE_429)))
        wait_for(lambda: caller.status_body(NEW, request_id)["status"] == "IN_PROGRESS", timeout_s=10,
                 what="the request claimed")
        time.sleep(AFTER_S * 2.5)
        body = caller.status_body(NEW, request_id)
        assert body["status"] == "IN_PROGRESS" and "model_ran" not in body and "tried" not in body
        assert by_model(pooled).get("gemini-2.5-flash-image", 0) == before
        assert pooled.services.store.status_view(request_id, "vertexai").record.attempts == 0
        assert caller.cancel(NEW, request_id).status_code == 202
        assert caller.wait_status(NEW, request_id)["error_type"] == "cancelled"


def by_location(running: RunningStack) -> dict[str, int]:
    return {key.split(":", 1)[1]: n for key, n in running.stub.calls()["by_key"].items()
            if key.startswith("vertex_generate:")}


def test_a_pinned_workspace_waits_in_the_queue_for_its_members(pooled: RunningStack) -> None:
    """Pinned to europe-west4 (4 slots): of six 3 s requests, four take its
    slots and two wait IN_QUEUE, holding no provider slot, at positions 0 and
    1, while an unpinned workspace's requests run at once in us-central1.
    Before the schedule knew pins, all six were granted (the pool has 8): two
    waited IN_PROGRESS in the worker, on slots the unpinned ones needed."""
    members = pooled.services.catalog.members("vertexai")
    with pooled.caller("pin-queue") as pinned, pooled.caller("pin-free") as free:
        def settled() -> bool:
            """The earlier tests' 429s halved the learned caps, which grow back a slot per
            MEMBER_GROW_SECONDS at a generation sent: both members fed until back to 4."""
            if all(s.learned_cap == 4 and s.out_until(OLD) <= time.time()
                   for s in read_states(pooled.services.redis, "vertexai", members)):
                return True
            for request_id in [free.submit_ok(OLD, gemini(unique_prompt("regrow", "[stub:latency=0.3]")))
                               for _ in range(8)]:
                free.wait_status(OLD, request_id, timeout_s=20)
            return False
        wait_for(settled, timeout_s=60, what="both members back to 4 slots")
        assert pooled.services.regions is not None
        pooled.services.regions.set(pinned.workspace, ("europe-west4",))
        try:
            before = by_location(pooled)
            ids = [pinned.submit_ok(OLD, gemini(unique_prompt("pin queue", "[stub:latency=3]"))) for _ in range(6)]
            wait_for(lambda: [pinned.status_body(OLD, i)["status"] for i in ids[:4]] == ["IN_PROGRESS"] * 4,
                     timeout_s=10, what="europe-west4's four slots taken")
            waiting = [pinned.status_body(OLD, i) for i in ids[4:]]
            assert [(b["status"], b["queue_position"]) for b in waiting] == [("IN_QUEUE", 0), ("IN_QUEUE", 1)]
            others = [free.submit_ok(OLD, gemini(unique_prompt("pin free", "[stub:latency=0.2]"))) for _ in range(4)]
            for request_id in others:
                assert free.wait_status(OLD, request_id, timeout_s=20).get("error_type") is None
            for request_id in ids:
                assert pinned.wait_status(OLD, request_id, timeout_s=30).get("error_type") is None
            during = {loc: n - before.get(loc, 0) for loc, n in by_location(pooled).items()}
            assert during == {"us-central1": len(others), "europe-west4": len(ids)}, during

            def charged() -> list[str]:  # (on a Redis Cluster, by the workspace's own step just after)
                return sorted(e.request_id for e in pooled.services.accounts.ledger(pinned.workspace)
                              if e.type == "charge")
            wait_for(lambda: len(charged()) >= len(ids), timeout_s=10, what="the pinned requests charged")
            assert charged() == sorted(ids)  # each once: none lost, none charged twice
        finally:
            pooled.services.regions.set(pinned.workspace, ())


def test_a_pinned_workspace_never_touches_an_out_of_region_member(pooled: RunningStack) -> None:
    """Pinned to europe-west4 (``workspace set-regions``): its requests, a
    fallback's included, run there alone, and wait while it answers 429;
    another workspace's go to both locations meanwhile."""
    with pooled.caller("pinned") as pinned, pooled.caller("unpinned") as free:
        assert pooled.services.regions is not None
        pooled.services.regions.set(pinned.workspace, ("europe-west4",))
        before = by_location(pooled)
        ids = [pinned.submit_ok(NEW, gemini(unique_prompt("pinned", "[stub:latency=0.2]"))) for _ in range(6)]
        ids.append(pinned.submit_ok(NEW, gemini(unique_prompt("pinned fallback", EVERYWHERE_429)),
                                    headers={"X-Comfy-Fallback-Models": OLD}))
        for request_id in ids:
            assert pinned.wait_status(NEW, request_id, timeout_s=60).get("error_type") is None
        during = {loc: n - before.get(loc, 0) for loc, n in by_location(pooled).items()}
        assert during.get("us-central1", 0) == 0 and during["europe-west4"] >= len(ids), during
        # europe-west4 rate-limited: the pinned request waits for it, the unpinned one runs in us-central1
        waiting = pinned.submit_ok(NEW, gemini(unique_prompt("pinned waits", "[stub:429_key=europe-west4]")))
        other = free.submit_ok(NEW, gemini(unique_prompt("free", "[stub:429_key=europe-west4]")))
        assert free.wait_status(NEW, other, timeout_s=30).get("error_type") is None
        time.sleep(2)
        assert pinned.status_body(NEW, waiting)["status"] == "IN_PROGRESS"
        assert by_location(pooled).get("us-central1", 0) - before.get("us-central1", 0) == 1  # the unpinned one
        assert pinned.cancel(NEW, waiting).status_code == 202
        pooled.services.regions.set(pinned.workspace, ())


def test_a_pool_paused_by_one_models_429s_still_grants_the_other_model_and_fallbacks(pooled: RunningStack) -> None:
    """Last in this file: it leaves gemini-3.1-flash-image paused for 20 s.
    A request naming no fallback takes the 429s in both locations (Retry-After
    20 s), so the pool's members are paused for that model alone: a request
    naming a fallback is granted at once and completes on it within
    FALLBACK_AFTER_SECONDS and a few, and a request of the other model is
    not held at all (both waited IN_QUEUE for the pause before)."""
    members = pooled.services.catalog.members("vertexai")
    with pooled.caller("model-room") as caller:
        keeper = caller.submit_ok(NEW, gemini(unique_prompt("keeper", f"{EVERYWHERE_429} [stub:429=20]")))

        def paused_everywhere() -> bool:
            states = read_states(pooled.services.redis, "vertexai", members)
            return all(s.out_until(NEW) > time.time() + 5 for s in states)
        wait_for(paused_everywhere, timeout_s=15, what=f"{NEW} paused in both locations")
        started = time.monotonic()
        falls_back = caller.submit_ok(NEW, gemini(unique_prompt("falls back", EVERYWHERE_429)),
                                      headers={"X-Comfy-Fallback-Models": OLD})
        other = caller.submit_ok(OLD, gemini(unique_prompt("other model")))
        other_final = caller.wait_status(OLD, other, timeout_s=30)
        other_took = time.monotonic() - started
        final = caller.wait_status(NEW, falls_back, timeout_s=30)
        took = time.monotonic() - started
        assert other_final.get("error_type") is None and final.get("error_type") is None, (other_final, final)
        assert final["model_ran"] == OLD and final["tried"][0]["model"] == NEW
        assert other_took < 5, other_took
        assert AFTER_S <= took < AFTER_S + 5, took
        assert caller.cancel(NEW, keeper).status_code == 202
    print(f"model room: {NEW} paused in both locations for 20 s; a request of {OLD} completed in "
          f"{other_took:.1f} s, one naming it as its fallback in {took:.1f} s (FALLBACK_AFTER_SECONDS={AFTER_S:g})")
