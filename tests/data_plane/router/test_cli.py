"""The router's listening socket: connections accepted on it have Nagle's algorithm off (TCP_NODELAY),
without which every small answer waited for the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket

from data_plane.router.cli import _bind


async def test_accepted_connections_have_tcp_nodelay() -> None:
    seen: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=_bind("127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert seen and seen[0] != 0
