"""Schemathesis (v4) against the running session stack's own ``/v2/openapi.json``.

Every operation the document describes is exercised in all of Schemathesis'
phases (examples, coverage, fuzzing, stateful), positive and negative data,
with a fixed seed and a bounded number of examples per operation, and each
response is held to the document by these checks, and only these (none is
excluded, and none of Schemathesis' other checks runs):

* ``not_a_server_error``: no 5xx the document does not name;
* ``status_code_conformance``: every status is documented for its operation;
* ``content_type_conformance``: every Content-Type is documented;
* ``response_schema_conformance``: every body matches its documented schema;
* ``response_headers_conformance``: documented required headers are present and valid.

The caller is a workspace with queued delivery on, credits, and a rate limit
and backlog cap out of reach, so no answer is a 402/429 of the caller's own
making. Submits start real (stub) generations; the synchronous route holds
until they finish, which is quick on the stub, hence the request timeout's slack.
The test passes when Schemathesis reports nothing; its report is the failure message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router_queue.dev.stack import ROOT

from .harness import RunningStack, make_caller

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
)
#: Test cases per operation and phase; 18 operations, about 25 s in all on 2 cores.
MAX_EXAMPLES = 10
SEED = 20261130
#: Seconds per request: a synchronous run on the stub answers in well under a second.
REQUEST_TIMEOUT_S = 30
#: Seconds the whole run may take before the test fails.
RUN_TIMEOUT_S = 240


def _st() -> list[str]:
    found = shutil.which("st")
    if found is not None:
        return [found]
    return [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]


def test_schemathesis_finds_nothing(stack: RunningStack, tmp_path: Path) -> None:
    try:
        import schemathesis
    except ImportError:
        pytest.fail("schemathesis is not installed: pip install 'schemathesis>=4,<5' (the test extra)")
    assert int(schemathesis.__version__.split(".")[0]) >= 4, f"schemathesis {schemathesis.__version__} is not v4"
    with make_caller(stack, "schemathesis", credits=10**12, max_queued=10**6, rate_limit="100000/second") as made:
        api_key = made.api_key
    argv = [
        *_st(), "--no-color", "run", f"{stack.base_url}/v2/openapi.json",
        "--checks", ",".join(CHECKS),
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", str(SEED),
        "--workers", "1",  # one worker: with the seed, the same cases in the same order each run
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--header", f"X-API-Key: {api_key}",
        "--report", "junit", "--report-dir", str(tmp_path / "report"),
    ]

    # A batch's NDJSON body is serialized by our hook (schemathesis_hooks.py).
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.integration.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL, env=env)

    output = done.stdout + done.stderr
    assert done.returncode == 0, f"Schemathesis found problems (exit {done.returncode}):\n{_report(output)}"
    assert "generated" in output, output[-3000:]


def _report(output: str, limit: int = 20_000) -> str:
    """From the FAILURES section on (or the tail), bounded."""
    start = output.find("FAILURES")
    text = output[max(0, output.rfind("\n", 0, start)):] if start >= 0 else output
    return text[-limit:]
