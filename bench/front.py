"""The front-door phases: the front door against a hello world served alike, loaded by wrk in interleaved
rounds; then hostile bodies and history pages, each timed on one keep-alive connection."""

import json
import re
import statistics
import subprocess
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlencode, urlsplit

from . import core, schedule
from .core import CAPPED_MODEL_ID, MODEL_ID, WEB_WORKERS, Context, KeepAlive, MeasurementError, emit, log, phase

SUBMIT_BODY = '{"prompt": "bench"}'
APP = "router_queue.wsgi:app"
#: wrk's threads and connections; seconds of a measured run and of each target's warm-up; rounds of a pair.
WRK_LOAD, DURATION_S, WARMUP_S, ROUNDS = ("-t2", "-c16"), 5, 2, 3
#: depth: requests ahead of the deep and of the near read, workspaces they are spread over, rounds.
DEPTH, NEAR, DEPTH_WORKSPACES, DEPTH_ROUNDS = 100_000, 10, 1000, 5
#: hostile_body_ratio: bytes of every body (under the front door's 1 MiB limit), interleaved rounds.
BODY_SIZE, HOSTILE_ROUNDS = 1_000_000, 15
#: history_paging: entries per page (the most the route lists); one in this many requests is left waiting,
#: the rest cancelled; requests in the history; interleaved rounds of first- and last-page reads, reads of
#: each page per round.
PAGE_LIMIT, WAITING_ONE_IN, HISTORY_REQUESTS, HISTORY_ROUNDS, READS_PER_ROUND = 100, 10, 100_000, 15, 10


@dataclass
class Target:
    """One side of a pair: one request sent over and over, an optional check before each run."""

    label: str
    method: str
    url: str
    status: int
    headers: dict[str, str]
    body: str = ""
    enter: Callable[[], None] | None = None
    script: Path | None = None  # the wrk script, written at the first run
    answered: int = 0  # answers with the expected status over the measured runs


class FrontDoor:
    """The front door and the hello world, both served (gunicorn, bench children), and a seeded workspace's key."""

    def __init__(self, ctx: Context):
        self.wrk = core.tool("wrk")
        self.services = core.services_for(ctx.redis_url)
        self.entry = self.services.catalog.by_id(core.MODEL_ID)
        # limits out of reach: every call still pays for the checks, none is refused by them
        self.auth = {"X-API-Key": self.services.accounts.mint_key(core.new_workspace(self.services, "bench"))}
        self.post_headers = {**self.auth, "Content-Type": "application/json"}
        self.env = core.server_env(ctx.redis_url)
        self.url = core.start_gunicorn(ctx.children, "frontdoor", APP, self.env, WEB_WORKERS)
        self.hello = core.start_gunicorn(ctx.children, "hello", "bench.hello:app", self.env, WEB_WORKERS)
        self.submit_url = f"{self.url}/v2/models/{core.MODEL_ID}/requests"

    def get(self, what: str, url: str, headers: dict[str, str] | None = None, **kwargs) -> Target:
        return Target(what, "GET", url, 200, headers or self.auth, **kwargs)

    def post(self, what: str, url: str) -> Target:
        return Target(what, "POST", url, 201, self.post_headers, SUBMIT_BODY)

    def queued_request(self) -> str:
        """A request submitted now (it stays queued: no worker runs)."""
        return core.http_json("POST", self.submit_url, self.post_headers, SUBMIT_BODY, 201)["request_id"]


#: The wrk script of a target: counts answers with and without the expected status.
_LUA = """wrk.method = {method}
wrk.body = {body}
{headers}
local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) expected = 0; unexpected = 0 end
function response(status, headers, body)
  if status == {status} then expected = expected + 1 else unexpected = unexpected + 1 end
end
function done(summary, latency, requests)
  local e, u, s = 0, 0, summary.errors
  for _, t in ipairs(threads) do e = e + t:get("expected"); u = u + t:get("unexpected") end
  io.write(string.format("BENCHLUA %d %d %d %d %d\\n", e, u, summary.requests, summary.duration,
                         s.connect + s.read + s.write + s.timeout))
end
"""


def _run(ctx: Context, target: Target, seconds: int = DURATION_S, what: str = "") -> tuple[float, int]:
    """One wrk run on ``target``, its answers checked unless ``what`` is empty (a warm-up): (req/s, requests)."""
    if target.enter:
        target.enter()
    if target.script is None:
        target.script = ctx.tmp / f"shot-{id(target)}.lua"
        # a JSON string of ASCII text is a Lua string literal too
        headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in target.headers.items())
        target.script.write_text(_LUA.format(method=json.dumps(target.method), body=json.dumps(target.body),
                                             headers=headers, status=target.status))
    argv = [ctx.front.wrk, *WRK_LOAD, f"-d{seconds}s", "--timeout", "10s", "-s", str(target.script), target.url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0 or not (found := re.search(r"BENCHLUA (\d+) (\d+) (\d+) (\d+) (\d+)", done.stdout)):
        raise MeasurementError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    expected, unexpected, requests, duration_us, socket_errors = map(int, found.groups())
    if what and (expected == 0 or expected < unexpected):
        raise MeasurementError(f"{what}: only {expected} of {expected + unexpected} answers were {target.status} "
                               f"({socket_errors} socket errors); the figure would be meaningless")
    if what and (unexpected or socket_errors):
        log(f"warning: {what}: {unexpected} answers were not {target.status}, {socket_errors} socket errors")
    if what:
        target.answered += expected
        log(f"{what}: {requests / (duration_us / 1e6):.4g} req/s")
    return requests / (duration_us / 1e6), requests


def measure_pair(ctx: Context, name: str, baseline: Target, subject: Target, figure: str, unit: str = "req/s",
                 rounds: int = ROUNDS, value: Callable[[Target], float] | None = None,
                 check: Callable[[], None] | None = None) -> None:
    """Warm both up, then ``rounds`` x (baseline, subject); emits ``figure`` from the round with the median
    subject/baseline ``value`` (default: the rate), once ``check()`` (if given) passed."""
    measure = value or (lambda target: _run(ctx, target, what=f"{name} {target.label}")[0])
    for target in (baseline, subject):
        _run(ctx, target, WARMUP_S)
    b, s = core.median_round(name, [(measure(baseline), measure(subject)) for _ in range(rounds)])
    if check:
        check()
    emit(figure, s, unit, b)


@phase("status_read", "front", 10)
def status_read(ctx: Context) -> None:
    front = ctx.front
    url = f"{front.submit_url}/{front.queued_request()}/status"
    core.http_json("GET", url, front.auth)  # answered 200
    measure_pair(ctx, "status_read", front.get("hello GET", f"{front.hello}/hello"), front.get("status read", url),
                 "status_read_throughput")


@phase("floor", "front", 20)
def floor(ctx: Context) -> None:
    """One Redis round trip on the hello world: the floor under any read that must touch Redis."""
    front = ctx.front
    measure_pair(ctx, "floor", front.get("hello GET", f"{front.hello}/hello"),
                 front.get("hello + one Redis INCR", f"{front.hello}/hello/redis"), "one_redis_round_trip_throughput")


@phase("submit", "front", 30)
def submit(ctx: Context) -> None:
    front = ctx.front
    before = core.schedule_counts(front.services.redis, front.entry.provider)["queued"]
    subject = front.post("submit", front.submit_url)

    def index_grew() -> None:  # warm-up submits grew the index too; every measured 201 must be in it
        grown = core.schedule_counts(front.services.redis, front.entry.provider)["queued"] - before
        if grown < subject.answered:
            raise MeasurementError(f"submit: {subject.answered} answers were 201 but the queue index grew by {grown}")

    measure_pair(ctx, "submit", front.post("hello POST", f"{front.hello}/hello"), subject, "submit_throughput",
                 check=index_grew)


@contextmanager
def _replica_front(ctx: Context, name: str, env_for: Callable[[str], dict[str, str]]):
    """A replica of the bench's Redis and a third front door with ``env_for(replica URL)``; yields its URL."""
    with ctx.children.scope():
        replica = core.start_redis(ctx.children, "redis-replica", "--replicaof", "127.0.0.1",
                                   str(urlsplit(ctx.redis_url).port))
        core.wait_until(lambda: ctx.front.services.redis.info("replication").get("connected_slaves") == 1, 30,
                        f"{name}: the replica did not connect", 0.1)
        yield core.start_gunicorn(ctx.children, f"frontdoor-{name}", APP, dict(ctx.front.env, **env_for(replica)),
                                  WEB_WORKERS)


@phase("replicated", "front", 40)
def replicated(ctx: Context) -> None:
    """What REDIS_WAIT_REPLICAS=1 costs a submit (a front door that WAITs for a replica after each admission)."""
    front = ctx.front
    with _replica_front(ctx, "wait", lambda _: {"REDIS_WAIT_REPLICAS": "1"}) as waiting:
        measure_pair(ctx, "replicated", front.post("submit", front.submit_url),
                     front.post("submit, WAIT 1 replica", f"{waiting}/v2/models/{core.MODEL_ID}/requests"),
                     "submit_throughput_wait_1_replica")


@phase("replica_reads", "front", 45)
def replica_reads(ctx: Context) -> None:
    """The primary's CPU per status poll when a front door with REDIS_READ_URL at a replica serves them."""
    front, primary = ctx.front, ctx.front.services.redis
    path = f"/v2/models/{core.MODEL_ID}/requests/{front.queued_request()}/status"

    def cpu_per_poll(target: Target) -> float:
        before = core.redis_cpu(primary)
        requests = _run(ctx, target, what=f"replica_reads {target.label}")[1]
        return 1000.0 * (core.redis_cpu(primary) - before) / requests

    with _replica_front(ctx, "replica", lambda url: {"REDIS_READ_URL": url}) as reading:
        measure_pair(ctx, "replica_reads", front.get("status read, primary", front.url + path),
                     front.get("status read, replica", reading + path), "status_primary_cpu_with_replica", "ms",
                     value=cpu_per_poll)


def _depth_side(ctx: Context, which: str, ahead: int, db: int, catalog_path: Path) -> Target:
    """Seed database ``db`` with ``ahead`` requests before the target and serve it: its target."""
    front, url = ctx.front, ctx.db_url(db)
    side = core.services_for(url, catalog_path)
    side.redis.flushdb()
    workspace_id, request_id = schedule.seed_behind(side, front.entry, ahead, DEPTH_WORKSPACES, SUBMIT_BODY)
    auth = {"X-API-Key": side.accounts.mint_key(workspace_id)}
    side_front = core.start_gunicorn(ctx.children, f"frontdoor-{which}", APP,
                                     dict(front.env, REDIS_URL=url, CATALOG_PATH=str(catalog_path)), WEB_WORKERS)
    status_url = f"{side_front}/v2/models/{core.MODEL_ID}/requests/{request_id}/status"

    def position_holds() -> None:
        if (position := core.http_json("GET", status_url, auth).get("queue_position")) != ahead:
            raise MeasurementError(f"depth: a status read gave queue_position={position}, expected {ahead}")

    return front.get(f"behind {ahead}", status_url, auth, enter=position_holds)


@phase("depth", "front", 50)
def depth(ctx: Context) -> None:
    catalog_path = core.capped_catalog(ctx.tmp, {ctx.front.entry.provider: 1})
    with ctx.children.scope():
        near = _depth_side(ctx, "near", NEAR, core.SIDE_DBS[0], catalog_path)
        deep = _depth_side(ctx, "deep", DEPTH, core.SIDE_DBS[1], catalog_path)
        measure_pair(ctx, "depth", near, deep, "status_read_cost_behind_100k", "ms", DEPTH_ROUNDS,
                     lambda target: 1000.0 / _run(ctx, target, what=f"depth {target.label}")[0])


def _compact(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _fill(make: Callable[[int], object]) -> bytes:
    """``make(n)`` for the largest n (doubling, then bisecting) whose JSON fits ``BODY_SIZE`` bytes."""
    low, high = 1, 2
    while len(_compact(make(high))) <= BODY_SIZE:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(_compact(make(middle))) <= BODY_SIZE else (low, middle)
    return _compact(make(low))


def _turn(*parts: dict) -> dict:
    return {"role": "user", "parts": list(parts)}


def hostile_bodies() -> dict[str, bytes]:
    """The plain body first, then each hostile kind, each about ``BODY_SIZE`` bytes."""
    plain = _compact({"contents": [_turn({"text": ""})]})
    return {
        "plain": _compact({"contents": [_turn({"text": "a" * (BODY_SIZE - len(plain))})]}),
        # the report's body: a valid prompt and 90,000 unknown keys
        "unknown_keys": _fill(lambda n: {"contents": [_turn({"text": "a cat"})], **{f"k{i}": 1 for i in range(n)}}),
        # lists nested as deep as the JSON parser goes, where a part's text belongs
        "deeply_nested": b'{"contents":[{"parts":[{"text":' + b"[" * (BODY_SIZE // 2 - 40)
                         + b"]" * (BODY_SIZE // 2 - 40) + b"}]}]}",
        # every list at its maximum length (64 turns of 4 parts), every item wrong, the data filling the megabyte
        "max_length_lists": _fill(lambda n: {"contents": [
            {"role": "robot", "parts": [{"inlineData": {"mimeType": 1, "data": "a" * n}}] * 4}] * 64}),
        "many_small_parts": _fill(lambda n: {"contents": [_turn(*[{"text": "a"}] * n)]}),
        "huge_key": _fill(lambda n: {"contents": [_turn({"text": "a cat"})], "k" * n: 1}),
    }


@phase("hostile_body_ratio", "front", 60)
def hostile_body_ratio(ctx: Context) -> None:
    path, headers, cases = f"/v2/models/{CAPPED_MODEL_ID}/requests", ctx.front.post_headers, hostile_bodies()
    timings: dict[str, list[float]] = {name: [] for name in cases}
    statuses: dict[str, int] = {}
    with closing(KeepAlive(ctx.front.url)) as connection:
        for body in cases.values():  # warm-up: each kind once
            connection.call("POST", path, None, body, headers)
        for _ in range(HOSTILE_ROUNDS):
            for name, body in cases.items():
                ms, statuses[name], _ = connection.call("POST", path, None, body, headers)
                timings[name].append(ms)
    if statuses.pop("plain") != 201:
        raise MeasurementError("hostile_body_ratio: the plain 1 MB prompt was not answered 201")
    if refused := {name: status for name, status in statuses.items() if not 400 <= status < 500}:
        raise MeasurementError(f"hostile_body_ratio: hostile bodies not refused: {refused}")
    plain = statistics.median(timings["plain"])
    for name in statuses:
        emit(f"hostile_body_ratio_{name}", statistics.median(timings[name]), "ms", plain)
    emit("hostile_body_ratio", max(statistics.median(timings[name]) for name in statuses), "ms", plain)


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
def history_paging(ctx: Context) -> None:
    services = ctx.front.services
    entry = services.catalog.by_id(MODEL_ID)
    workspace = core.new_workspace(services, "history-bench")
    ids = schedule.seed_spread(services, [workspace], entry, HISTORY_REQUESTS, '{"prompt": "history"}')
    schedule.cancel_all(services, [i for n, i in enumerate(ids) if n % WAITING_ONE_IN], workspace, entry)
    with closing(KeepAlive(ctx.front.url, {"X-API-Key": services.accounts.mint_key(workspace)})) as connection:
        for name, query, expected in (
                ("history_paging", {"limit": PAGE_LIMIT}, ids[::-1]),
                ("history_paging_filtered", {"limit": PAGE_LIMIT, "status": "IN_QUEUE"},
                 ids[::WAITING_ONE_IN][::-1])):
            listed, last = _walk(connection, query)
            if listed != expected:
                raise MeasurementError(f"{name}: the walk listed {len(listed)} requests ({len(set(listed))} "
                                       f"distinct), not the {len(expected)} expected, newest first")
            for page in (query, last):  # warm-up
                _page(connection, page)
            times: tuple[list[float], list[float]] = ([], [])
            ratios = []
            for _ in range(HISTORY_ROUNDS):
                for _ in range(READS_PER_ROUND):
                    for series, page in zip(times, (query, last)):
                        series.append(_page(connection, page)[0])
                this_round = [statistics.median(series[-READS_PER_ROUND:]) for series in times]
                ratios.append(this_round[1] / this_round[0])
            log(f"{name}: per-round ratios (last / first): " + " ".join(f"{r:.3f}" for r in ratios))
            emit(name, statistics.median(times[1]), "ms", statistics.median(times[0]))
