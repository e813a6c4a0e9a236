"""Misbehaving HTTP peers on loopback: what a broken, slow or hostile "engine" answers.

Test peers, not mocks of our components: real TCP servers on 127.0.0.1 in a thread of their own (so
they serve whatever event loop the test or the app under test runs on), speaking raw HTTP/1.1 so that
they can do what no well-behaved server does: drip a byte at a time, send far more than announced,
answer `[1,2,3]`, redirect elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    drip_s: float | None = None  # send the body one byte every drip_s seconds
    endless: bool = False  # stream chunks of `body` forever (no content-length)


def json_reply(value: object, status: int = 200) -> Reply:
    return Reply(status, json.dumps(value).encode())


Handler = Callable[[str, str], Reply]  # (method, path) -> reply


@dataclass
class Peer:
    url: str
    seen: list[tuple[str, str, dict[str, str]]]  # (method, path, headers) of every request


@contextlib.contextmanager
def serve(handler: Handler) -> Iterator[Peer]:
    """A server answering every request with `handler(method, path)`, for the with-block."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    seen: list[tuple[str, str, dict[str, str]]] = []
    holder: dict[str, asyncio.AbstractServer] = {}

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            if int(headers.get("content-length", 0)):
                await reader.readexactly(int(headers["content-length"]))
            seen.append((method, path, headers))
            reply = handler(method, path)
            out = [f"HTTP/1.1 {reply.status} X", "connection: close", *(f"{k}: {v}" for k, v in reply.headers.items())]
            if not reply.endless:
                out.append(f"content-length: {len(reply.body)}")
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode())
            if reply.endless:
                while True:
                    writer.write(reply.body)
                    await writer.drain()
            elif reply.drip_s is not None:
                for i in range(len(reply.body)):
                    writer.write(reply.body[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(reply.drip_s)
            else:
                writer.write(reply.body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def start() -> None:
        holder["server"] = await asyncio.start_server(respond, "127.0.0.1", 0)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield Peer(f"http://127.0.0.1:{port}", seen)
    finally:
        async def stop() -> None:
            holder["server"].close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def always(reply: Reply) -> Handler:
    return lambda _method, _path: reply
