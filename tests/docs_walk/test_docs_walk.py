"""The README and the docs pages it links, walked as a reader does: `make run` (then `make run
REQUIRE_API_KEY=1`) from a fresh folder, and every ```bash block, and every ```python block using the
openai client, pasted in order into one shell (tests/docs_walk/session.py). Every call answers 2xx unless
its line states another status; a block is skipped only where its page says why (`<!-- not run: … -->`).
A failure names the page, the line and the command, with the block's output."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs_walk.pages import Block, blocks_of, walk_blocks, walked_pages
from tests.docs_walk.ports import Ports
from tests.docs_walk.session import Session, mark_expected
from tests.docs_walk.stack import REPO, make_run, make_run_command, walker_env
from tests.e2e.test_control_plane_engines import _free_port
from tests.tools import require_tool


def test_make_runs_ports_are_rewritten_in_urls_only() -> None:
    text = ("curl -s http://127.0.0.1:8000/v1/models localhost:8080/v1/engines ENGINE=http://127.0.0.1:8100\n"
            "--port 8000 127.0.0.1:80000 localhost:8101 example.com:8080")
    assert Ports(router=18000, control=18080, engine=18100).substitute(text) == (
        "curl -s http://127.0.0.1:18000/v1/models localhost:18080/v1/engines ENGINE=http://127.0.0.1:18100\n"
        "--port 8000 127.0.0.1:80000 localhost:8101 example.com:8080")


def test_the_stack_is_started_by_make_runs_own_command() -> None:
    ports = Ports(router=18000, control=18080, engine=18100)
    assert make_run_command(ports, require_api_key=True) == [
        ".venv/bin/loraplane", "up", "--demo-dir", ".demo/model", "--host", "127.0.0.1", "--router-port", "18000",
        "--port", "18080", "--engine-port", "18100", "--engines", "1", "--require-api-key"]
    assert "--require-api-key" not in make_run_command(ports, require_api_key=False)


def test_a_stated_status_marks_its_command_only() -> None:
    text = ("curl -s localhost:8000/v1/models\n"
            "curl -s localhost:8000/v1/completions \\\n  -d '{\"model\": \"nope\"}'  # → 404 model_not_found\n"
            "# → 200 {\"a\": 1}\n"
            "curl -s localhost:8000/x  # → {\"name\": \"poet\"}\n")
    assert mark_expected(text).splitlines() == [
        "curl -s localhost:8000/v1/models",
        "CURL_EXPECT=404 curl -s localhost:8000/v1/completions \\",
        "  -d '{\"model\": \"nope\"}'  # → 404 model_not_found",
        "# → 200 {\"a\": 1}",
        "curl -s localhost:8000/x  # → {\"name\": \"poet\"}"]
    with pytest.raises(ValueError, match="starting with curl"):
        mark_expected("X=$(curl -s localhost:8000/x)  # → 404\n")


def test_directives_name_a_reason_and_a_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: needs a Kubernetes cluster -->\n```bash\nkubectl apply -f x\n```\n"
                    "```python\nprint(1)\n```\n```python\nfrom openai import OpenAI\n```\n")
    assert [(b.line, b.language, b.not_run) for b in blocks_of(page, "page.md")] == [
        (2, "bash", "needs a Kubernetes cluster"), (8, "python", None)]
    page.write_text("<!-- not run: a reason -->\n\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="right above a fence"):
        blocks_of(page, "page.md")
    page.write_text("<!-- not run: -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="name its reason"):
        blocks_of(page, "page.md")


def test_the_walk_covers_every_docs_page_and_says_why_it_skips_a_block() -> None:
    pages = walked_pages(REPO)
    assert pages[0] == "README.md"
    assert sorted(pages[1:]) == sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
    blocks = walk_blocks(REPO)
    skipped = [(b.where(), b.not_run) for b in blocks if b.not_run is not None]
    assert all(reason and len(reason) >= 10 for _, reason in skipped), skipped
    assert len(skipped) < len(blocks) / 2, skipped  # the pages are mostly runnable


def test_the_shell_fails_on_a_status_the_page_does_not_state(tmp_path: Path) -> None:
    """The harness itself: a 404 fails unless stated, and the failure names the page's line and command;
    variables carry from block to block."""
    ports = Ports(router=_free_port(), control=_free_port(), engine=_free_port())
    session = Session(tmp_path, tmp_path / "tools", ports, walker_env(tmp_path))
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(ports.router)],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        session.run(Block("p.md", 10, "bash", "sleep 1; WHERE=http://127.0.0.1:8000\n", None))
        assert session.run(Block("p.md", 20, "bash", "curl -s $WHERE/nothing-here  # → 404\necho done\n", None)
                           ).endswith("done\n")
        with pytest.raises(AssertionError) as failed:
            session.run(Block("p.md", 30, "bash", "echo first\ncurl -s $WHERE/nothing-here\necho never\n", None))
    finally:
        server.terminate()
        server.wait()
    message = str(failed.value)
    assert "p.md:32 exited 22" in message and "curl -s $WHERE/nothing-here" in message, message
    assert "HTTP 404 where the page expects 2xx" in message and "never" not in message, message


@pytest.mark.parametrize("require_api_key", [False, True], ids=["make-run", "make-run-REQUIRE_API_KEY"])
def test_a_reader_walks_the_readme_and_its_pages(require_api_key: bool, tmp_path: Path,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    for tool in ("curl", "jq", *(["redis-server"] if require_api_key else [])):  # the pages' own tools
        require_tool(tool)
    blocks = walk_blocks(REPO)
    folder = tmp_path / "clone"
    folder.mkdir()
    demo_cache = tmp_path_factory.getbasetemp() / "docs-walk-demo"
    started = time.monotonic()
    with make_run(folder, demo_cache, require_api_key) as ports:
        print(f"make run: up in {time.monotonic() - started:.1f} s")
        session = Session(folder, tmp_path / "walk", ports, walker_env(folder))
        try:
            for block in blocks:
                if block.not_run is None:
                    session.run(block)
        finally:
            print("seconds per block:", session.seconds)
    print("not run:", *(f"{b.where()}: {b.not_run}" for b in blocks if b.not_run), sep="\n  ")
    assert session.count == len([b for b in blocks if b.not_run is None])
