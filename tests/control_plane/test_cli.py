"""`loraplane control` flags: --lora-roots (as the engine spells it) and its deprecated alias --adapter-root;
--log-format. The subprocess tests run the real CLI (`db upgrade` on a fresh SQLite file: no server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from control_plane.cli import _parser, settings_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_loraplane_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LORAPLANE_")]:
        monkeypatch.delenv(name)


def settings(*flags: str):
    return settings_from_args(_parser().parse_args(list(flags)))


def test_lora_roots_like_the_engine(tmp_path: Path) -> None:
    a, b, c = (str(tmp_path / n) for n in "abc")
    s, deprecations = settings("--lora-roots", a, b, "--lora-roots", c)
    assert s.adapter_roots == (a, b, c) and deprecations == []


def test_default_replicas_flags_and_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    s, _ = settings("--default-min-replicas", "2", "--default-max-replicas", "all")
    assert (s.default_min_replicas, s.default_max_replicas) == (2, 0)  # 0: every engine
    monkeypatch.setenv("LORAPLANE_DEFAULT_MAX_REPLICAS", "5")
    assert settings()[0].default_max_replicas == 5
    assert settings("--default-max-replicas", "2")[0].default_max_replicas == 2  # the flag wins
    with pytest.raises(SystemExit):
        settings("--default-max-replicas", "some")
    assert "expected a count or 'all'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="below default_min_replicas"):
        settings("--default-min-replicas", "3", "--default-max-replicas", "2")


def test_adapter_root_still_works_and_says_it_is_deprecated(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    s, deprecations = settings("--adapter-root", a, "--lora-roots", b)
    assert s.adapter_roots == (b, a)
    assert deprecations == ["--adapter-root is deprecated; use --lora-roots DIR… (the same directories)"]


def test_lora_roots_from_the_environment_and_the_old_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLANE_ADAPTER_ROOTS", str(tmp_path / "old"))
    s, deprecations = settings()
    assert s.adapter_roots == (str(tmp_path / "old"),)
    assert deprecations == ["LORAPLANE_ADAPTER_ROOTS is deprecated; set LORAPLANE_LORA_ROOTS (the same value)"]
    monkeypatch.setenv("LORAPLANE_LORA_ROOTS", f"{tmp_path / 'x'}{os.pathsep}{tmp_path / 'y'}")
    s, deprecations = settings()  # the new name wins and nothing is deprecated
    assert s.adapter_roots == (str(tmp_path / "x"), str(tmp_path / "y")) and deprecations == []


def test_log_format_flag_and_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert settings()[0].log_format == "text"
    monkeypatch.setenv("LORAPLANE_LOG_FORMAT", "json")
    assert settings()[0].log_format == "json"
    assert settings("--log-format", "text")[0].log_format == "text"  # the flag beats the variable
    monkeypatch.setenv("LORAPLANE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):  # a bad variable is a usage error that names it, as a bad flag is
        settings()
    assert "LORAPLANE_LOG_FORMAT 'xml': expected text or json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings("--log-format", "xml")


def control(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    return subprocess.run([sys.executable, "-m", "shared.cli", "control", *flags, "--database-url",
                           f"sqlite+aiosqlite:///{tmp_path / 'control.db'}", "db", "upgrade"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_cli_warns_in_the_chosen_format_and_alembic_logs_in_it_too(tmp_path: Path) -> None:
    r = control(tmp_path, "--adapter-root", str(tmp_path), "--log-format", "json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines()]  # every line is one JSON object
    assert all(set(line) == {"time", "level", "process", "logger", "message"} for line in lines), lines
    assert {"level": "WARNING", "logger": "loraplane.control",
            "message": "--adapter-root is deprecated; use --lora-roots DIR… (the same directories)"} in [
        {k: v for k, v in line.items() if k not in ("time", "process")} for line in lines]
    assert any(line["logger"].startswith("alembic") and "upgrade" in line["message"] for line in lines), lines
    r = control(tmp_path, "--lora-roots", str(tmp_path))
    assert r.returncode == 0 and "deprecated" not in r.stderr, r.stderr
