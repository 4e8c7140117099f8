"""``history_paging``: the last page of a 100,000-request history (``GET /v2/requests``) against its
first page, plain and filtered, read interleaved on one keep-alive connection."""

from __future__ import annotations

import statistics
import time
from typing import Any
from urllib.parse import urlencode

from . import schedule
from .core import MODEL_ID, Context, KeepAlive, MeasurementError, emit, log, new_workspace, option, phase

#: Entries per page (the most the route lists).
LIMIT = 100
#: One in this many requests is left waiting; the rest are cancelled.
WAITING_ONE_IN = 10
#: Reads of each page per round.
READS_PER_ROUND = 10


def _path(query: dict[str, Any]) -> str:
    return "/v2/requests?" + urlencode(query)


def _walk(connection: KeepAlive, query: dict[str, Any]) -> tuple[list[str], str, int, float]:
    """Every page from the first: (ids listed, the last page's cursor, pages, seconds)."""
    ids: list[str] = []
    cursor, last_cursor, pages = None, "", 0
    began = time.perf_counter()
    while True:
        _, status, body = connection.get_json(_path({**query, **({"cursor": cursor} if cursor else {})}))
        if status != 200:
            raise MeasurementError(f"history_paging: page {pages + 1} answered {status}: {body}")
        pages += 1
        ids += [entry["request_id"] for entry in body["requests"]]
        if body["next_cursor"] is None:
            return ids, last_cursor, pages, time.perf_counter() - began
        last_cursor = cursor = body["next_cursor"]


def _compare(connection: KeepAlive, first: str, last: str, rounds: int) -> tuple[float, float, list[float]]:
    """Medians (ms) of the first and the last page, read interleaved; the per-round ratios."""
    first_ms: list[float] = []
    last_ms: list[float] = []
    ratios = []
    for path in (first, last):  # warm-up
        connection.get_json(path)
    for _ in range(rounds):
        this_round: tuple[list[float], list[float]] = ([], [])
        for _ in range(READS_PER_ROUND):
            for times, path in zip(this_round, (first, last)):
                ms, status, body = connection.get_json(path)
                if status != 200 or not body["requests"]:
                    raise MeasurementError(f"history_paging: {path} answered {status} with "
                                           f"{len(body.get('requests', []))} entries")
                times.append(ms)
        first_ms += this_round[0]
        last_ms += this_round[1]
        ratios.append(statistics.median(this_round[1]) / statistics.median(this_round[0]))
    return statistics.median(first_ms), statistics.median(last_ms), ratios


def add_arguments(parser) -> None:
    group = parser.add_argument_group("request history (history_paging)")
    option(group, "--history-requests", 100_000, "requests in the workspace's history")
    option(group, "--history-rounds", 15, "interleaved rounds of first- and last-page reads")


@phase("history_paging", "front", 70)
def measure(ctx: Context) -> None:
    services, front_url = ctx.front.services, ctx.front.url
    count, rounds = ctx.args.history_requests, ctx.args.history_rounds
    entry = services.catalog.by_id(MODEL_ID)
    workspace = new_workspace(services, "history-bench")
    began = time.perf_counter()
    ids = schedule.seed_spread(services, [workspace], entry, count, '{"prompt": "history"}')
    cancelled = [request_id for n, request_id in enumerate(ids) if n % WAITING_ONE_IN]
    schedule.cancel_all(services, cancelled, workspace, entry)
    log(f"history_paging: admitted {count} requests (RequestStore.admit, pipelined) and cancelled "
        f"{len(cancelled)} in {time.perf_counter() - began:.1f} s")
    from router_queue.store import keys

    indexed = services.redis.xlen(keys.history(workspace))
    if indexed != count:
        raise MeasurementError(f"history_paging: the history index holds {indexed} entries, not {count}")

    connection = KeepAlive(front_url, {"X-API-Key": services.accounts.mint_key(workspace)})
    try:
        for name, query, expected in (
                ("history_paging", {"limit": LIMIT}, ids[::-1]),
                ("history_paging_filtered", {"limit": LIMIT, "status": "IN_QUEUE"},
                 [i for n, i in enumerate(ids) if not n % WAITING_ONE_IN][::-1])):
            listed, last_cursor, pages, seconds = _walk(connection, query)
            if listed != expected:
                raise MeasurementError(f"{name}: the walk listed {len(listed)} requests ({len(set(listed))} distinct), "
                                 f"not the {len(expected)} expected, newest first")
            log(f"{name}: walked {pages} pages ({len(listed)} requests, each once, newest first) in "
                f"{seconds:.1f} s, {1000 * seconds / pages:.2f} ms per page")
            # one page only (a small --history-requests): the last page is the first
            first, last = _path(query), _path({**query, "cursor": last_cursor}) if last_cursor else _path(query)
            first_ms, last_ms, ratios = _compare(connection, first, last, rounds)
            log(f"{name}: per-round ratios (last / first): " + " ".join(f"{r:.3f}" for r in ratios))
            emit(name, last_ms, "ms", first_ms)
    finally:
        connection.close()
