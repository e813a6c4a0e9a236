"""The listening socket of a server process (the engine's API, the router), made before it serves."""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's own default: connections wait here until the server accepts them


def listening_socket(host: str, port: int, *, inheritable: bool = False) -> socket.socket:
    """Bound and listening before the server starts: `--port 0` can say which port it got, and a client
    that connects as soon as the process says it serves waits in the backlog until the app accepts it,
    instead of being refused. IPPROTO_TCP is named: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on sockets whose proto says TCP, and with it on, every small answer would wait for the client's
    delayed ACK (docs/performance.md#serving-over-http)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(inheritable)
    return sock
