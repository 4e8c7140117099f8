"""Run the stub provider: `python -m stub_provider --host 127.0.0.1 --port 8300`.

Uses werkzeug's threaded server (one thread per connection) so hundreds of
open polls and deliberately hung calls can coexist. The ready line goes to
stdout only once the socket is listening, so a harness may wait for it.
Per-request access logs are off by default: a harness that pipes stderr
without draining it would otherwise stall the server once the pipe fills.
"""

from __future__ import annotations

import argparse
import logging
import sys

from werkzeug.serving import make_server

from .app import create_app

LISTEN_BACKLOG = 1024  # pending connections; werkzeug's default of 128 is short for bursts of 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stub_provider", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--access-log", action="store_true", help="log every request to stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.access_log:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # make_server + serve_forever is what run_simple(host, port, app, threaded=True)
    # does, minus the reloader; binding first lets us announce readiness truthfully.
    server = make_server(args.host, args.port, create_app(), threaded=True)
    server.socket.listen(LISTEN_BACKLOG)  # re-listen only raises the backlog
    print(f"stub provider listening on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
