"""Keys and webhook secrets against the real processes: gunicorn with two
workers, the Celery worker, beat, the stub, a private redis-server.

* A submit naming a webhook for a workspace with no signing secret is refused
  at once (never 201), on both routes, and nothing is admitted or charged.
"""

from __future__ import annotations

import subprocess
import sys

import requests

from router_queue.dev.stack import ROOT

from .harness import FLUX, RunningStack, make_caller, unique_prompt

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
