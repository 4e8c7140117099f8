"""Keys and webhook secrets against the real processes: gunicorn with two
workers, the Celery worker, beat, the stub, a private redis-server.

* A key revoked with ``router-queue key revoke`` is refused (401) by every
  front-door worker within 5 s (the contract's bound; the resolver's cache
  lasts 2 s).
* A key rotated with ``router-queue key rotate --overlap`` works beside its
  successor for the overlap, and stops when it ends.
* A key revoked loses its held connections within the same 5 s: an event
  stream ends and its reconnect is 401; a held synchronous call answers 401
  while its generation runs on, charged, collectable with another key.
* A submit naming a webhook for a workspace with no signing secret is refused
  at once (never 201), on both routes, and nothing is admitted or charged.

Which gunicorn worker answers a call cannot be seen from outside, so the
"every worker" checks send each read on a fresh connection, four at a time,
and wait for a long run of answers in a row that agree.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from router_queue.dev.stack import ROOT

from .harness import FLUX, ApiClient, RunningStack, ledger_by_request, make_caller, unique_prompt, wait_for

#: A well-formed request id nobody minted: a valid key reads 404 for it, a refused key 401.
NOBODYS = "00000000-0000-9000-8000-000000000001"
#: Reads in a row, on fresh connections, that must all agree.
AGREEING = 40
#: The contract's bound on a revoked key being refused everywhere, in seconds.
REVOKED_WITHIN_S = 5.0

#: A public address given as a literal (no DNS); never contacted: every submit naming it is refused.
PUBLIC_HOOK = "https://8.8.8.8/hook"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``router-queue ARGS`` as an operator runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-c", "from router_queue.cli import main; main()", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def cli_ok(env: dict[str, str], *args: str) -> str:
    done = cli(env, *args)
    assert done.returncode == 0, f"router-queue {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _reads(stack: RunningStack, api_key: str, count: int) -> list[int]:
    """``count`` status reads with ``api_key``, each on a connection of its own, four at a time."""
    url = f"{stack.base_url}/v2/models/{FLUX}/requests/{NOBODYS}/status"

    def read(_: int) -> int:
        return requests.get(url, headers={"X-API-Key": api_key, "Connection": "close"}, timeout=10).status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(read, range(count)))


def _refused_everywhere_at(stack: RunningStack, api_key: str, *, give_up_s: float = 15.0) -> float:
    """When (``time.monotonic()``) the reads with ``api_key`` started being
    401 on every worker: the start of the first run of :data:`AGREEING` 401s."""
    ends = time.monotonic() + give_up_s
    run_started = None
    while time.monotonic() < ends:
        at = time.monotonic()
        answers = _reads(stack, api_key, 8)
        assert set(answers) <= {401, 404}, answers
        if 404 in answers:
            run_started = None
            continue
        run_started = run_started or at
        if set(_reads(stack, api_key, AGREEING)) == {401}:
            return run_started
        run_started = None
    raise AssertionError(f"the key was still accepted {give_up_s:.0f} s later")


# -- key lifecycle ---------------------------------------------------------------------------


def test_a_revoked_key_is_refused_by_every_front_door_worker_within_5_s(stack: RunningStack) -> None:
    with make_caller(stack, "key-revoke") as caller:
        kept = stack.services.accounts.mint_key(caller.workspace, "kept")
        assert set(_reads(stack, caller.api_key, AGREEING)) == {404}  # cached by both workers
        assert cli(stack.env, "key", "revoke", caller.api_key).returncode == 0
        revoked_at = time.monotonic()
        refused_at = _refused_everywhere_at(stack, caller.api_key)
        assert refused_at - revoked_at <= REVOKED_WITHIN_S, refused_at - revoked_at
        assert set(_reads(stack, kept, AGREEING)) == {404}  # the workspace's other key works on
        listed = cli_ok(stack.env, "key", "list", caller.workspace)
        assert "kept" in listed and caller.api_key not in listed
        assert cli_ok(stack.env, "key", "audit", caller.workspace).splitlines()[0].split("\t")[1] == "revoke"


def test_a_rotated_pair_both_work_during_the_overlap_then_the_old_one_stops(stack: RunningStack) -> None:
    overlap_s = 6
    with make_caller(stack, "key-rotate") as caller:
        old = caller.api_key
        assert set(_reads(stack, old, AGREEING)) == {404}
        started = time.monotonic()
        new = cli_ok(stack.env, "key", "rotate", old, "--overlap", str(overlap_s)).strip()
        ends = started + overlap_s  # the overlap ends a little after this (it started once the CLI ran)
        assert new.startswith("rq_") and new != old
        while time.monotonic() < ends - 1.0:  # during the overlap, both work on every worker
            assert set(_reads(stack, old, 8)) == {404}
            assert set(_reads(stack, new, 8)) == {404}
        refused_at = _refused_everywhere_at(stack, old)
        assert ends - 1.0 <= refused_at <= ends + REVOKED_WITHIN_S, (refused_at - started)
        assert set(_reads(stack, new, AGREEING)) == {404}
        assert caller.submit(FLUX, {"prompt": unique_prompt("rotated key")},
                             headers={"X-API-Key": new}).status_code == 201


# -- connections held open with a key that is revoked -------------------------------------------


def _open_stream(caller: ApiClient, request_id: str) -> requests.Response:
    return requests.get(caller.url(FLUX, request_id, "/events"), headers=caller.headers(), stream=True,
                        timeout=(5, 60))


def test_a_revoked_keys_event_stream_ends_within_5_s_and_its_reconnect_is_401(stack: RunningStack) -> None:
    with make_caller(stack, "key-revoke-stream") as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("held stream", "[stub:latency=30]")})
        with _open_stream(caller, request_id) as stream:
            assert stream.status_code == 200, stream.text
            lines = stream.iter_lines(decode_unicode=True)
            assert next(line for line in lines if line.startswith("event: "))  # open and sending
            assert cli(stack.env, "key", "revoke", caller.api_key).returncode == 0
            revoked_at = time.monotonic()
            for _ in lines:  # read until the server ends it (the generation runs 30 s more)
                pass
            ended_at = time.monotonic()
        assert ended_at - revoked_at <= REVOKED_WITHIN_S, ended_at - revoked_at
        while True:  # a front-door worker holding nothing with the key may have it cached 2 s more
            with _open_stream(caller, request_id) as again:
                if again.status_code == 401:
                    break
                assert again.status_code == 200 and time.monotonic() - revoked_at <= REVOKED_WITHIN_S
        assert again.headers["X-Comfy-Error-Type"] == "unauthorized"


def test_a_rotated_out_keys_event_stream_ends_with_its_overlap(stack: RunningStack) -> None:
    overlap_s = 3
    with make_caller(stack, "key-rotate-stream") as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("rotated stream", "[stub:latency=30]")})
        with _open_stream(caller, request_id) as stream:
            assert stream.status_code == 200, stream.text
            lines = stream.iter_lines(decode_unicode=True)
            assert next(line for line in lines if line.startswith("event: "))
            started = time.monotonic()
            new = cli_ok(stack.env, "key", "rotate", caller.api_key, "--overlap", str(overlap_s)).strip()
            for _ in lines:
                pass
            ended_at = time.monotonic()
        assert overlap_s - 1.0 <= ended_at - started <= overlap_s + REVOKED_WITHIN_S, ended_at - started
        caller.api_key = new  # its successor follows the same request
        with _open_stream(caller, request_id) as again:
            assert again.status_code == 200


def test_a_revoked_keys_held_sync_call_answers_401_and_its_generation_runs_on(stack: RunningStack) -> None:
    with make_caller(stack, "key-revoke-sync") as caller:
        revoked = caller.api_key
        kept = stack.services.accounts.mint_key(caller.workspace, "kept")
        body = {"prompt": unique_prompt("held sync", "[stub:latency=6]")}
        answer: dict[str, requests.Response] = {}

        def call() -> None:
            answer["sync"] = requests.post(f"{stack.base_url}/v2/models/{FLUX}", json=body,
                                           headers={"X-API-Key": revoked}, timeout=(5, 60))

        held = threading.Thread(target=call, daemon=True)
        held.start()
        caller.api_key = kept  # the workspace's other key reads and collects
        listed = wait_for(lambda: caller.session.get(f"{stack.base_url}/v2/requests", headers=caller.headers(),
                                                     timeout=10).json()["requests"], what="the held call admitted")
        request_id = listed[0]["request_id"]
        caller.wait_status(FLUX, request_id, "IN_PROGRESS")
        assert cli(stack.env, "key", "revoke", revoked).returncode == 0
        revoked_at = time.monotonic()
        held.join(60)
        refused = answer["sync"]
        assert refused.status_code == 401, (refused.status_code, refused.text)
        assert time.monotonic() - revoked_at <= REVOKED_WITHIN_S
        assert refused.headers["X-Comfy-Error-Type"] == "unauthorized"
        assert refused.headers["X-Comfy-Request-Id"] == request_id
        assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"  # it ran on
        collected = caller.result(FLUX, request_id)
        assert collected.status_code == 200 and collected.json()["result"]["prompt"] == body["prompt"]
        assert collected.headers["X-Comfy-Cost-State"] == "charged"
        assert ledger_by_request(stack.services, caller.workspace)[request_id] == ["hold", "charge"]


# -- webhook secrets ---------------------------------------------------------------------------


def test_a_webhook_without_a_signing_secret_is_refused_at_submit(stack: RunningStack) -> None:
    with make_caller(stack, "hook-no-secret") as caller:
        before = stack.services.accounts.get(caller.workspace)
        prompts = []
        answers = []
        for route in ("queued", "synchronous"):
            prompt = unique_prompt(f"no secret {route}")
            prompts.append(prompt)
            url = caller.url(FLUX) if route == "queued" else f"{caller.base_url}/v2/models/{FLUX}"
            answers.append(caller.session.post(url, json={"prompt": prompt}, timeout=30,
                                               headers=caller.headers({"X-Comfy-Webhook-Url": PUBLIC_HOOK,
                                                                       "Idempotency-Key": f"hook-{route}"})))
        cli_ok(stack.env, "workspace", "set-webhook", caller.workspace, PUBLIC_HOOK)
        answers.append(caller.submit(FLUX, {"prompt": unique_prompt("no secret, the default")}))

        for response in answers:
            assert response.status_code == 400, (response.status_code, response.text)
            assert response.headers["X-Comfy-Error-Type"] == "invalid_input"
            assert f"router-queue workspace webhook-secret {caller.workspace}" in response.json()["detail"]
        assert answers[0].json()["detail"].startswith("X-Comfy-Webhook-Url names a webhook")
        assert answers[2].json()["detail"].startswith("the workspace has a default webhook URL")

        after = stack.services.accounts.get(caller.workspace)
        assert (after.credits, after.held, after.queued) == (before.credits, 0, 0)
        assert stack.services.accounts.ledger(caller.workspace) == []
        for prompt in prompts:
            assert stack.stub.submits("bfl_submit", {"prompt": prompt}) == 0
        # off again, the same workspace submits as before
        cli_ok(stack.env, "workspace", "set-webhook", caller.workspace, "--off")
        assert caller.submit(FLUX, {"prompt": unique_prompt("no webhook at all")}).status_code == 201
        assert requests.get(f"{stack.base_url}/healthz", timeout=5).status_code == 200
