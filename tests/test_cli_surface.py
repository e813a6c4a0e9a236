"""The processes' command-line surface does not shrink: every flag that `loraplane engine|control|router
--help` listed, and every LORAPLANE_* variable the product code names, in tests/data/cli_surface.json
(taken before the packages were restructured), is still there. New flags and variables may be added;
one that goes away must be removed from the list on purpose, with the change that removes it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SURFACE = json.loads((REPO / "tests" / "data" / "cli_surface.json").read_text())
PRODUCT = ("control_plane", "data_plane", "shared")
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
_OPTION_LINE = re.compile(r"^\s+(-\S.*?)(?:\s{2,}|$)")  # "  --flag VALUE, --other   help": the invocation part
_VARIABLE = re.compile(r"LORAPLANE_[A-Z0-9_]+")


def help_flags(command: str) -> set[str]:
    """The long flags `loraplane <command> --help` lists as options (a wide terminal: one line each)."""
    env = {**os.environ, "COLUMNS": "2000"}
    result = subprocess.run([sys.executable, "-m", "shared.cli", command, "--help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    flags: set[str] = set()
    for line in result.stdout.splitlines():
        if option := _OPTION_LINE.match(line):
            flags |= set(_FLAG.findall(option.group(1)))
    return flags


def named_variables() -> set[str]:
    found: set[str] = set()
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            found |= set(_VARIABLE.findall(path.read_text()))
    return found


@pytest.mark.parametrize("command", sorted(SURFACE["flags"]))
def test_every_flag_is_still_listed(command: str) -> None:
    missing = sorted(set(SURFACE["flags"][command]) - help_flags(command))
    assert missing == [], f"`loraplane {command} --help` no longer lists {missing}"


def test_every_variable_is_still_read() -> None:
    missing = sorted(set(SURFACE["variables"]) - named_variables())
    assert missing == [], f"the product code no longer names {missing}"


def test_the_check_sees_flags() -> None:
    """The parse itself: the engine's help has its best-known flags, so an empty parse cannot pass."""
    assert {"--model", "--max-model-len", "--enable-lora", "--lora-modules"} <= help_flags("engine")
