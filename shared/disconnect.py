"""Work that stops when the HTTP client goes away: the engine's and the router's request handlers use it.

A handler that awaits a long answer (a generation, an engine's reply) reads no more of its request, so
nobody would notice the client leaving; `until_disconnect` races the work against the ASGI
`http.disconnect` message and cancels the work when the client leaves first. The work's own cleanup
(closing a generation, closing an engine's connection) has run when the `gone()` error (ClientDisconnected
unless the caller says otherwise) is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shared.errors import LoraplaneError

T = TypeVar("T")


class ClientDisconnected(LoraplaneError):
    """The client closed the connection before the answer; nobody reads it (the work for it, a generation or
    an engine's request, has been stopped)."""

    status_code = 499  # nginx's "client closed request", as the engines log it
    error_type = "client_closed_request"


def client_gone() -> ClientDisconnected:
    return ClientDisconnected("The client closed the connection.")


async def until_disconnect(receive: Callable[[], Awaitable[Any]], work: Awaitable[T],
                           gone: Callable[[], BaseException] = client_gone) -> T:
    """`work`'s result; cancelled if `receive` (the request's ASGI receive) says the client disconnected
    first, and then `gone()` is raised. If the caller itself is cancelled (server shutdown), so is the work."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel(task, watcher)
        raise
    if not task.done():  # the client left first
        await cancel(task, watcher)
        raise gone()
    watcher.cancel()
    return task.result()


async def cancel(*tasks: asyncio.Future[Any]) -> None:
    """Cancel and wait, so that the tasks' cleanup has run."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
