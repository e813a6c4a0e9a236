"""Uploads against a real `loraplane control` over raw sockets: a body declared too large is refused
before a byte of it is read, a client that stops sending is cut off and its connection closed (what a
slow-upload attack holds open otherwise), and a control plane killed mid-upload leaves no spool behind
once it starts again."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control_plane.artifacts.upload import BODY_OVERHEAD
from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.e2e.test_control_plane_engines import ADMIN, control_plane

CAP = 64 << 10  # --max-artifact-bytes
IDLE_S = 1.0  # --upload-idle-timeout-s


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("upload-connections")
    with control_plane(tmp, tmp, flags=("--max-artifact-bytes", str(CAP),
                                        "--upload-idle-timeout-s", str(IDLE_S))) as url:
        yield url


def head(name: str, content_length: int) -> bytes:
    return (f"POST /v1/lora_adapters/{name}/versions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN}"
            f"\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: {content_length}\r\n\r\n").encode()


def answer_and_close(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection (a timeout here: it kept it open), and
    how long the answer's first byte took."""
    start = time.monotonic()
    sock.settimeout(within_s)
    received, first = b"", None
    while chunk := sock.recv(65536):
        first = first if first is not None else time.monotonic() - start
        received += chunk
    assert first is not None, "the server closed the connection without an answer"
    return received, first


def audit_outcomes(url: str, name: str) -> list[str]:
    events = httpx.get(f"{url}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()["data"]
    return [e["outcome"] for e in events if e["target"] == name]


def test_a_content_length_over_the_cap_is_413_before_any_byte_is_read(cp: str) -> None:
    port = int(cp.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head("huge", CAP + BODY_OVERHEAD + 1))  # the headers only: not one byte of the body
        received, took = answer_and_close(sock, 10)
    status, _, rest = received.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 "), received[:300]
    assert b"Content-Length" in rest and b"nothing was read" in rest and b"--max-artifact-bytes" in rest
    assert took < 2  # at once: the server did not wait for the body
    assert audit_outcomes(cp, "huge") == ["413 invalid_request_error"]


def test_an_upload_that_stops_sending_is_cut_off_and_its_connection_closed(cp: str) -> None:
    port = int(cp.rsplit(":", 1)[1])
    part = b'--b\r\nContent-Disposition: form-data; name="files"; filename="adapter_config.json"\r\n\r\n{"r": 8'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head("stalled", CAP // 2) + part)  # then nothing more
        received, took = answer_and_close(sock, IDLE_S + 10)
    assert received.startswith(b"HTTP/1.1 408 "), received[:300]
    assert b"sent nothing for 1 s" in received and b"--upload-idle-timeout-s" in received
    assert IDLE_S * 0.9 < took < IDLE_S + 10
    assert audit_outcomes(cp, "stalled") == ["408 invalid_request_error"]


def test_a_spool_left_by_a_killed_control_plane_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """SIGKILL during an upload: the spool lies under the control plane's data folder (not the system's
    temporary folder), and the next `loraplane control` on that folder removes it as it starts."""
    data = tmp_path / "data"
    flags = ("--data-dir", str(data), "--upload-idle-timeout-s", "60")
    part = (b'--b\r\nContent-Disposition: form-data; name="files"; filename="adapter_model.safetensors"\r\n\r\n'
            + b"\0" * (64 << 10))
    with control_plane(tmp_path, tmp_path, flags=flags) as url, \
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(head("killed", 1 << 20) + part)  # the upload is under way, its spool half written
        deadline = time.monotonic() + 20
        while not (spooled := [p for p in data.glob("spool/p*/spool-*/*") if p.stat().st_size > 0]):
            assert time.monotonic() < deadline, "the upload was never spooled under --data-dir"
            time.sleep(0.05)
        process_folder = spooled[0].parents[1]
        os.kill(int(process_folder.name[1:]), signal.SIGKILL)
        while Path(f"/proc/{process_folder.name[1:]}/status").exists() and \
                "zombie" not in Path(f"/proc/{process_folder.name[1:]}/status").read_text():
            time.sleep(0.05)
    assert spooled[0].exists()  # what the killed process left
    with control_plane(tmp_path, tmp_path, flags=flags) as url:
        assert not process_folder.exists()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_store_objects_no_version_names_are_collected_past_the_grace_period(tmp_path: Path) -> None:
    """What a kill between the store's put and the commit leaves (an object without a row) goes at the next
    start once older than --store-gc-grace-s, audited and counted; a young one, and every object a version
    names, stay."""
    store = tmp_path / "store"
    flags = ("--artifact-store", store.as_uri(), "--store-gc-grace-s", "600")
    demo = tmp_path / "adapters"
    write_demo_model(tmp_path / "base", seed=0)
    write_demo_adapters(tmp_path / "base", demo)
    with control_plane(tmp_path, demo, flags=flags) as url:
        files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in sorted(
            (demo / "demo-poet").iterdir())]
        r = httpx.post(f"{url}/v1/lora_adapters/kept/versions", files=files, data={"base_model": "demo"},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code in (200, 207), r.text
    kept = sorted((store / "blobs").iterdir())
    old, young = store / "blobs" / ("a" * 64), store / "blobs" / ("b" * 64)
    old.write_bytes(b"left by a killed upload")
    young.write_bytes(b"an upload about to commit")
    an_hour_ago = time.time() - 3600
    for path in (old, *kept):
        os.utime(path, (an_hour_ago, an_hour_ago))
    with control_plane(tmp_path, demo, flags=flags) as url:
        deadline = time.monotonic() + 20
        while old.exists():
            assert time.monotonic() < deadline, "the orphaned object was never collected"
            time.sleep(0.1)
        assert young.exists() and all(p.exists() for p in kept)
        events = httpx.get(f"{url}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()["data"]
        swept = [e for e in events if e["action"] == "collect_store_orphans"]
        assert [(e["actor"], e["outcome"]) for e in swept] == [("system:store-gc", "ok")], swept
        assert "loraplane_control_store_orphans_removed_total 1.0" in httpx.get(f"{url}/metrics", timeout=10).text
        r = httpx.get(f"{url}/v1/lora_adapters/kept", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert r.status_code == 200
