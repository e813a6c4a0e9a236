"""Readable tables (rich) and --json output of the admin CLI's answers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

# Piped, rich would wrap tables at 80 columns; a log or `grep` reads better with whole rows.
console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def print_json(body: Any, *, one_line: bool = False) -> None:
    """The answer as JSON: indented, or one document per line (a stream of them, as --watch writes)."""
    sys.stdout.write(json.dumps(body, indent=None if one_line else 2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> Table:
    t = Table(*columns, title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for row in rows:
        t.add_row(*("-" if v is None or v == "" else str(v) for v in row))
    return t


def show(*renderables: Any) -> None:
    for r in renderables:
        console.print(r)


def when(iso: str | None) -> str:
    """A time as the server wrote it, shortened to the second (UTC)."""
    return iso[:19].replace("T", " ") if iso else "-"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def seconds(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def ownership(adapter: dict[str, Any]) -> str:
    """An adapter's owner tenant and whether it is public: `team-a (private)`, or `-` when nobody owns it."""
    if adapter.get("owner") is None:
        return "-"
    return f"{adapter['owner']} ({'public' if adapter.get('public') else 'private'})"


def engines(body: dict[str, Any]) -> None:
    """A push's outcome per engine (load, unload, activate, pin...)."""
    rows = [(e["engine"], e["desired"], e["outcome"], e.get("error")) for e in body.get("engines", [])]
    if rows:
        show(table(("ENGINE", "DESIRED", "OUTCOME", "ERROR"), rows))
    else:
        show("no engine was involved")
    if body.get("warning"):
        show(f"warning: {body['warning']}")
