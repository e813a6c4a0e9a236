"""`loraplane engine` flags → EngineConfig, for the multi-LoRA flags (vLLM spellings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_plane.api.server import build_parser, config_from_args
from data_plane.config import ConfigError, parse_lora_modules


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def config(model_dir: Path, *flags: str):
    return config_from_args(build_parser().parse_args(["--model", str(model_dir), *flags]))


def test_lora_flags(model_dir, tmp_path):
    c = config(
        model_dir,
        "--enable-lora",
        "--max-loras", "3",
        "--max-lora-rank", "32",
        "--max-cpu-loras", "8",
        "--lora-roots", "/a", "/b",
        "--lora-roots", "/c",
        "--lora-modules", "x=/a/x", '{"name": "y", "path": "/b/y"}',
        "--lora-modules", "z=/c/z",
        "--max-adapter-labels", "5",
        "--default-drain-timeout-s", "2.5",
    )  # fmt: skip
    assert c.enable_lora and (c.max_loras, c.max_lora_rank, c.max_cpu_loras) == (3, 32, 8)
    assert c.lora_roots == ["/a", "/b", "/c"]
    assert c.lora_modules == {"x": "/a/x", "y": "/b/y", "z": "/c/z"}
    assert c.max_adapter_labels == 5 and c.default_drain_timeout_s == 2.5


def test_lora_defaults(model_dir):
    c = config(model_dir)
    assert not c.enable_lora and c.lora_modules == {} and c.lora_roots == []
    c = config(model_dir, "--enable-lora", "--lora-modules", f"x={model_dir}/adapters/x")
    assert c.lora_roots == [str((model_dir / "adapters").resolve())]  # the modules' own folders


@pytest.mark.parametrize("item", ["noequals", "=path", "name=", '{"name": "x"}', "{not json"])
def test_bad_lora_modules(item):
    with pytest.raises(ConfigError):
        parse_lora_modules([item])


def test_duplicate_lora_module_and_modules_without_enable_lora(model_dir):
    with pytest.raises(ConfigError, match="twice"):
        parse_lora_modules(["x=/a", "x=/b"])
    with pytest.raises(ConfigError, match="--enable-lora"):
        config(model_dir, "--lora-modules", "x=/a/x")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("flags", "expected"), [
    ((), True), (("--enable-prefix-caching",), True), (("--no-enable-prefix-caching",), False)])
def test_prefix_caching_in_both_vllm_spellings(model_dir, flags, expected):
    assert config(model_dir, *flags).enable_prefix_caching is expected


def test_the_model_as_a_positional_argument_like_vllm_serve(model_dir):
    positional = config_from_args(parse(str(model_dir), "--enable-lora", "--max-loras", "2"))
    assert positional.model == str(model_dir) and positional.max_loras == 2
    assert config_from_args(parse(str(model_dir), "--model", str(model_dir))).model == str(model_dir)  # agreeing


def test_two_different_models_or_none_is_a_clear_error(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="given twice and differently"):
        config_from_args(parse(str(model_dir), "--model", str(tmp_path / "other")))
    with pytest.raises(ConfigError, match=r"no model given: loraplane engine MODEL \(or --model MODEL\)"):
        config_from_args(parse("--enable-lora"))


def test_log_format_flag_and_environment(monkeypatch):
    assert parse("m").log_format == "text"
    assert parse("m", "--log-format", "json").log_format == "json"
    monkeypatch.setenv("LORAPLANE_LOG_FORMAT", "json")
    assert parse("m").log_format == "json"
    monkeypatch.setenv("LORAPLANE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):  # a bad default from the environment is refused like a bad flag
        parse("m")


def test_heartbeat_interval_flag(model_dir):
    assert config(model_dir).heartbeat_interval_s == 3.0
    assert config(model_dir, "--heartbeat-interval-s", "0.5").heartbeat_interval_s == 0.5
    with pytest.raises(ConfigError, match="--heartbeat-interval-s"):
        config(model_dir, "--heartbeat-interval-s", "0")


def test_secrets_come_from_the_flag_the_variable_or_its_file_and_never_show_in_repr(model_dir, tmp_path,
                                                                                    monkeypatch):
    assert config(model_dir).api_key is None
    monkeypatch.setenv("LORAPLANE_API_KEY", "key-from-env")
    assert config(model_dir).api_key == "key-from-env"
    assert config(model_dir, "--api-key", "key-from-flag").api_key == "key-from-flag"  # the flag wins (vLLM's)
    monkeypatch.delenv("LORAPLANE_API_KEY")
    (tmp_path / "admin").write_text("admin-from-file\n")
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN_FILE", str(tmp_path / "admin"))  # a mounted secret
    c = config(model_dir, "--api-key", "s3cr3t-key")
    assert c.admin_token == "admin-from-file"
    assert "s3cr3t" not in repr(c) and "admin-from-file" not in repr(c) and "api_key=<hidden>" in repr(c)


def test_the_log_level_flag_and_variable(monkeypatch):
    assert parse("m").log_level == "info"
    monkeypatch.setenv("LORAPLANE_LOG_LEVEL", "DEBUG")  # as the control plane reads it, in any case
    assert parse("m").log_level == "debug"
    assert parse("m", "--log-level", "warning").log_level == "warning"


def test_a_bad_variable_is_a_usage_error_that_names_it(monkeypatch, capsys):
    monkeypatch.setenv("LORAPLANE_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit):
        parse("m")
    assert "LORAPLANE_LOG_LEVEL 'loud': expected critical, error, warning, info, debug or trace" in capsys.readouterr().err


def test_tool_calling_flags_as_vllms(model_dir):
    c = config(model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert c.enable_auto_tool_choice and c.tool_call_parser == "llama3_json"
    assert not config(model_dir).enable_auto_tool_choice
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        config(model_dir, "--enable-auto-tool-choice")
    with pytest.raises(SystemExit):  # argparse's usage error: "invalid choice: 'pythonic'"
        config(model_dir, "--tool-call-parser", "pythonic")
