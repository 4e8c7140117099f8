"""A webhook receiver for the integration tests, run as a process of its own:
``python -m tests.integration.webhook_receiver --port N --log FILE``.

It checks every POST with the ``standardwebhooks`` package (the receivers'
library, not our signing code) against each secret it was given, one at a
time, so a test sees which of them verified: during a rotation a receiver that
holds only the old secret, or only the new one, must verify on its own.

Routes (all on 127.0.0.1):

* ``POST /hook/<name>``: an attempt. Recorded on arrival (before any answer),
  then answered as the name's plan says.
* ``PUT /_config/<name>``: ``{"secrets": {"label": "whsec_..."}, "plan": [...]}``,
  either key optional. A plan is a list of actions, one per attempt in order,
  the last repeating: ``"204"`` (or any status code) answers that; ``"hang:S"``
  holds the attempt S seconds, then answers 204 to whoever is still there;
  ``"trickle:S"`` sends a 204's status line and headers a byte at a time over
  S seconds (a slow, never silent, receiver: no single read waits long).
  A new config for a name wakes its held attempts (each answers 204 at once).
* ``GET /_attempts/<name>``: the name's attempts, oldest first, as JSON.
* ``GET /_health``: 200.

Each attempt is also appended, on arrival, as one JSON line to ``--log``:
name, n (1-based), arrived_at (Unix seconds), webhook-id, webhook-timestamp,
the number of signatures, verified (any secret), verified_with (the labels
that verified, each alone), errors (label -> why not), the body as text and
its sha256, the parsed event, the action taken. ``answered`` and
``answered_at`` are added in the GET answer once it is answered (``answered``
None if the answer could not be written; a write to a sender that has just
gone may still succeed, so it is no proof the sender read it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook


class State:
    def __init__(self, log_path: str):
        self.lock = threading.Lock()
        self.secrets: dict[str, dict[str, str]] = {}
        self.plans: dict[str, list[str]] = {}
        self.attempts: dict[str, list[dict[str, Any]]] = {}
        #: Set when a name's config changes: its held attempts wake and answer.
        self.wakes: dict[str, threading.Event] = {}
        self.log = open(log_path, "a", encoding="utf-8")

    def configure(self, name: str, config: dict[str, Any]) -> None:
        with self.lock:
            if "secrets" in config:
                self.secrets[name] = dict(config["secrets"])
            if "plan" in config:
                self.plans[name] = [str(step) for step in config["plan"]]
            wake = self.wakes.pop(name, None)
        if wake is not None:
            wake.set()

    def arrive(self, name: str, body: bytes, headers: dict[str, str]) -> tuple[dict[str, Any], threading.Event]:
        arrived_at = time.time()
        with self.lock:
            secrets = dict(self.secrets.get(name, {}))
            plan = self.plans.get(name) or ["204"]
            seen = self.attempts.setdefault(name, [])
            n = len(seen) + 1
            action = plan[min(n, len(plan)) - 1]
            wake = self.wakes.setdefault(name, threading.Event())
        verified_with, errors = [], {}
        for label, secret in sorted(secrets.items()):
            try:
                Webhook(secret).verify(body, headers)
            except Exception as exc:  # noqa: BLE001 - a receiver's verdict, recorded
                errors[label] = f"{type(exc).__name__}: {exc}"
            else:
                verified_with.append(label)
        lower = {k.lower(): v for k, v in headers.items()}
        text = body.decode("utf-8", errors="replace")
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        record = {
            "name": name, "n": n, "arrived_at": arrived_at,
            "webhook_id": lower.get("webhook-id"), "webhook_timestamp": lower.get("webhook-timestamp"),
            "signatures": len(lower.get("webhook-signature", "").split()),
            "user_agent": lower.get("user-agent"), "content_type": lower.get("content-type"),
            "verified": bool(verified_with), "verified_with": verified_with, "errors": errors,
            "body": text, "body_sha256": hashlib.sha256(body).hexdigest(), "event": event, "action": action,
            "answered": None, "answered_at": None,
        }
        with self.lock:
            seen.append(record)
            self.log.write(json.dumps({k: v for k, v in record.items() if not k.startswith("answered")}) + "\n")
            self.log.flush()
        return record, wake

    def answered(self, record: dict[str, Any], status: int | None) -> None:
        with self.lock:
            record["answered"] = status
            record["answered_at"] = time.time()

    def list(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(r) for r in self.attempts.get(name, [])]


class Handler(BaseHTTPRequestHandler):
    server_version = "webhook-receiver/1"
    state: State

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, value: Any) -> None:
        payload = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self) -> None:
        if self.path == "/_health":
            self._json(200, {"ok": True})
        elif self.path.startswith("/_attempts/"):
            self._json(200, self.state.list(self.path.removeprefix("/_attempts/")))
        else:
            self._empty(404)

    def do_PUT(self) -> None:
        if not self.path.startswith("/_config/"):
            self._empty(404)
            return
        self.state.configure(self.path.removeprefix("/_config/"), json.loads(self._body() or b"{}"))
        self._empty(204)

    def _trickle(self, record: dict[str, Any], seconds: float, wake: threading.Event) -> None:
        raw = (b"HTTP/1.0 204 No Content\r\nX-Slow: " + b"." * 40 + b"\r\nContent-Length: 0\r\n\r\n")
        pause = seconds / len(raw)
        try:
            for byte in raw:
                if wake.wait(pause):
                    pause = 0.0
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        except OSError:
            self.state.answered(record, None)
            self.close_connection = True
            return
        self.state.answered(record, 204)
        self.close_connection = True

    def do_POST(self) -> None:
        if not self.path.startswith("/hook/"):
            self._empty(404)
            return
        body = self._body()
        record, wake = self.state.arrive(self.path.removeprefix("/hook/"), body, dict(self.headers))
        action = record["action"]
        status = 204
        if action.startswith("hang:"):
            wake.wait(float(action.split(":", 1)[1]))
        elif action.startswith("trickle:"):
            self._trickle(record, float(action.split(":", 1)[1]), wake)
            return
        else:
            status = int(action)
        try:
            self._empty(status)
            self.wfile.flush()
        except OSError:  # the sender gave up (its timeout) or died
            self.state.answered(record, None)
            return
        self.state.answered(record, status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)
    Handler.state = State(args.log)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"webhook receiver listening on http://127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
