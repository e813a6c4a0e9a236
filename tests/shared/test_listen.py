"""The listening socket of the engine's API and the router: it accepts connections into its backlog before
the server runs (a client that connects as soon as the process says it serves is not refused), and
connections accepted on it have Nagle's algorithm off (TCP_NODELAY), without which every small answer
waited for the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shared.listen import listening_socket


async def test_accepted_connections_have_tcp_nodelay() -> None:
    seen: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=listening_socket("127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert seen and seen[0] != 0


async def test_a_client_that_connects_before_the_server_runs_waits_and_is_served() -> None:
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    early = socket.create_connection(("127.0.0.1", port), timeout=5)  # nothing accepts yet: the backlog holds it
    try:
        early.sendall(b"ping")

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(4))
            await writer.drain()
            writer.close()

        async with await asyncio.start_server(echo, sock=sock):
            answer = await asyncio.to_thread(early.recv, 4)
        assert answer == b"ping"
    finally:
        early.close()


def test_a_port_in_use_is_refused_and_nothing_is_left_open() -> None:
    taken = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
