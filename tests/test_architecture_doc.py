"""docs/architecture.md describes what exists: every repository path it names is there, and its request
path names each hop (router -> engine API -> core over ZeroMQ -> scheduler -> runner -> LoRA layers ->
sampler -> back) with the module that does it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text()
# `a/b.py`, `a/b/`, `pyproject.toml`: code spans that name something in the repository
_PATH = re.compile(r"`([A-Za-z_][\w.-]*(?:/[\w.-]+)*/?)`")
_ROOTS = ("control_plane", "data_plane", "shared", "migrations", "tests", "deploy", "bench", "docs")
HOPS = {  # a hop's heading in the request path, and the module it must name
    "Router": "data_plane/router/service.py",
    "Engine API": "data_plane/api/app.py",
    "To the core over ZeroMQ": "data_plane/engine/core/client.py",
    "Scheduler": "data_plane/engine/scheduler.py",
    "Runner": "data_plane/engine/model_runner.py",
    "LoRA layers": "data_plane/lora/layers.py",
    "Sampler": "data_plane/model/sampler.py",
    "Back": "data_plane/api/streaming.py",
}


def named_paths(text: str) -> set[str]:
    found = {m for m in _PATH.findall(text) if m.startswith(_ROOTS) or m == "pyproject.toml"}
    return {m for m in found if "/" in m or m == "pyproject.toml"}  # not dotted module names


def request_path(text: str) -> list[str]:
    """The numbered hops of the request-path section, in order: each item's bold lead and its text."""
    section = text.split("## The request path", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d+\. \*\*)", section)[1:]


def test_every_path_it_names_exists() -> None:
    paths = named_paths(DOC)
    assert len(paths) > 40, sorted(paths)  # the parse found the document's paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_request_path_names_each_hop_in_order() -> None:
    hops = request_path(DOC)
    leads = [re.match(r"\d+\. \*\*(.+?)\.?\*\*", hop).group(1) for hop in hops]  # type: ignore[union-attr]
    assert [h for h in leads if h in HOPS] == list(HOPS), leads
    for hop in hops:
        lead = re.match(r"\d+\. \*\*(.+?)\.?\*\*", hop).group(1)  # type: ignore[union-attr]
        if lead in HOPS:
            assert f"`{HOPS[lead]}`" in hop, f"the {lead} hop does not name {HOPS[lead]}"


def test_the_checks_catch_a_missing_path_and_a_missing_hop() -> None:
    assert named_paths("see `data_plane/nowhere.py` and `shared/peft.py`") == {"data_plane/nowhere.py",
                                                                            "shared/peft.py"}
    text = "## The request path\n\n1. **Router.** `data_plane/router/service.py`\n2. **Sampler.** x\n\n## Next\n"
    assert [h.split("**")[1] for h in request_path(text)] == ["Router.", "Sampler."]
