"""The phases on a fleet whose big results go to an object store (stage ``objects``): Redis bytes per
finished request, collect throughput against the store's own, and the front door's memory while it
streams (bench/README.md). The stage starts its S3-compatible server itself: moto's, a bench child."""

import hashlib
import http.client
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from router_queue.blobs.store import open_blob_store
from router_queue.dev.stack import free_port, wait_for_port
from router_queue.store import keys

from . import core
from .core import CAPPED_MODEL_ID, Context, Fleet, MeasurementError, emit, log, phase

#: The bucket and prefix the stage's fleet keeps its big results under.
BUCKET, PREFIX = "bench-results", "bench"
#: [stub:size=BYTES] of the small, the 2 MB and the 10 MB outputs (decoded image bytes; the answer is
#: Vertex's JSON with it in base64, about 4/3 of that).
SMALL, BIG, HUGE = 1000, 2_000_000, 10_000_000
#: redis_bytes: finished requests per side and round, interleaved rounds, threads submitting.
MEMORY_REQUESTS, MEMORY_ROUNDS, SUBMITTERS = 100, 3, 8
#: collect_throughput: distinct objects read in turn; wrk's threads and connections (the same for both sides: the
#: front door holds as many GETs open on the store as wrk holds on it), seconds per run and of each side's
#: warm-up, interleaved rounds (many short ones: the neighbours' load on a shared machine changes by the second).
COLLECT_OBJECTS, COLLECT_LOAD, COLLECT_S, COLLECT_WARMUP_S, COLLECT_ROUNDS = 16, ("-t2", "-c8"), 3, 2, 7
#: front_door_rss: clients collecting at once, distinct objects they share, collects per client, RSS samples/s.
RSS_CLIENTS, RSS_OBJECTS, RSS_COLLECTS, RSS_SAMPLE_S = 64, 16, 2, 0.02
#: Bytes a collecting client reads per recv (a client on a fast link).
CLIENT_READ = 64 * 1024


class ObjectStore:
    """moto's S3 server, a bench child, with :data:`BUCKET`; this process's ``AWS_*`` name it (obstore and every
    child read them there)."""

    def __init__(self, children: core.Children):
        port = free_port()
        proc = children.spawn("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              {**os.environ, "MOTO_CALL_RESET_API": "false"})
        wait_for_port(port, timeout_s=30, proc=proc)
        self.pid = proc.pid
        self.endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                          AWS_ENDPOINT_URL=self.endpoint, AWS_ALLOW_HTTP="true")
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket=BUCKET)
        self.url = f"s3://{BUCKET}/{PREFIX}"
        self.blobs = open_blob_store(self.url, allow_http=True)
        log(f"object store up: moto at {self.endpoint}, results under {self.url}")

    def clear(self) -> None:
        """Delete every result object (moto keeps them in its memory; the records are not read again)."""
        if self.blobs is not None:
            self.blobs.delete(self.blobs.keys_under("results"))


def start(ctx: Context) -> Fleet:
    """The stage's object store and a fleet (the shipped caps) whose big results go there."""
    ctx.objects = ObjectStore(ctx.children)
    return Fleet(ctx.children, ctx.redis_url, caps={}, log_prefix="objects-",
                 extra_env={"OBJECT_STORE_URL": ctx.objects.url, "AWS_ALLOW_HTTP": "true"}).start()


def _body(fleet: Fleet, label: str, size: int) -> str:
    prompt = f"bench {label} {os.urandom(8).hex()} [stub:latency=0] [stub:size={size}]"
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": prompt}]}]})


def _finished(fleet: Fleet, label: str, size: int, count: int) -> list[str]:
    """``count`` completed generations of ``size`` output bytes (each collected once, byte-checked); their ids."""
    ids = fleet.submit_all([_body(fleet, label, size) for _ in range(count)], CAPPED_MODEL_ID, SUBMITTERS)
    fleet.wait_records(ids, timeout_s=300)
    pipe = fleet.client.pipeline(transaction=False)
    for request_id in ids:
        pipe.hmget(keys.request(request_id), ("blob_key", "blob_size"))
    pointers = pipe.execute()
    in_store = sum(1 for key, _ in pointers if key)
    if in_store != (count if size > SMALL else 0):
        raise MeasurementError(f"{in_store} of {count} outputs of {size} bytes went to the object store")
    with ThreadPoolExecutor(SUBMITTERS) as pool:
        sizes = list(pool.map(lambda request_id: len(_collect(fleet, request_id)), ids))
    if pointers[0][1] and any(n != int(pointers[0][1]) for n in sizes):
        raise MeasurementError(f"a collect of a {size}-byte generation answered a different length: {sizes[:5]}")
    return ids


def _collect_url(fleet: Fleet, request_id: str) -> str:
    return f"{fleet.base}/v2/models/{CAPPED_MODEL_ID}/requests/{request_id}"


def _collect(fleet: Fleet, request_id: str) -> bytes:
    answer = fleet_session(fleet).get(_collect_url(fleet, request_id), timeout=60)
    if answer.status_code != 200:
        raise MeasurementError(f"collect of {request_id} answered {answer.status_code}: {answer.content[:200]!r}")
    return answer.content


_local = threading.local()


def fleet_session(fleet: Fleet):
    """A keep-alive session per thread with the fleet's key."""
    if getattr(_local, "session", None) is None:
        import requests

        _local.session = requests.Session()
        _local.session.headers.update(fleet.auth)
    return _local.session


def _used_memory(fleet: Fleet) -> int:
    """Bytes Redis holds for data: ``used_memory`` less its clients' buffers (hundreds of worker connections'
    query buffers grow and shrink with traffic, not with what a request keeps)."""
    time.sleep(1.0)  # what a completion left to the sweeper or to lazy frees settles first
    info = fleet.client.info("memory")
    return int(info["used_memory"]) - int(info["mem_clients_normal"])


@phase("redis_bytes", "objects", 10)
def redis_bytes(ctx: Context) -> None:
    """Redis bytes each finished 2 MB-output request adds, against a 1 KB-output one, interleaved rounds."""
    fleet = ctx.fleet
    _finished(fleet, "warm", BIG, 4)  # connections, scripts and code paths of both sides warm
    _finished(fleet, "warm", SMALL, 4)
    def per_request(size: int) -> float:
        before = _used_memory(fleet)
        _finished(fleet, f"mem{size}", size, MEMORY_REQUESTS)
        grown = (_used_memory(fleet) - before) / MEMORY_REQUESTS
        log(f"redis_bytes: {grown:.0f} bytes of used_memory per finished request of {size}-byte output")
        return grown

    rounds = []
    for _ in range(MEMORY_ROUNDS):
        rounds.append((per_request(SMALL), per_request(BIG)))
        ctx.objects.clear()
    small, big = core.median_round("redis_bytes", rounds)
    emit("redis_bytes_per_finished_request_2mb", big, "bytes", small)


def _children_cpu_seconds() -> float:
    """CPU s of this process's children that ended and were waited for (each wrk run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_seconds(pids: list[int]) -> float:
    """CPU s of ``pids`` and their direct children, ended threads too (``stat``'s ticks: moto's server runs a
    thread per connection, which ``core.cpu_seconds`` would miss once it ends)."""
    total = 0
    for pid in pids:
        for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


_PATHS_LUA = """local paths = {{{paths}}}
local n = 0
{headers}
local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) expected = 0; unexpected = 0; n = math.random(#paths) end
function request()
  n = n % #paths + 1
  return wrk.format("GET", paths[n])
end
function response(status, headers, body)
  if status == 200 then expected = expected + 1 else unexpected = unexpected + 1 end
end
function done(summary, latency, requests)
  local e, u = 0, 0
  for _, t in ipairs(threads) do e = e + t:get("expected"); u = u + t:get("unexpected") end
  io.write(string.format("BENCHLUA %d %d %d %d\\n", e, u, summary.requests, summary.duration))
end
"""


class Run(NamedTuple):
    """One wrk run: MB/s, and CPU ms per GET of each process that served or made it."""

    rate: float
    cpu_ms: dict[str, float]


def _wrk_paths(ctx: Context, label: str, base: str, paths: list[str], headers: dict[str, str], seconds: int,
               size: int) -> Run:
    """GETting ``paths`` (each ``size`` bytes) in turn from ``base`` with wrk; every answer must be 200."""
    script = ctx.tmp / f"collect-{label.replace(' ', '-')}.lua"
    script.write_text(_PATHS_LUA.format(paths=", ".join(json.dumps(p) for p in paths), headers="\n".join(
        f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items())))
    argv = [core.tool("wrk"), *COLLECT_LOAD, f"-d{seconds}s", "--timeout", "30s", "-s", str(script), base]
    servers = {"moto": [ctx.objects.pid], "front door": ctx.fleet.pids("web")}
    cpu_before = {name: _cpu_seconds(pids) for name, pids in servers.items()}
    wrk_before = _children_cpu_seconds()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 90, check=False)
    cpu = {name: _cpu_seconds(pids) - cpu_before[name] for name, pids in servers.items()}
    cpu["wrk"] = _children_cpu_seconds() - wrk_before
    if done.returncode != 0 or not (found := re.search(r"BENCHLUA (\d+) (\d+) (\d+) (\d+)", done.stdout)):
        raise MeasurementError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    expected, unexpected, requests, duration_us = map(int, found.groups())
    if unexpected or expected == 0:
        raise MeasurementError(f"collect_throughput {label}: {unexpected} of {expected + unexpected} answers not 200")
    rate = expected * size / 1e6 / (duration_us / 1e6)
    cpu_ms = {name: seconds * 1e3 / requests for name, seconds in cpu.items()}
    log(f"collect_throughput {label}: {rate:.1f} MB/s ({expected} GETs; CPU ms per GET: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu_ms.items()) + ")")
    return Run(rate, cpu_ms)


@phase("collect_throughput", "objects", 20)
def collect_throughput(ctx: Context) -> None:
    """Collects of 2 MB outputs through the front door, against GETs of the same objects from the store
    (each object's signed link: what a client following ``/link`` does)."""
    fleet = ctx.fleet
    ids = _finished(fleet, "collect", BIG, COLLECT_OBJECTS)
    size = len(body := _collect(fleet, ids[0]))
    front_paths = [urlsplit(_collect_url(fleet, i)).path for i in ids]
    links = [core.http_json("GET", _collect_url(fleet, i) + "/link", fleet.auth)["url"] for i in ids]
    if not all(link.startswith(ctx.objects.endpoint) for link in links):
        raise MeasurementError(f"a link does not point at the object store: {links[0]}")
    import requests

    if hashlib.sha256(requests.get(links[0], timeout=60).content).digest() != hashlib.sha256(body).digest():
        raise MeasurementError("the object store's bytes differ from the collect's")
    store_paths = [link[len(ctx.objects.endpoint):] for link in links]
    sides = {"store GET": (ctx.objects.endpoint, store_paths, {}), "front door": (fleet.base, front_paths, fleet.auth)}
    for label, (base, paths, headers) in sides.items():
        _wrk_paths(ctx, label, base, paths, headers, COLLECT_WARMUP_S, size)
    pairs = []
    for round_ in range(COLLECT_ROUNDS):  # the side that goes first alternates: a drift in load favours neither
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        runs = {label: _wrk_paths(ctx, label, *sides[label], COLLECT_S, size) for label in order}
        pairs.append((runs["store GET"], runs["front door"]))
    store, front = core.median_round("collect_throughput", pairs, key=lambda store, front: front.rate / store.rate)
    bound = sorted(sum(s.cpu_ms.values()) / sum(f.cpu_ms.values()) for s, f in pairs)[(len(pairs) - 1) // 2]
    log(f"collect_throughput: CPU ms per GET, median of the rounds: store GET side "
        f"{statistics.median(sum(s.cpu_ms.values()) for s, _ in pairs):.2f}, front door side "
        f"{statistics.median(sum(f.cpu_ms.values()) for _, f in pairs):.2f} (of it the front door's "
        f"{statistics.median(f.cpu_ms['front door'] for _, f in pairs):.2f}): the ratio where the cores are the "
        f"limit (a shared machine's are) is at most {bound:.3f}")
    emit("collect_throughput_2mb", front.rate, "MB/s", store.rate)
    ctx.objects.clear()


def _web_workers(fleet: Fleet) -> list[int]:
    return [int(p) for master in fleet.pids("web")
            for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]


def _rss(pids: list[int]) -> int:
    """Bytes resident in ``pids`` (VmRSS)."""
    total = 0
    for pid in pids:
        found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        total += int(found.group(1)) * 1024 if found else 0
    return total


def _drain(fleet: Fleet, request_id: str, want: int) -> None:
    """Collect ``request_id`` on a connection of its own, reading CLIENT_READ bytes at a time."""
    parts = urlsplit(fleet.base)
    conn = http.client.HTTPConnection(str(parts.hostname), parts.port, timeout=120)
    try:
        conn.request("GET", urlsplit(_collect_url(fleet, request_id)).path, headers=fleet.auth)
        answer = conn.getresponse()
        got = 0
        while chunk := answer.read(CLIENT_READ):
            got += len(chunk)
        if answer.status != 200 or got != want:
            raise MeasurementError(f"a collect answered {answer.status} with {got} of {want} bytes")
    finally:
        conn.close()


def _client(fleet: Fleet, ids: list[str], n: int, want: int) -> None:
    for k in range(RSS_COLLECTS):
        _drain(fleet, ids[(n + k) % len(ids)], want)


@phase("front_door_rss", "objects", 30)
def front_door_rss(ctx: Context) -> None:
    """The web workers' RSS at its peak while RSS_CLIENTS collect 10 MB outputs at once, against idle."""
    fleet = ctx.fleet
    ids = _finished(fleet, "rss", HUGE, RSS_OBJECTS)  # each collected once: the code paths are warm
    want = int(fleet.client.hget(keys.request(ids[0]), "blob_size"))
    workers = _web_workers(fleet)
    time.sleep(2.0)
    idle = _rss(workers)
    peak, stop = [idle], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss(workers))
            time.sleep(RSS_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.monotonic()
    try:
        with ThreadPoolExecutor(RSS_CLIENTS) as pool:
            list(pool.map(lambda n: _client(fleet, ids, n, want), range(RSS_CLIENTS)))
    finally:
        stop.set()
        sampler.join()
    seconds = time.monotonic() - began
    log(f"front_door_rss: {RSS_CLIENTS} clients collected {RSS_CLIENTS * RSS_COLLECTS} x {want / 1e6:.1f} MB in "
        f"{seconds:.1f} s ({RSS_CLIENTS * RSS_COLLECTS * want / 1e6 / seconds:.0f} MB/s); web workers' RSS idle "
        f"{idle / 2**20:.1f} MiB, peak {max(peak) / 2**20:.1f} MiB, median while collecting "
        f"{statistics.median(peak) / 2**20:.1f} MiB")
    emit("front_door_rss_collect_10mb", max(peak) / 2**20, "MiB", idle / 2**20)
    ctx.objects.clear()
