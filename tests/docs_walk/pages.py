"""The blocks a reader runs: README.md's, then those of each docs/*.md page it links, in the README's order.

A block is a ```bash fence, or a ```python fence that uses the openai client. An HTML comment on the line
right above a fence says how the walk treats it: `<!-- not run: REASON -->` skips it, saying why (a
Kubernetes cluster, a benchmark's minutes). A command that expects a status other than 2xx says so in a
comment on its line: `curl … # → 404 …`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*(not run|expect)\s*:?\s*(.*?)\s*-->")
_DOC_LINK = re.compile(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)")


@dataclass(frozen=True)
class Block:
    """One fenced block of `page`: `line` is its fence's line (1-based), `text` its body."""

    page: str
    line: int
    language: str
    text: str
    not_run: str | None  # the reason, when the page says it is not run

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.language} block)"


def blocks_of(path: Path, name: str) -> list[Block]:
    """The runnable-language blocks of one page, each with the directive right above it. A directive
    that stands above no fence, or names no reason, is an error (it would silently do nothing)."""
    text, found = path.read_text(), []
    fences = list(_FENCE.finditer(text))
    fence_lines = {text.count("\n", 0, m.start()) + 1 for m in fences}
    lines = text.splitlines()
    for number, text_line in enumerate(lines, start=1):
        directive = _DIRECTIVE.search(text_line)
        if directive and (number + 1 not in fence_lines or not directive.group(2)):
            raise ValueError(f"{name}:{number}: a directive must name its reason and stand right above a fence: "
                             f"{text_line}")
        if directive and directive.group(1) == "expect":
            raise ValueError(f"{name}:{number}: an expected status goes on the command's line: `curl … # → 404`")
    for match in fences:
        language, body = match.group(1), match.group(2)
        if language not in ("bash", "python") or (language == "python" and "from openai import" not in body):
            continue
        line = text.count("\n", 0, match.start()) + 1
        above = _DIRECTIVE.search(lines[line - 2]) if line >= 2 else None
        found.append(Block(name, line, language, body, above.group(2) if above else None))
    return found


def walked_pages(repo: Path) -> list[str]:
    """README.md, then each docs page it links, in the order of their first link."""
    linked = dict.fromkeys(m.group(1) for m in _DOC_LINK.finditer((repo / "README.md").read_text()))
    return ["README.md", *linked]


def walk_blocks(repo: Path) -> list[Block]:
    return [b for page in walked_pages(repo) for b in blocks_of(repo / page, page)]
