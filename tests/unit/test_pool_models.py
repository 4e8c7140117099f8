"""A pool's room per model (docs/POOLS.md, "Capacity per model"): a 429
pauses one model on its member, so a pool paused everywhere by one model's
429s still grants another model's requests and those that named a fallback,
while the paused model's own wait in the fair queue without holding a slot;
on fakeredis and a real Redis."""

from __future__ import annotations

import pytest

from router_queue.requests.record import Submission
from router_queue.states import IN_QUEUE
from router_queue.store import keys
from router_queue.store.members import capacities, read_states
from tests.unit.fallback_support import NEW, OLD
from tests.unit.support import pooled


@pytest.fixture
def pool(services, tmp_path):
    """Vertex AI as two locations of 2 slots each, its capacity read at every grant on a clock moved by hand."""
    return pooled(services, tmp_path)


def submit(services, workspace, model=NEW, fallback=""):
    request_id = services.ids.mint(workspace, model)
    assert services.store.admit(Submission(request_id=request_id, workspace=workspace, model=model,
                                           provider="vertexai", body="{}", fallback_models=fallback)).outcome == "ADMITTED"
    return request_id


def granted(services):
    return [i.decode() for i in services.redis.zrange(f"{keys.schedule('vertexai')}:granted", 0, -1)]


def pause_everywhere(services, model, seconds=60):
    for member in services.catalog.members("vertexai"):
        services.members.rate_limited("vertexai", member, seconds, model=model)


def test_a_models_429s_leave_the_pool_to_the_other_model_and_to_fallbacks(pool, workspace):
    pause_everywhere(pool, NEW)  # each learned cap halved: 1 + 1
    assert capacities(read_states(pool.redis, "vertexai", pool.catalog.members("vertexai")), pool.clock()) == (
        2, f"{NEW}=0")
    other = pool.accounts.create_workspace("other", queue_enabled=True, credits=10**6)
    held = submit(pool, workspace)  # NEW, nothing to fall back to: waits, holding nothing
    falls_back = submit(pool, workspace, fallback=OLD)
    old = submit(pool, other, model=OLD)
    assert granted(pool) == [falls_back, old]  # granted behind the held one, in their turn
    assert held not in granted(pool) and pool.store.status_view(held, "vertexai").record.status == IN_QUEUE
    late = submit(pool, other, model=OLD)
    assert late not in granted(pool)  # the pool's cap (its learned caps, 2) still holds


def test_a_request_passed_over_for_its_models_pause_keeps_its_turn(pool, workspace):
    pause_everywhere(pool, NEW, seconds=30)
    other = pool.accounts.create_workspace("other", queue_enabled=True, credits=10**6)
    held = submit(pool, workspace)
    first = submit(pool, other, model=OLD)
    then = [submit(pool, other, model=OLD) for _ in range(2)]
    assert granted(pool) == [first, then[0]]
    pool.clock.now += 31  # the pause is over; the learned caps (1 each) grow back later
    pool.store.grant("vertexai")
    assert granted(pool) == [first, then[0]]  # no slot free: nothing jumps
    for request_id in (first, then[0]):
        pool.store.cancel(request_id=request_id, workspace=other, model=OLD, provider="vertexai")
    assert granted(pool) == [held, then[1]]  # its workspace's turn came first


def test_with_no_model_paused_the_grant_reads_nothing_more(pool, workspace):
    """The common case: the cap passed with the regions' rooms alone (no model
    below it), the fast path as before."""
    assert pool.store._granting("vertexai", 0.0)[2] == "4;@europe-west4=2,@us-central1=2"
    request_id = submit(pool, workspace)
    assert granted(pool) == [request_id]
    pause_everywhere(pool, OLD)
    assert pool.store._granting("vertexai", 0.0)[2] == f"2;{OLD}=0,@europe-west4=1,@us-central1=1"
    direct = pool.store.admit(Submission(request_id=pool.ids.mint(workspace, NEW), workspace=workspace, model=NEW,
                                         provider="vertexai", body="{}"))
    assert direct.position == 1 and len(granted(pool)) == 2  # its model has room: granted in its admission
    old = submit(pool, workspace, model=OLD)
    assert old not in granted(pool)


def test_a_request_whose_model_has_no_room_is_not_granted_in_its_admission(pool, workspace):
    pause_everywhere(pool, NEW)
    held = submit(pool, workspace)
    assert granted(pool) == [] and pool.store.status_view(held, "vertexai").position == 0
