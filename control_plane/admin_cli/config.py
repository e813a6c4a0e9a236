"""Where the control plane is and which token to send: flag, then environment, then profile file.

    --url / LORAPLANE_URL / profile `url` (default http://127.0.0.1:8080)
    --token / LORAPLANE_TOKEN / profile `token` (prefer the environment or the profile: a flag's value
        is left in the process list and in shell history)
    --profile / LORAPLANE_PROFILE (default "default"): a table of the profile file,
        LORAPLANE_CONFIG or $XDG_CONFIG_HOME/loraplane/profiles.toml (~/.config/loraplane/profiles.toml)

    # ~/.config/loraplane/profiles.toml (chmod 600: it holds tokens)
    [default]
    url = "http://127.0.0.1:8080"
    token = "…"
    [prod]
    url = "https://loraplane.internal:8080"
    token = "…"
"""

from __future__ import annotations

import os
import stat
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8080"


class ConfigError(Exception):
    """The profile file or a setting cannot be used (the message says why)."""


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None
    timeout_s: float


def profile_path() -> Path:
    if os.environ.get("LORAPLANE_CONFIG"):
        return Path(os.environ["LORAPLANE_CONFIG"])
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "loraplane" / "profiles.toml"


def _profile(name: str | None) -> dict[str, str]:
    """The named table of the profile file; {} when there is no file and no profile was asked for."""
    path = profile_path()
    chosen = name or os.environ.get("LORAPLANE_PROFILE")
    if not path.exists():
        if chosen:
            raise ConfigError(f"profile {chosen!r} asked for, but there is no profile file at {path}")
        return {}
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read the profile file {path}: {exc}") from None
    table = profiles.get(chosen or "default", {})
    if chosen and chosen not in profiles:
        raise ConfigError(f"no profile {chosen!r} in {path} (it has: {', '.join(sorted(profiles)) or 'none'})")
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f"profile {chosen or 'default'!r} in {path} must be a table of strings (url, token)")
    if "token" in table and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"loraplane: warning: {path} holds a token and others may read it (chmod 600 it)", file=sys.stderr)
    return table


def resolve(url: str | None, token: str | None, profile: str | None, timeout_s: float) -> Target:
    """Flags over the environment over the profile file."""
    table = _profile(profile)
    chosen_url = url or os.environ.get("LORAPLANE_URL") or table.get("url") or DEFAULT_URL
    if not chosen_url.startswith(("http://", "https://")):
        raise ConfigError(f"the control plane's URL must start with http:// or https://, not {chosen_url!r}")
    chosen_token = token or os.environ.get("LORAPLANE_TOKEN") or table.get("token") or None
    return Target(url=chosen_url.rstrip("/"), token=chosen_token, timeout_s=timeout_s)
