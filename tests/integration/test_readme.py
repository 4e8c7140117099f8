"""The README's examples, run as a reader runs them, against the real stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from router_queue.dev.stack import ROOT

from .harness import ApiClient, RunningStack

README = (ROOT / "README.md").read_text()
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _block(heading: str, language: str) -> str:
    """The first ``language`` code block under the README's ``heading``."""
    section = README.split(f"\n{heading}\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _env(stack: RunningStack, caller: ApiClient) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COMFY_BASE_URL"}
    env.update(COMFY_ROUTER_BASE_URL=stack.base_url, COMFY_API_KEY=caller.api_key)
    return env


def test_the_curl_walkthrough_runs_as_written_showing_each_step(stack: RunningStack, caller: ApiClient) -> None:
    """All four steps, pasted into a shell: the submit sends a fresh
    Idempotency-Key (no uuidgen needed) and sets REQUEST_ID from its answer,
    and the slow stub prompt leaves time to see the poll, the 202 collect and
    the 202 cancel."""
    walkthrough = _block("## Walkthrough (cURL)", "sh")
    script = "\n".join(line for line in walkthrough.splitlines() if not line.startswith("export "))
    script = script.replace("REQUEST_ID=$(curl -sS ", "REQUEST_ID=$(curl -sS -v ", 1)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{script}\necho \"REQUEST_ID=$REQUEST_ID\""],
                          env=_env(stack, caller), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    sent = [line for line in done.stderr.splitlines() if line.lower().startswith("> idempotency-key:")]
    assert len(sent) == 1 and UUID.search(sent[0]), done.stderr  # never an empty key
    handle = re.search(r'\{"request_id":"([^"]+)","status":"IN_QUEUE".*?\}', done.stderr)
    assert handle, done.stderr  # the 201's body, printed
    assert done.stdout.endswith(f"REQUEST_ID={handle.group(1)}\n"), done.stdout  # set from the 201
    statuses = re.findall(r"HTTP/1.1 (\d+)", done.stdout)  # answers end without a newline
    assert statuses == ["200", "202", "202"], done.stdout  # poll, collect while running, cancel
    assert re.search(r"^Retry-After: \d+", done.stdout, re.MULTILINE | re.IGNORECASE), done.stdout
    assert '"status":"CANCELLATION_REQUESTED"' in done.stdout, done.stdout


def test_the_comfy_sdk_example_runs_as_written_and_closes_what_it_opens(stack: RunningStack, caller: ApiClient) -> None:
    example = _block("## With comfy-sdk", "python")
    done = subprocess.run([sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-c", example],
                          env=_env(stack, caller), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "image: " in done.stdout and "COMPLETED" in done.stdout, done.stdout
    assert re.search(r"^audio/mpeg \d+$", done.stdout, re.MULTILINE), done.stdout
    assert "ResourceWarning" not in done.stderr, done.stderr
