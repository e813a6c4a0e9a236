"""README.md and docs/*.md stay short, linked and free of history: the README has at most 250 lines and
no "(next)"; every relative link (image links too) names a file that exists, and an anchor into a
Markdown file names one of its headings; no "stop N" or "issue N" (git holds history)."""

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
_HISTORY = re.compile(r"\b[Ss]top [0-9]+\b|\b[Ii]ssue [0-9]+\b")
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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_narration(page: Path) -> None:
    text = page.read_text()
    found = [text[max(0, m.start() - 40):m.end() + 40] for m in _HISTORY.finditer(text)]
    assert found == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, too\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-too) [gone](missing.md) [bad](other.md#nothing)\n"
                    "![img](other.md) [web](https://example.com/x) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nothing: no such heading"]
