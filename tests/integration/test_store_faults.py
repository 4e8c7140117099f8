"""The object store killed, then stopped, while requests with 2 MB outputs
complete: no paid output is lost, none charged twice, no collect answered
wrongly (issue 33, item 5).

Real parts: gunicorn, beat, a Celery worker, the stub, Redis, and moto's S3
server behind a TCP forwarder of its own (``tests/tcp_forwarder.py``). "Killed"
is the forwarder SIGKILLed and started again on the same port 30 s later:
callers meet a dead endpoint while the objects behind it survive, as a real
store's do (moto keeps its objects in memory, so killing moto itself would
lose them; ``rclone serve s3``, which keeps them in a directory, answers a
ranged GET with a whole 200 that obstore refuses, so a collect cannot read
through it). "Stopped" is moto itself SIGSTOPped for 30 s: connections open,
nothing answers. The put window is 10 s, so outputs finished early in the
fault go to Redis's fallback and the sweeper moves them later; those finished
late land in the store by the worker's own retries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import requests

from router_queue.dev.stack import ROOT, free_port, wait_for_port
from router_queue.store import keys
from router_queue.store.connect import connect
from tests.object_stores import BUCKET, S3Server, s3_server
from tests.redis_servers import terminate

from .chaos_support import STATUS_ORDER, chaos_redis_url
from .harness import (
    GEMINI,
    SHORT_LEASE,
    RunningStack,
    ledger_by_request,
    make_caller,
    stack_env,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.slow

#: Seconds each fault lasts.
FAULT_S = 30.0
#: Bytes of each output's image (the answer is its base64 in Vertex's JSON).
OUTPUT_BYTES = 2_000_000
#: The worker's put window in these stacks: shorter than the fault.
PUT_WINDOW_S = 10
#: Requests sent early in the fault (past the window: Redis's fallback) and late (the store takes them).
EARLY, LATE = 10, 4
#: A collect's patience: longer than the store client's read timeout and retries.
COLLECT_TIMEOUT_S = 120


class Forwarder:
    """The S3 endpoint's front: a process that can be killed and started again on its port."""

    def __init__(self, port: int, target_port: int, log: Path):
        self.port, self.target_port, self.log = port, target_port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.tcp_forwarder", str(self.port),
                                          str(self.target_port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, timeout_s=10, proc=self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def faults(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningStack, S3Server,
                                                                                        Forwarder]]:
    tmp = tmp_path_factory.mktemp("store-faults")
    chaos_url = chaos_redis_url(redis_url)
    client = connect(chaos_url, wait_s=5.0)
    client.flushdb()
    client.close()
    with s3_server(tmp) as moto:
        forwarder = Forwarder(free_port(), int(moto.endpoint.rsplit(":", 1)[1]), tmp / "forwarder.log")
        forwarder.start()
        endpoint = S3Server(f"http://127.0.0.1:{forwarder.port}", moto.proc)
        env = stack_env(chaos_url, stub_port=free_port(), OBJECT_STORE_URL=f"s3://{BUCKET}/store-faults",
                        OBJECT_STORE_PUT_WINDOW_SECONDS=str(PUT_WINDOW_S), **endpoint.env(), **SHORT_LEASE)
        try:
            with RunningStack.start(env, tmp_path_factory.mktemp("store-faults-stack"), label="store faults",
                                   workers=("a",)) as running:
                yield running, moto, forwarder
        finally:
            terminate(forwarder.proc)


def body(label: str) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": unique_prompt(label, f"[stub:size={OUTPUT_BYTES}]")}]}]}


def expected_output(running: RunningStack, sent: dict) -> bytes:
    """What the stub answers for this body (it answers a body the same every time)."""
    url = (f"{running.env['PROVIDER_ORIGIN_OVERRIDE']}/v1/projects/comfy-router/locations/global/publishers/google/"
           f"models/gemini-3.1-flash-image:generateContent")
    answer = requests.post(url, json=sent, headers={"Authorization": "Bearer stub"}, timeout=30)
    assert answer.status_code == 200, answer.text[:200]
    return answer.content


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_store_killed_or_stopped_loses_no_paid_output(faults, fault):
    running, moto, forwarder = faults
    wrong: list[str] = []  # answers no collect may give: a 500, a 404, a wrong byte
    with make_caller(running, f"store-{fault}") as caller:
        sent: dict[str, dict] = {}

        def submit(label: str) -> str:
            request_body = body(f"{fault} {label}")
            request_id = caller.submit_ok(GEMINI, request_body)
            sent[request_id] = request_body
            return request_id

        stored_first = [submit("before") for _ in range(2)]
        for request_id in stored_first:
            caller.wait_status(GEMINI, request_id, timeout_s=60)

        def collect(request_id: str) -> requests.Response:
            return caller.session.get(caller.url(GEMINI, request_id), headers=caller.headers(),
                                      timeout=COLLECT_TIMEOUT_S)

        redis = running.services.redis
        kept_in_redis: list[int] = []  # how many outputs the fallback held, sampled through the run
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.5):
                kept_in_redis.append(redis.zcard(keys.fallback_results("vertexai")))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.monotonic()
        if fault == "killed":
            forwarder.kill()
        else:
            os.kill(moto.proc.pid, signal.SIGSTOP)
        during: list[requests.Response] = []
        collector = threading.Thread(target=lambda: during.extend(collect(rid) for rid in stored_first))
        try:
            collector.start()  # collects of stored outputs while the store is away
            early = [submit(f"early {n}") for n in range(EARLY)]
            time.sleep(max(0.0, began + FAULT_S - PUT_WINDOW_S / 2 - time.monotonic()))
            late = [submit(f"late {n}") for n in range(LATE)]
            time.sleep(max(0.0, began + FAULT_S - time.monotonic()))
        finally:
            if fault == "killed":
                forwarder.start()
            else:
                os.kill(moto.proc.pid, signal.SIGCONT)
        collector.join(COLLECT_TIMEOUT_S + 10)
        for answer in during:
            if answer.status_code == 503:
                assert answer.headers.get("Retry-After"), answer.headers
            elif answer.status_code != 200:
                wrong.append(f"a collect during the fault answered {answer.status_code}: {answer.text[:200]}")

        request_ids = stored_first + early + late
        last = {request_id: "IN_QUEUE" for request_id in request_ids}

        def all_completed() -> bool:
            for request_id in request_ids:
                status = caller.status_body(GEMINI, request_id)["status"]
                assert STATUS_ORDER[status] >= STATUS_ORDER[last[request_id]], (request_id, last[request_id], status)
                last[request_id] = status
            return all(status == "COMPLETED" for status in last.values())

        wait_for(all_completed, timeout_s=120, interval_s=0.5, what="every request COMPLETED")
        wait_for(lambda: redis.zcard(keys.fallback_results("vertexai")) == 0, timeout_s=60, interval_s=0.5,
                 what="every output kept in Redis moved to the store")

        lost = 0
        with ThreadPoolExecutor(4) as pool:
            answers = dict(zip(request_ids, pool.map(collect, request_ids)))
        for request_id, answer in answers.items():
            if answer.status_code != 200:
                lost += 1
                wrong.append(f"{request_id} answered {answer.status_code} after the fault: {answer.text[:200]}")
            elif answer.content != expected_output(running, sent[request_id]):
                wrong.append(f"{request_id}: {len(answer.content)} bytes, not the provider's output")
        ledger = ledger_by_request(running.services, caller.workspace)
        charged_twice = sum(1 for request_id in request_ids if ledger.get(request_id, []).count("charge") > 1)
        uncharged = [request_id for request_id in request_ids if ledger.get(request_id) != ["hold", "charge"]]
        inline_left = [request_id for request_id in request_ids if redis.exists(keys.result(request_id))]
        took = time.monotonic() - began
        sampling.set()
        sampler.join()
        print(f"\nstore {fault} for {FAULT_S:.0f} s: {len(request_ids)} requests of {OUTPUT_BYTES} bytes, "
              f"lost {lost}, charged twice {charged_twice}, answered wrongly {len(wrong)}; during the fault the "
              f"collects answered {[a.status_code for a in during]}; at most {max(kept_in_redis, default=0)} outputs "
              f"kept in Redis meanwhile; all back in the store {took:.0f} s after it began")
        assert (lost, charged_twice, len(wrong)) == (0, 0, 0), wrong
        assert not uncharged, {rid: ledger.get(rid) for rid in uncharged}
        assert not inline_left, f"outputs still inline in Redis: {inline_left}"
        assert redis.get(keys.fallback_bytes("vertexai")) is None
        if fault == "killed":  # refused at once: the early outputs outlived the put window
            assert max(kept_in_redis, default=0) > 0
