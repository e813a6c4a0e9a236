"""A Docker build context as `docker build` would send it: the files under a root that `.dockerignore`
does not exclude, without Docker (base images cannot be pulled on the test machines).

The rules followed (Docker's moby/patternmatcher): one pattern a line, `#` starts a comment, a leading `/`
is dropped; `*` matches within one path element, `?` one character, `**` any number of elements; a
pattern that matches a directory excludes everything below it; `!pattern` re-includes; the last pattern
that matches a path decides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


@dataclass(frozen=True)
class IgnoreRules:
    rules: tuple[tuple[bool, re.Pattern[str]], ...]  # (re-include?, pattern)

    @classmethod
    def read(cls, path: Path) -> IgnoreRules:
        rules = []
        for raw in path.read_text().splitlines() if path.exists() else ():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((include, _regex(pattern)))
        return cls(tuple(rules))

    @property
    def has_exceptions(self) -> bool:
        return any(include for include, _ in self.rules)

    def excludes(self, relative: str) -> bool:
        """Whether the path (relative to the context root, `/`-separated) stays out of the context."""
        parts = relative.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]  # the path's dirs, then itself
        excluded = False
        for include, pattern in self.rules:
            if any(pattern.match(p) for p in prefixes):
                excluded = not include
        return excluded


def context_files(root: Path) -> list[Path]:
    """Every file of the build context rooted at `root`, relative to it, sorted."""
    rules = IgnoreRules.read(root / ".dockerignore")
    found: list[Path] = []
    for directory, dirs, files in os.walk(root):
        rel_dir = Path(directory).relative_to(root)
        if not rules.has_exceptions:  # nothing below an excluded directory can come back: skip it
            dirs[:] = [d for d in dirs if not rules.excludes((rel_dir / d).as_posix())]
        found += [rel_dir / f for f in files if not rules.excludes((rel_dir / f).as_posix())]
    return sorted(found)


def context_bytes(root: Path) -> int:
    return sum((root / f).stat().st_size for f in context_files(root))
