"""shared/logging_setup.py: both formats carry the same fields; routine requests (heartbeats, /metrics,
/health, a client's GETs) that succeeded are DEBUG, everything else keeps its level. The records come from
the real libraries' loggers: uvicorn's access log and httpx's request log (against a real local server)."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from shared.logging_setup import configure_logging, is_routine

TEXT_LINE = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d) (?P<level>[A-Z]+) "
                       r"(?P<logger>\S+): (?P<message>.*)$")


def capture(level: str, log_format: str) -> io.StringIO:
    stream = io.StringIO()
    configure_logging(level, log_format, stream=stream)
    return stream


@pytest.mark.usefixtures("restore_logging")
def test_text_and_json_carry_the_same_fields() -> None:
    records = []
    for log_format in ("json", "text"):
        stream = capture("info", log_format)
        logging.getLogger("loraplane.test").warning("disk %s is %d%% full", "/x", 93)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("loraplane.test").exception("failed")
        records.append(stream.getvalue())
    as_json = [json.loads(line) for line in records[0].splitlines()]
    assert [(r["level"], r["logger"], r["message"]) for r in as_json] == [
        ("WARNING", "loraplane.test", "disk /x is 93% full"), ("ERROR", "loraplane.test", "failed")]
    assert "RuntimeError: boom" in as_json[1]["exception"] and set(as_json[0]) == {"time", "level", "logger",
                                                                                  "message"}
    text = [m.groupdict() for line in records[1].splitlines() if (m := TEXT_LINE.match(line))]
    assert [(t["level"], t["logger"], t["message"]) for t in text] == [
        (r["level"], r["logger"], r["message"]) for r in as_json]
    assert "RuntimeError: boom" in records[1]  # the traceback follows the line in text
    assert all(TEXT_LINE.match(f"{r['time']} X y: z") for r in as_json)  # one time format for both


@pytest.mark.parametrize(("path", "routine"), [
    ("/health", True), ("/metrics", True), ("/v1/engines/e1/heartbeat", True), ("http://h:1/metrics?x=1", True),
    ("/v1/tenancy/adapters", True), ("/v1/tenancy/keys/0123456789ab", True),
    ("/v1/load_lora_adapter", False), ("/healthz", False), ("/v1/engines/register", False)])
def test_routine_paths(path: str, routine: bool) -> None:
    assert is_routine(path) is routine


def test_a_change_of_tenancy_is_no_routine() -> None:
    assert not is_routine("/v1/tenancy/adapters/demo-poet", "PUT")


@pytest.mark.usefixtures("restore_logging")
def test_every_line_names_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for log_format in ("json", "text"):
        stream = io.StringIO()
        configure_logging("info", log_format, stream=stream, process="engine[local-1]")
        logging.getLogger("loraplane.test").warning("hello")
        line = stream.getvalue().strip()
        assert (json.loads(line)["process"] if log_format == "json" else line.split()[2]) == "engine[local-1]"
    monkeypatch.setenv("LORAPLANE_LOG_PROCESS", "engine[e2]")  # an engine's child processes inherit it
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    logging.getLogger("loraplane.test").warning("hello")
    assert json.loads(stream.getvalue())["process"] == "engine[e2]"


class _Ok(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(404 if self.path.endswith("/missing/heartbeat") else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.usefixtures("restore_logging")
def test_httpx_routine_requests_are_debug(server: str) -> None:
    stream = capture("info", "json")
    with httpx.Client() as client:
        client.post(server + "/v1/engines/e1/heartbeat")  # routine: hidden at INFO
        client.get(server + "/v1/lora_adapters")  # a poll (a GET sent): hidden
        client.post(server + "/v1/load_lora_adapter")  # a change: the receiver's access line is its one line
        client.post(server + "/v1/engines/missing/heartbeat")  # a failed call: shown
    shown = [json.loads(line)["message"] for line in stream.getvalue().splitlines()]
    assert len(shown) == 1 and "404" in shown[0], shown

    stream = capture("debug", "json")
    with httpx.Client() as client:
        client.post(server + "/v1/engines/e1/heartbeat")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["level"] for line in lines if line["logger"] == "httpx"] == ["DEBUG"]


@pytest.mark.usefixtures("restore_logging")
def test_uvicorn_access_lines_for_routine_paths_are_debug() -> None:
    """Records shaped as uvicorn's access log makes them (the e2e test in tests/e2e/test_up.py
    checks real uvicorn servers)."""
    stream = capture("info", "text")
    access = logging.getLogger("uvicorn.access")
    fmt = '%s - "%s %s HTTP/%s" %d'  # uvicorn/protocols/http/h11_impl.py and httptools_impl.py
    for method, path, status in (("POST", "/v1/engines/e1/heartbeat", 200), ("GET", "/metrics", 200),
                                 ("GET", "/health", 503), ("GET", "/v1/lora_adapters", 200)):
        access.info(fmt, "127.0.0.1:5", method, path, "1.1", status)
    shown = [TEXT_LINE.match(line)["message"] for line in stream.getvalue().splitlines()]
    assert shown == ['127.0.0.1:5 - "GET /health HTTP/1.1" 503', '127.0.0.1:5 - "GET /v1/lora_adapters HTTP/1.1" 200']


@pytest.mark.usefixtures("restore_logging")
def test_python_warnings_go_through_the_handler() -> None:
    import warnings

    stream = capture("info", "json")
    warnings.warn("an old spelling", FutureWarning, stacklevel=1)
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert line["level"] == "WARNING" and "an old spelling" in line["message"]
