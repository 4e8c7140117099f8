"""The credit ledger: trimmed past its retention as it is written, so a
submit-and-cancel loop cannot grow it without end, and exported a page at a
time by ``router-queue workspace ledger --jsonl`` (fakeredis and real Redis)."""

from __future__ import annotations

import json
import time

from router_queue.cli import main
from router_queue.requests.record import Submission
from router_queue.store import keys
from tests.unit.support import ServicesCliRunner

MODEL = "bfl/flux-2-pro"
PRICE = 60
#: Seconds the test's ledger keeps an entry, and between two of its cycles.
RETENTION_S = 600
CYCLE_S = 60
CYCLES = 300
#: Entries written within one retention: a hold and a release per cycle.
WINDOW = 2 * RETENTION_S // CYCLE_S
#: What trimming whole stream nodes (MINID ~) may leave beside them: one node
#: (Redis's stream-node-max-entries, 100 by default), and the entry at the edge.
NODE_SLACK = 100 + 2


def submit_and_cancel(services, workspace: str, now: float) -> str:
    request_id = services.ids.mint(workspace, MODEL)
    admitted = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl",
                                    body="{}", price=PRICE, now=now))
    assert admitted.outcome == "ADMITTED"
    services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    return request_id


def test_the_ledger_stays_bounded_under_a_submit_and_cancel_loop(services):
    services.store.ledger_retention_s = RETENTION_S
    ws = services.accounts.create_workspace("looping", queue_enabled=True, credits=1000)
    start = time.time()
    ids = [submit_and_cancel(services, ws, start + i * CYCLE_S) for i in range(CYCLES)]
    length = services.redis.xlen(keys.ledger(ws))
    assert length <= WINDOW + NODE_SLACK, f"{2 * CYCLES} entries written, {length} kept"
    kept = [(e.request_id, e.type) for e in services.accounts.ledger(ws, count=10_000)]
    recent = ids[-RETENTION_S // CYCLE_S:]
    assert kept[-WINDOW:] == [(i, kind) for i in recent for kind in ("hold", "release")]
    assert services.accounts.get(ws).credits == 1000  # trimming the record never touches the balance


def test_the_ledger_exports_as_json_lines_between_two_times(services):
    ws = services.accounts.create_workspace("exported", queue_enabled=True, credits=1000)
    start = 1_900_000_000.0  # 2030-03-17T17:46:40Z
    ids = [submit_and_cancel(services, ws, start + i * CYCLE_S) for i in range(5)]
    runner = ServicesCliRunner(services)
    exported = runner.invoke(main, ["workspace", "ledger", ws, "--jsonl", "--since", "2030-03-17T17:47:40Z",
                                    "--until", str(start + 3 * CYCLE_S)])
    assert exported.exit_code == 0, exported.output
    rows = [json.loads(line) for line in exported.output.splitlines()]
    assert [r["request_id"] for r in rows if r["type"] == "hold"] == ids[1:4]
    assert rows[0]["time"] == "2030-03-17T17:47:40.000Z" and rows[0]["at"] == start + CYCLE_S
    assert rows[0]["amount"] == PRICE and rows[0]["held"] == PRICE and rows[0]["balance"] == 1000
    every = [json.loads(line) for line in runner.invoke(main, ["workspace", "ledger", ws, "--jsonl"])
             .output.splitlines()]
    assert len(every) == 10
    refused = runner.invoke(main, ["workspace", "ledger", ws, "--since", "last tuesday"])
    assert refused.exit_code == 2 and "ISO-8601" in refused.output


def test_an_export_reads_the_ledger_in_pages(services):
    ws = services.accounts.create_workspace("paged", queue_enabled=True, credits=1000)
    for i in range(7):
        submit_and_cancel(services, ws, time.time() + i)
    whole = list(services.accounts.ledger_entries(ws))
    assert len(whole) == 14 and list(services.accounts.ledger_entries(ws, page=3)) == whole
    assert list(services.accounts.ledger_entries(ws, since=whole[4].at, page=3)) == whole[4:]
    # a cancel's release, stamped by this clock behind the admissions', takes its hold's ms
    assert list(services.accounts.ledger_entries(ws, since=whole[4].at, until=whole[8].at, page=2)) == whole[4:10]
