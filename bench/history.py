"""``history_paging``: the last page of a 100,000-request history (``GET /v2/requests``) against its
first page, plain and filtered, read interleaved on one keep-alive connection."""

import json
import statistics
from contextlib import closing
from typing import Any
from urllib.parse import urlencode

from . import schedule
from .core import MODEL_ID, Context, KeepAlive, MeasurementError, emit, log, new_workspace, phase

#: Entries per page (the most the route lists); one in this many requests is left waiting, the rest cancelled.
LIMIT, WAITING_ONE_IN = 100, 10
#: Requests in the history; interleaved rounds of first- and last-page reads, reads of each page per round.
REQUESTS, ROUNDS, READS_PER_ROUND = 100_000, 15, 10


def _page(connection: KeepAlive, query: dict[str, Any]) -> tuple[float, dict]:
    """(ms, answer) of one page, which must be answered 200 and list something."""
    ms, _, data = connection.call("GET", "/v2/requests?" + urlencode(query), 200)
    if not (body := json.loads(data))["requests"]:
        raise MeasurementError(f"history_paging: {query} listed nothing")
    return ms, body


def _walk(connection: KeepAlive, query: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Every page from the first: (ids listed, the last page's query)."""
    ids: list[str] = []
    last = query
    while True:
        body = _page(connection, last)[1]
        ids += [entry["request_id"] for entry in body["requests"]]
        if body["next_cursor"] is None:
            return ids, last
        last = {**query, "cursor": body["next_cursor"]}


@phase("history_paging", "front", 70)
def measure(ctx: Context) -> None:
    services = ctx.front.services
    entry = services.catalog.by_id(MODEL_ID)
    workspace = new_workspace(services, "history-bench")
    ids = schedule.seed_spread(services, [workspace], entry, REQUESTS, '{"prompt": "history"}')
    schedule.cancel_all(services, [i for n, i in enumerate(ids) if n % WAITING_ONE_IN], workspace, entry)
    with closing(KeepAlive(ctx.front.url, {"X-API-Key": services.accounts.mint_key(workspace)})) as connection:
        for name, query, expected in (
                ("history_paging", {"limit": LIMIT}, ids[::-1]),
                ("history_paging_filtered", {"limit": LIMIT, "status": "IN_QUEUE"}, ids[::WAITING_ONE_IN][::-1])):
            listed, last = _walk(connection, query)
            if listed != expected:
                raise MeasurementError(f"{name}: the walk listed {len(listed)} requests ({len(set(listed))} "
                                       f"distinct), not the {len(expected)} expected, newest first")
            for page in (query, last):  # warm-up
                _page(connection, page)
            times: tuple[list[float], list[float]] = ([], [])
            ratios = []
            for _ in range(ROUNDS):
                for _ in range(READS_PER_ROUND):
                    for series, page in zip(times, (query, last)):
                        series.append(_page(connection, page)[0])
                this_round = [statistics.median(series[-READS_PER_ROUND:]) for series in times]
                ratios.append(this_round[1] / this_round[0])
            log(f"{name}: per-round ratios (last / first): " + " ".join(f"{r:.3f}" for r in ratios))
            emit(name, statistics.median(times[1]), "ms", statistics.median(times[0]))
