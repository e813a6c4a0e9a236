"""RouterConfig validation, and the secrets read from the environment or a file (never from flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_plane.router.cli import _parser
from data_plane.router.config import RouterConfig, RouterConfigError, secrets_from_env


@pytest.mark.parametrize(("fields", "words"), [
    ({"control_plane_url": "ftp://x"}, "http(s) URL"), ({"port": 70000}, "--port"),
    ({"router_token": "has space"}, "router token"), ({"api_keys": frozenset({""})}, "client API key"),
    ({"refresh_interval_s": 0}, "refresh_interval_s"), ({"max_attempts": 0}, "max_attempts"),
    ({"max_request_tokens": 0}, "--max-request-tokens"),
])
def test_bad_settings_are_refused_by_name(fields: dict, words: str) -> None:
    with pytest.raises(RouterConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RouterConfig(**{"control_plane_url": "http://cp:8080", **fields})


def test_secrets_from_the_environment_or_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1, k2,\n")
    env = {"LORAPLANE_ROUTER_TOKEN": "rt", "LORAPLANE_API_KEYS_FILE": str(keys)}
    assert secrets_from_env(env) == {"router_token": "rt", "engine_api_key": None, "api_keys": frozenset({"k1", "k2"}),
                                     "redis_url": None, "key_pepper": None}
    assert secrets_from_env({})["api_keys"] == frozenset()  # no keys: an open router
    with pytest.raises(RouterConfigError, match="LORAPLANE_ENGINE_API_KEY_FILE"):
        secrets_from_env({"LORAPLANE_ENGINE_API_KEY_FILE": str(tmp_path / "missing")})
    config = RouterConfig(control_plane_url="http://cp:8080/", **secrets_from_env(env))
    assert (config.control_plane_url, config.router_token) == ("http://cp:8080", "rt")


def test_no_flag_takes_a_secret() -> None:
    # a flag may name keys (--require-api-key, --key-cache-ttl-s) but not take one: no string value
    flags = {option for action in _parser()._actions for option in action.option_strings
             if action.nargs != 0 and action.type in (None, str)}
    assert not any(word in flag for flag in flags for word in ("token", "key", "redis-url"))


def test_repr_hides_every_secret() -> None:
    config = RouterConfig(control_plane_url="http://cp:8080", router_token="s3cr3t-router",
                          engine_api_key="s3cr3t-engine", api_keys=frozenset({"s3cr3t-client"}),
                          redis_url="redis://:s3cr3t-redis@redis:6379/0", key_pepper="s3cr3t-pepper-" + "x" * 32)
    text = repr(config)
    assert "s3cr3t" not in text
    assert "router_token=<hidden>" in text and "api_keys=<1 hidden>" in text and "control_plane_url='http://cp:8080'" in text


def test_flags_over_variables_over_defaults(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    base = ["--control-plane", "http://cp:8080"]
    assert _parser().parse_args(base).max_request_tokens is None
    monkeypatch.setenv("LORAPLANE_MAX_REQUEST_TOKENS", "5000")
    assert _parser().parse_args(base).max_request_tokens == 5000
    assert _parser().parse_args([*base, "--max-request-tokens", "7"]).max_request_tokens == 7
    monkeypatch.setenv("LORAPLANE_LOG_LEVEL", "debug")  # the variable every process reads
    assert _parser().parse_args(base).log_level == "debug"
    monkeypatch.setenv("LORAPLANE_MAX_REQUEST_TOKENS", "lots")
    with pytest.raises(SystemExit):
        _parser().parse_args(base)
    assert "LORAPLANE_MAX_REQUEST_TOKENS must be an integer, not 'lots'" in capsys.readouterr().err
