"""Provider pools on the real stack (docs/POOLS.md): BFL as two keys, key-a
and key-b, each of its own cap, and the stub answering one key alone with
429s or 401s (its ``429_key`` and ``401_key`` directives)."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from tests.integration.harness import FLUX, RunningStack, unique_prompt, wait_for
from tests.integration.pool_support import pooled_stack

KEYS = {"key-a": "BFL_KEY_A", "key-b": "BFL_KEY_B"}


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    members = [{"name": name, "max_in_flight": 4, "credentials": {"kind": "api_key", "env": variable}}
               for name, variable in KEYS.items()]
    with pooled_stack(tmp_path_factory, "pool", "bfl", members, MEMBER_GROW_SECONDS="1",
                      **{variable: name for name, variable in KEYS.items()}) as running:
        yield running


def by_key(running: RunningStack) -> dict[str, int]:
    return {key.split(":", 1)[1]: n for key, n in running.stub.calls()["by_key"].items()
            if key.startswith("bfl_submit:")}


def charges(running: RunningStack, workspace: str) -> list[str]:
    return [e.request_id for e in running.services.accounts.ledger(workspace) if e.type == "charge"]


@pytest.mark.slow
def test_a_member_answering_429_for_30_s_loses_fails_and_overcharges_nothing(pooled: RunningStack) -> None:
    """key-b answers every call with 429 for 30 s while requests flow: none fails,
    none is charged an attempt or twice, key-a carries them; then key-b is
    served again and takes its share back."""
    before = by_key(pooled)
    ids = []
    with pooled.caller("pool-429") as caller:
        started = time.monotonic()
        while time.monotonic() - started < 30:
            ids.append(caller.submit_ok(FLUX, {"prompt": unique_prompt("b paused", "[stub:429_key=key-b]",
                                                                       "[stub:latency=0.3]")}))
            time.sleep(0.25)
        finals = [caller.wait_status(FLUX, request_id, timeout_s=60) for request_id in ids]
        during = {key: n - before.get(key, 0) for key, n in by_key(pooled).items()}
        assert [f.get("error_type") for f in finals] == [None] * len(ids), [f for f in finals if f.get("error_type")]
        records = [pooled.services.store.status_view(i, "bfl").record for i in ids]
        assert sorted({r.attempts for r in records if r}) == [0]  # no 429 counted as an attempt
        charged = charges(pooled, caller.workspace)
        assert sorted(charged) == sorted(ids)  # each once
        # key-a ran every generation; key-b was asked only when its pause (Retry-After 1 s) had ended
        assert during["key-a"] == len(ids), during
        assert 1 <= during.get("key-b", 0) <= 35, during
        # the 429s over, key-b's learned cap grows back (one a second here) and it takes its share again
        time.sleep(4)
        again = [caller.submit_ok(FLUX, {"prompt": unique_prompt("b back", "[stub:latency=1]")}) for _ in range(8)]
        for request_id in again:
            assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
        assert by_key(pooled).get("key-b", 0) - before.get("key-b", 0) > during.get("key-b", 0)
    print(f"pool: {len(ids)} requests through 30 s of key-b's 429s: key-a ran {during['key-a']}, key-b was asked "
          f"{during.get('key-b', 0)} times (each a 429, uncharged); failed 0, attempts counted 0, charged twice 0")


def test_a_member_whose_key_is_revoked_is_taken_out_and_named(pooled: RunningStack) -> None:
    with pooled.caller("pool-401") as caller:
        ids = [caller.submit_ok(FLUX, {"prompt": unique_prompt("b revoked", "[stub:401_key=key-b]")})
               for _ in range(6)]
        finals = [caller.wait_status(FLUX, request_id) for request_id in ids]
    assert [f.get("error_type") for f in finals] == [None] * len(ids)
    states = {s.member: s for s in pooled.services.members.states("bfl", pooled.services.catalog.members("bfl"))}
    assert states["key-b"].revoked >= 1 and states["key-b"].revoked_until > time.time()
    wait_for(lambda: "member key-b refused our credential (HTTP 401)" in pooled.log_text("worker"),
             timeout_s=5, what="the worker's log naming the refused key")
