"""README.md and docs/*.md stay short, linked and free of history: the README has at most 250 lines and
no "(next)"; every relative link (image links too) names a file that exists, and an anchor into a
Markdown file names one of its headings; no "stop N" or "issue N" (git holds history), in the pages nor
in any Python file of control_plane, data_plane, shared, bench and tests. Code that points at a section
of docs/performance.md (where measured figures live, not in docstrings) names one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HISTORY = re.compile(r"\bstop [0-9]+\b|\bissue [0-9]+\b", re.I)
CODE_DIRS = ("control_plane", "data_plane", "shared", "bench", "tests")
PERFORMANCE = REPO / "docs" / "performance.md"
_PERFORMANCE_POINTER = re.compile(r"docs/performance\.md#([\w-]+)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Link targets that point into the repository (no scheme, no mail, no bare anchor)."""
    targets = [m.group(1) for m in _LINK.finditer(prose(text))]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in _HEADING.findall(_FENCE.sub("", path.read_text()))}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page.read_text()):
        file_part, _, fragment = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    return broken


def test_the_readme_is_short_and_promises_nothing() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md: {len(text.splitlines())} lines"
    assert "(next)" not in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def history(text: str) -> list[str]:
    """Each "stop N" / "issue N" (any case) in `text`, with some context."""
    return [text[max(0, m.start() - 40):m.end() + 40] for m in _HISTORY.finditer(text)]


def code_files() -> list[Path]:
    return sorted(f for d in CODE_DIRS for f in (REPO / d).rglob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_narration(page: Path) -> None:
    assert history(page.read_text()) == []


def test_no_history_narration_in_code() -> None:
    found = {str(f.relative_to(REPO)): h for f in code_files() if (h := history(f.read_text()))}
    assert found == {}


def test_code_points_at_headings_of_the_performance_page() -> None:
    headings = anchors(PERFORMANCE)
    sources = [*code_files(), *sorted((REPO / "data_plane").rglob("*.cpp"))]
    pointers = {(f, a) for f in sources for a in _PERFORMANCE_POINTER.findall(f.read_text())}
    assert pointers  # the check has something to check
    assert {f"{f.relative_to(REPO)}: #{a}" for f, a in pointers if a not in headings} == set()


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, too\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-too) [gone](missing.md) [bad](other.md#nothing)\n"
                    "![img](other.md) [web](https://example.com/x) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nothing: no such heading"]


def test_the_history_check_finds_stop_and_issue_numbers_in_any_case() -> None:
    number = " 29"  # kept apart, so that this file does not hold what it checks for
    assert len(history(f"until Stop{number} it did; issue{number} says; ISSUE{number} §3")) == 3
    assert history("stops 3 times, issues 10,000 tokens, stop_10, issue-14") == []
