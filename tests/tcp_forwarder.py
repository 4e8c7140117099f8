"""A TCP forwarder, run as its own process: ``python -m tests.tcp_forwarder
LISTEN_PORT TARGET_PORT``. It stands for an S3 endpoint's front: the store
fault tests SIGKILL it and start it again on the same port, so callers see a
server killed and restarted while the objects behind it survive, as a real
S3's durable storage does (moto keeps its objects in its process's memory:
killing moto itself would lose them, which no real store does).
"""

from __future__ import annotations

import socket
import sys
import threading


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(client: socket.socket, target_port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", target_port))
    except OSError:
        client.close()
        return
    threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
    _pipe(client, upstream)


def main(listen_port: int, target_port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", listen_port))
    server.listen(128)
    while True:
        client, _ = server.accept()
        threading.Thread(target=_serve, args=(client, target_port), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
