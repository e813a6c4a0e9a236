"""Secrets from the environment: `$NAME`, or the file named by `$NAME_FILE` (a mounted secret), never a flag;
and an environment without them, for a child process that calls nobody."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

_SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|API_KEY|ACCESS_KEY", re.IGNORECASE)


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


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the variables whose names say they hold a secret (the engine core's and the adapter
    readers' environment: they call nobody and serve no one)."""
    return {k: v for k, v in environ.items() if not _SECRET_ENV.search(k)}
