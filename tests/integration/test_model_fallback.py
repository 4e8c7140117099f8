"""Fallback between models on the real stack (docs/POOLS.md): Vertex AI as
a pool of two locations, gemini-3.1-flash-image answering 429 in both (the
stub's ``429_model``) for as long as the test runs. A request naming
gemini-2.5-flash-image in X-Comfy-Fallback-Models completes on it once
FALLBACK_AFTER_SECONDS have passed, charged its own (lower) price; one naming
none waits on its pool."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from router_queue.settings import DEFAULT_CATALOG
from tests.integration.harness import RunningStack, free_port, stack_env, unique_prompt, wait_for
from tests.redis_servers import PrivateRedis

NEW, OLD = "vertexai/gemini-3.1-flash-image", "vertexai/gemini-2.5-flash-image"
LOCATIONS = ("us-central1", "europe-west4")
AFTER_S = 3.0
EVERYWHERE_429 = "[stub:429_model=gemini-3.1-flash-image]"
#: The fallback's price here, under the path model's 39: the charge is the price of the model that ran.
OLD_PRICE = 20


def vertex_pool_catalog(directory: Path) -> Path:
    raw = json.loads(Path(DEFAULT_CATALOG).read_text())
    raw["providers"]["vertexai"] = {"members": [
        {"name": loc, "max_in_flight": 4, "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"},
         "project": "comfy-router", "location": loc} for loc in LOCATIONS]}
    raw["models"][OLD]["price_credits"] = OLD_PRICE
    path = directory / "vertex-pool.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    server = PrivateRedis(tmp_path_factory.mktemp("fallback-redis"), persist=False)
    server.start()
    try:
        env = stack_env(server.url, stub_port=free_port(),
                        catalog=vertex_pool_catalog(tmp_path_factory.mktemp("fallback")),
                        MEMBER_GROW_SECONDS="1", FALLBACK_AFTER_SECONDS=str(AFTER_S))
        with RunningStack.start(env, tmp_path_factory.mktemp("fallback-logs"), label="fallback stack") as running:
            yield running
    finally:
        server.stop()


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
