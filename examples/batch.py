"""A batch with plain ``requests`` (the published SDK has no batch call):
send one NDJSON line per request, wait until the batch is COMPLETED (as its
Retry-After says), then read each line's outcome and collect what succeeded.

    COMFY_API_KEY=rq_... COMFY_ROUTER_BASE_URL=http://127.0.0.1:8000 python3 examples/batch.py
"""

from __future__ import annotations

import json
import os
import time
import uuid

import requests

BASE = os.environ.get("COMFY_ROUTER_BASE_URL", "http://127.0.0.1:8000")
AUTH = {"X-API-Key": os.environ["COMFY_API_KEY"]}


def main() -> None:
    prompts = [f"product shot {n}: a teapot, studio light" for n in range(1, 51)]
    lines = [{"model": "bfl/flux-2-pro", "body": {"prompt": p}, "metadata": {"shot": str(n)}}
             for n, p in enumerate(prompts, 1)]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    # The Idempotency-Key makes a resend (after a timeout, say) answer the same batch, admitting nothing twice.
    sent = requests.post(f"{BASE}/v2/batches", data=body.encode(), timeout=60,
                         headers={**AUTH, "Content-Type": "application/x-ndjson",
                                  "Idempotency-Key": str(uuid.uuid4())})
    sent.raise_for_status()
    batch = sent.json()
    print("batch", batch["batch_id"], batch["counts"])
    while True:
        status = requests.get(batch["status_url"], headers=AUTH, timeout=30)
        status.raise_for_status()
        print(status.json()["status"], status.json()["counts"])
        if status.json()["status"] == "COMPLETED":
            break
        time.sleep(int(status.headers.get("Retry-After", "5")))
    with requests.get(batch["results_url"], headers=AUTH, stream=True, timeout=60) as results:
        results.raise_for_status()
        for raw in results.iter_lines():
            line = json.loads(raw)
            if line.get("error_type"):
                print(f"line {line['line']}: {line['error_type']}: {line.get('detail', '')}")
            else:
                output = requests.get(line["response_url"], headers=AUTH, timeout=60)
                print(f"line {line['line']}: {line['request_id']} {output.status_code} {len(output.content)} bytes")


if __name__ == "__main__":
    main()
