"""The README's examples, run as a reader runs them, against the real stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from router_queue.dev.stack import ROOT

from .harness import Caller, RunningStack

pytestmark = pytest.mark.integration

README = (ROOT / "README.md").read_text()
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _block(heading: str, language: str) -> str:
    """The first ``language`` code block under the README's ``heading``."""
    section = README.split(f"\n{heading}\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _env(stack: RunningStack, caller: Caller) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COMFY_BASE_URL"}
    env.update(COMFY_ROUTER_BASE_URL=stack.base_url, COMFY_API_KEY=caller.api_key)
    return env


def test_the_curl_walkthrough_submits_with_an_idempotency_key_on_any_machine(stack: RunningStack,
                                                                              caller: Caller) -> None:
    walkthrough = _block("## Walkthrough (cURL)", "sh")
    submit = walkthrough.split("# 1. Submit", 1)[1].split("\n# 2.", 1)[0].split("\n", 1)[1]
    preamble = "\n".join(line for line in walkthrough.splitlines() if line.startswith("BASE="))
    script = f"{preamble}\n{submit.replace('curl ', 'curl -sS -v ', 1)}"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=_env(stack, caller),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    sent = [line for line in done.stderr.splitlines() if line.lower().startswith("> idempotency-key:")]
    assert len(sent) == 1 and UUID.search(sent[0]), done.stderr  # no uuidgen needed, never an empty key
    assert '"request_id"' in done.stdout and '"IN_QUEUE"' in done.stdout, done.stdout


def test_the_comfy_sdk_example_runs_as_written_and_closes_what_it_opens(stack: RunningStack, caller: Caller) -> None:
    example = _block("## With comfy-sdk", "python")
    done = subprocess.run([sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-c", example],
                          env=_env(stack, caller), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "image: " in done.stdout and "COMPLETED" in done.stdout, done.stdout
    assert re.search(r"^audio/mpeg \d+$", done.stdout, re.MULTILINE), done.stdout
    assert "ResourceWarning" not in done.stderr, done.stderr
