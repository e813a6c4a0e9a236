"""Secrets from the environment: `$NAME`, or the file named by `$NAME_FILE` (a mounted secret), never a flag."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def read_secret(env: Mapping[str, str], name: str) -> str | None:
    """$NAME, else the contents of the file $NAME_FILE (stripped), else None. ValueError names the
    variable and the file, never a value."""
    if env.get(name):
        return env[name].strip()
    path = env.get(name + "_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise ValueError(f"{name}_FILE: cannot read {path}: {exc.strerror}") from None
