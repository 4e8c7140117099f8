"""The batch phase (issue 35), on a fleet of its own: ``batch_admission_throughput`` (requests admitted per
second through one 10,000-line batch call against single submits per second on the same stack, with the Redis
commands each admitted line cost) and ``interactive_wait_with_batch`` (the p50 queue wait of another
workspace's interactive requests while a 10,000-line batch waits on the same capped provider, against none; and
the same with the batching workspace's max_in_flight one below the provider's cap)."""

import json
import statistics
import time

import requests

from . import core
from .core import CAPPED_MODEL_ID, CAPPED_PROVIDER, Context, MeasurementError, emit, log, phase

#: Lines in the batch; single submits timed against it, from SUBMITTERS threads.
LINES, SINGLES, SUBMITTERS = 10_000, 2_000, 16
#: The capped provider's cap in this fleet's catalog: the batch's lines wait behind it, run at LINE_LATENCY_S.
WAIT_CAP, LINE_LATENCY_S = 16, 0.2
#: Interactive requests timed (sequential, one at a time) per side, and seconds allowed for the batch to drain.
INTERACTIVE, DRAIN_TIMEOUT_S = 100, 300.0
#: The holder's stub seconds: it keeps the capped slots busy while the admission figure is taken.
HOLD_S = 600


def _body(text: str) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}]}


def _commands(client) -> int:
    return int(client.info("stats")["total_commands_processed"])


def _send_batch(fleet: core.Fleet, auth: dict[str, str], label: str, latency: float) -> str:
    lines = "".join(json.dumps({"model": CAPPED_MODEL_ID, "body": _body(fleet.prompt(f"{label}{i}", latency))})
                    + "\n" for i in range(LINES))
    answer = requests.post(f"{fleet.base}/v2/batches", data=lines.encode(),
                           headers={**auth, "Content-Type": "application/x-ndjson"}, timeout=120)
    if answer.status_code != 201:
        raise MeasurementError(f"the batch was refused: {answer.status_code} {answer.text[:200]}")
    return answer.json()["batch_id"]


def _drained(fleet: core.Fleet, workspace: str, batch_id: str) -> None:
    def done() -> bool:
        batch = fleet.services.batches.get(workspace, batch_id) or {}
        return int(batch.get("cursor", 0)) >= LINES
    core.wait_until(done, DRAIN_TIMEOUT_S, f"batch {batch_id} not drained", 0.02, fleet.alive)


def _admission(fleet: core.Fleet) -> None:
    """Both sides admit vertexai requests that wait behind slots held by long generations: nothing runs."""
    holders = [fleet.submit(json.dumps(_body(fleet.prompt(f"hold{i}", HOLD_S))), CAPPED_MODEL_ID)
               for i in range(WAIT_CAP)]
    fleet.wait_records(holders, core.IN_PROGRESS, timeout_s=60)
    bodies = [json.dumps(_body(fleet.prompt(f"single{i}", 0))) for i in range(SINGLES)]
    fleet.submit_all(bodies[:100], CAPPED_MODEL_ID, SUBMITTERS)  # warm-up
    before, began = _commands(fleet.client), time.perf_counter()
    fleet.submit_all(bodies[100:], CAPPED_MODEL_ID, SUBMITTERS)
    single_s = time.perf_counter() - began
    single_rate = (SINGLES - 100) / single_s
    single_cost = (_commands(fleet.client) - before) / (SINGLES - 100)
    before, began = _commands(fleet.client), time.perf_counter()
    batch_id = _send_batch(fleet, fleet.auth, "line", 0)
    answered_s = time.perf_counter() - began
    _drained(fleet, fleet.workspace, batch_id)
    batch_s = time.perf_counter() - began
    batch_cost = (_commands(fleet.client) - before) / LINES
    log(f"batch_admission: {SINGLES - 100} single submits in {single_s:.2f} s ({single_cost:.1f} Redis commands "
        f"each, the rate checks included); a {LINES}-line batch answered in {answered_s:.2f} s and admitted in "
        f"{batch_s:.2f} s ({batch_cost:.2f} Redis commands per line, staging, drain and polling included)")
    emit("batch_admission_throughput", LINES / batch_s, "requests/s", single_rate)
    emit("batch_redis_commands_per_line", batch_cost, "commands", single_cost)


def _waits(fleet: core.Fleet, auth: dict[str, str]) -> list[float]:
    """Queue waits (started_at - created_at, s) of INTERACTIVE sequential submits of another workspace."""
    post = {**auth, "Content-Type": "application/json"}
    waits = []
    for i in range(INTERACTIVE):
        request_id = fleet.submit(json.dumps(_body(fleet.prompt(f"interactive{i}", 0))), CAPPED_MODEL_ID, post)
        row = fleet.wait_records([request_id], timeout_s=60, interval_s=0.005)[request_id]
        waits.append(float(row["started_at"]) - float(row["created_at"]))
    return waits


@phase("batches", "own_fleet", 30)
def measure_batches(ctx: Context) -> None:
    with ctx.children.scope():
        fleet = core.Fleet(ctx.children, ctx.redis_url, caps={CAPPED_PROVIDER: WAIT_CAP},
                           log_prefix="batches-", extra_env={"MAX_OPEN_BATCHES_PER_WORKSPACE": "100"}).start()
        other = core.new_workspace(fleet.services, "bench-interactive")
        other_auth = {"X-API-Key": fleet.services.accounts.mint_key(other)}
        alone = _waits(fleet, other_auth)
        batcher = core.new_workspace(fleet.services, "bench-batcher")
        batcher_auth = {"X-API-Key": fleet.services.accounts.mint_key(batcher)}
        batch_id = _send_batch(fleet, batcher_auth, "waiting", LINE_LATENCY_S)
        _drained(fleet, batcher, batch_id)
        counts = core.schedule_counts(fleet.client, CAPPED_PROVIDER)
        if counts["queued"] < LINES // 2:
            raise MeasurementError(f"interactive_wait_with_batch: only {counts['queued']} lines wait; the figure "
                                   "needs the batch queued")
        beside = _waits(fleet, other_auth)
        left = core.schedule_counts(fleet.client, CAPPED_PROVIDER)["queued"]
        if not left:
            raise MeasurementError("interactive_wait_with_batch: the batch's lines ran out while the interactive "
                                   "requests were timed; the figure needs them queued throughout")
        log(f"interactive_wait_with_batch: waits alone p50 {1000 * statistics.median(alone):.2f} ms, beside the "
            f"batch p50 {1000 * statistics.median(beside):.2f} ms; {counts['queued']} lines queued before, "
            f"{left} after")
        emit("interactive_wait_with_batch", 1000 * statistics.median(beside), "ms", 1000 * statistics.median(alone))
        # The same with the batching workspace held to one slot fewer than the provider's cap (its
        # max_in_flight, an operator's per-workspace limit): a slot is then always free for another.
        fleet.services.accounts.set_limits(batcher, max_in_flight=WAIT_CAP - 1)
        time.sleep(2 * LINE_LATENCY_S + 0.5)  # the lines running past the new limit end
        held = _waits(fleet, other_auth)
        if not core.schedule_counts(fleet.client, CAPPED_PROVIDER)["queued"]:
            raise MeasurementError("interactive_wait_with_batch_held_back: the batch's lines ran out")
        log(f"interactive_wait_with_batch_held_back: p50 {1000 * statistics.median(held):.2f} ms")
        emit("interactive_wait_with_batch_held_back", 1000 * statistics.median(held), "ms",
             1000 * statistics.median(alone))
        requests.put(f"{fleet.base}/v2/batches/{batch_id}/cancel", headers=batcher_auth, timeout=120)
        _admission(fleet)
