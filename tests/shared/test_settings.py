"""shared/settings.py: each process's config dataclass carries its flags, variables, defaults and help, and
the parsers, precedence and repr come from those fields."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from control_plane.settings import ControlPlaneSettings
from control_plane.up import UpConfig
from data_plane.config import EngineConfig
from data_plane.router.config import RouterConfig
from shared.settings import Alias, SettingsParser, deprecations, from_args, setting, settings_repr

CONFIGS = (EngineConfig, RouterConfig, ControlPlaneSettings, UpConfig)
# vLLM users type these engine flags; every other secret comes from the environment (or a file) only
SECRET_FLAGS = {"--api-key", "--admin-token", "--read-token", "--control-plane-token"}


def meta(cls: type) -> dict[str, object]:
    return {f.name: f.metadata["loraplane.setting"] for f in fields(cls)}


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_field_is_a_setting_with_help(cls: type) -> None:
    settings = meta(cls)
    assert all(s.help for s in settings.values()), [n for n, s in settings.items() if not s.help]
    assert all(s.env is None or s.env.startswith("LORAPLANE_") for s in settings.values())


@pytest.mark.parametrize("cls", CONFIGS)
def test_secrets_take_no_flag_but_the_engines_vllm_ones(cls: type) -> None:
    flags = {s.flag for s in meta(cls).values() if s.secret and s.flag}
    assert flags <= SECRET_FLAGS
    assert all(s.env for s in meta(cls).values() if s.secret)  # every secret has its variable


@pytest.mark.parametrize("name", ["host", "port", "log_level", "log_format"])
def test_the_options_the_processes_share_are_defined_once(name: str) -> None:
    found = [meta(cls)[name] for cls in CONFIGS if name in meta(cls)]
    assert len(found) >= 3
    same = {(s.flag, s.choices, s.group, s.parse) for s in found}
    assert len(same) == 1, same
    if name.startswith("log"):  # a process-independent variable too
        assert len({(s.env, s.help) for s in found}) == 1


@dataclass
class Example:
    name: str = setting("anon", flag="--name", env="LORAPLANE_EXAMPLE_NAME", help="a name")
    count: int = setting(2, flag="--count", help="a count")
    roots: tuple[str, ...] = setting((), flag="--roots", env="LORAPLANE_EXAMPLE_ROOTS", separators=",:",
                                     aliases=(Alias("--root", "the same folders"), Alias("LORAPLANE_EXAMPLE_OLD")),
                                     help="folders")
    token: str | None = setting(None, env="LORAPLANE_EXAMPLE_TOKEN", secret=True, help="a token")
    fast: bool = setting(True, flag="--fast", help="go fast")

    __repr__ = settings_repr


def example(argv: list[str], env: dict[str, str]) -> tuple[Example, list[str]]:
    args = SettingsParser(Example, env=env, prog="example").parse_args(argv)
    return from_args(Example, args), deprecations(args)


def test_a_flag_beats_its_variable_which_beats_the_default(tmp_path) -> None:
    assert example([], {}) == (Example(), [])
    assert example([], {"LORAPLANE_EXAMPLE_NAME": "env"})[0].name == "env"
    assert example(["--name", "flag"], {"LORAPLANE_EXAMPLE_NAME": "env"})[0].name == "flag"
    assert example(["--no-fast", "--count", "5"], {})[0] == Example(count=5, fast=False)
    (tmp_path / "token").write_text("from-a-file\n")
    assert example([], {"LORAPLANE_EXAMPLE_TOKEN_FILE": str(tmp_path / "token")})[0].token == "from-a-file"


def test_lists_and_their_deprecated_spellings() -> None:
    assert example([], {"LORAPLANE_EXAMPLE_ROOTS": "/a:/b, /c,"}) == (Example(roots=("/a", "/b", "/c")), [])
    config, warned = example(["--roots", "/a", "/b", "--root", "/c", "--roots", "/d"], {})
    assert config.roots == ("/a", "/b", "/d", "/c")
    assert warned == ["--root is deprecated; use --roots ROOTS… (the same folders)"]
    config, warned = example([], {"LORAPLANE_EXAMPLE_OLD": "/x"})
    assert config.roots == ("/x",)
    assert warned == ["LORAPLANE_EXAMPLE_OLD is deprecated; set LORAPLANE_EXAMPLE_ROOTS (the same value)"]


def test_help_shows_variables_and_defaults_and_repr_hides_secrets() -> None:
    text = SettingsParser(Example, prog="example").format_help()
    assert "a name ($LORAPLANE_EXAMPLE_NAME; default: anon)" in text
    assert "LORAPLANE_EXAMPLE_TOKEN (secret)" in text.split("environment variables without a flag")[1]
    assert "--no-fast" in text
    assert repr(Example(token="s3cr3t")) == ("Example(name='anon', count=2, roots=(), token=<hidden>, "
                                             "fast=True)")


def test_the_engine_core_drops_exactly_the_secret_fields() -> None:
    from data_plane.engine.core.process import SECRETS  # the fields the core process is given as None

    assert set(SECRETS) == {name for name, s in meta(EngineConfig).items() if s.secret}
