"""A client that disconnects while sending its body (a caller killed mid-call) is no server error: the
app answers the (unread) 400 and logs one line, not a 500 with a traceback."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from litestar import Litestar, Request, post

from shared.http_errors import exception_handlers
from tests.control_plane.engines import serve_app
from tests.e2e.test_control_plane_engines import _free_port as free_port


@post("/echo", status_code=200)
async def echo(request: Request) -> dict[str, int]:
    return {"bytes": len(await request.body())}


def test_a_body_cut_off_by_the_client_is_not_a_server_error(caplog: pytest.LogCaptureFixture) -> None:
    app = Litestar([echo], exception_handlers=exception_handlers(), logging_config=None)
    port = free_port()
    with caplog.at_level(logging.INFO), serve_app(app, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b"{" * 10)
            time.sleep(0.2)  # the handler is waiting for the rest
        deadline = time.monotonic() + 10
        while "disconnected before its request body" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "the client disconnected before its request body was complete" in caplog.text
    assert "unhandled error" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
