from pathlib import Path

import pytest

from control_plane.settings import ControlPlaneSettings


def test_defaults_use_a_sqlite_file_under_cwd() -> None:
    s = ControlPlaneSettings()
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert s.database_url == f"sqlite+aiosqlite:///{Path.cwd() / '.loraplane' / 'control.db'}"


def test_env_and_overrides() -> None:
    env = {"LORAPLANE_PORT": "9000", "LORAPLANE_ADMIN_TOKENS": "aaaa,bbbb", "LORAPLANE_READ_TOKENS": "rrrr",
           "LORAPLANE_DATABASE_URL": "postgresql://u:secret@db/x", "LORAPLANE_LORA_ROOTS": "/a:/b"}
    s = ControlPlaneSettings.from_env(env, port=9100, host=None)
    assert s.port == 9100 and s.host == "127.0.0.1"  # a flag beats the env; None means "not given"
    assert s.admin_tokens == ("aaaa", "bbbb") and s.read_tokens == ("rrrr",)
    assert s.database_url == "postgresql+asyncpg://u:secret@db/x"
    assert s.adapter_roots == ("/a", "/b")
    with pytest.warns(FutureWarning, match="LORAPLANE_ENGINE_TOKEN is deprecated; set LORAPLANE_ENGINE_ADMIN_TOKEN"):
        s = ControlPlaneSettings.from_env({"LORAPLANE_ENGINE_TOKEN": "eng", "LORAPLANE_ENGINE_STALE_AFTER_S": "5",
                                           "LORAPLANE_RECONCILE_CONCURRENCY": "3"})
    assert (s.engine_token_secret, s.engine_stale_after_s, s.reconcile_concurrency) == ("eng", 5.0, 3)


def test_engine_credentials_admin_token_and_networks_from_env() -> None:
    env = {"LORAPLANE_ENGINE_CREDENTIALS": " e1=tok-one, org/e:2=tok=two=,", "LORAPLANE_ENGINE_TOKEN": "old",
           "LORAPLANE_ENGINE_ADMIN_TOKEN": "new", "LORAPLANE_ENGINE_ALLOWED_NETWORKS": "10.0.0.0/8, fd00::/8"}
    s = ControlPlaneSettings.from_env(env)
    assert s.engine_credentials == {"e1": "tok-one", "org/e:2": "tok=two="}  # a token may hold `=`
    assert s.engine_token_secret == "new"  # LORAPLANE_ENGINE_ADMIN_TOKEN wins over its old name
    assert s.engine_allowed_networks == ("10.0.0.0/8", "fd00::/8")
    with pytest.warns(FutureWarning, match="LORAPLANE_ENGINE_TOKEN is deprecated"):  # the old name still works
        assert ControlPlaneSettings.from_env({"LORAPLANE_ENGINE_TOKEN": "old"}).engine_token_secret == "old"


@pytest.mark.parametrize("raw", ["e1", "e1=", "=zq9", "e1=zq9a,e1=zq9b", "../x=zq9", "e1=zq9 has space"])
def test_bad_engine_credentials_are_refused_without_echoing_tokens(raw: str) -> None:
    with pytest.raises(ValueError, match="(?i)engine.credentials") as info:
        ControlPlaneSettings.from_env({"LORAPLANE_ENGINE_CREDENTIALS": raw})
    assert "zq9" not in str(info.value)


def test_repr_hides_tokens_and_password() -> None:
    s = ControlPlaneSettings(admin_tokens=("s3cr3t-admin",), read_tokens=("s3cr3t-read",),
                             database_url="postgresql+asyncpg://u:hunter2@db/x", engine_token_secret="s3cr3t-engine",
                             engine_credentials={"e1": "s3cr3t-e1"})
    for text in (repr(s), str(s)):
        assert "s3cr3t" not in text and "hunter2" not in text
        assert "<1 hidden>" in text


@pytest.mark.parametrize("kwargs", [
    {"port": 0}, {"admin_tokens": ("has space",)}, {"admin_tokens": ("",)},
    {"admin_tokens": ("same",), "read_tokens": ("same",)}, {"database_url": "mysql://x/y"},
    {"reconcile_interval_s": 0}, {"database_url": "not a url"}, {"engine_stale_after_s": 0},
    {"engine_token_secret": "has space"}, {"engine_credentials": {"e1": "same", "e2": "same"}},
    {"engine_credentials": {"e1": "same"}, "admin_tokens": ("same",)}, {"engine_allowed_networks": ("10.0.0.0/33",)},
    {"log_format": "xml"}, {"log_level": "loud"}, {"reconcile_concurrency": 0},
])
def test_invalid_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        ControlPlaneSettings(**kwargs)
    assert "same" not in str(info.value) and "has space" not in str(info.value)  # never echo a token


def test_bad_env_number_names_the_variable() -> None:
    with pytest.raises(ValueError, match="LORAPLANE_PORT"):
        ControlPlaneSettings.from_env({"LORAPLANE_PORT": "eighty"})


def test_tokens_may_come_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text("file-admin-1,file-admin-2\n")
    s = ControlPlaneSettings.from_env({"LORAPLANE_ADMIN_TOKENS_FILE": str(tmp_path / "admin")})
    assert s.admin_tokens == ("file-admin-1", "file-admin-2")
    with pytest.raises(ValueError, match="LORAPLANE_READ_TOKENS_FILE"):
        ControlPlaneSettings.from_env({"LORAPLANE_READ_TOKENS_FILE": str(tmp_path / "missing")})


def test_repr_masks_the_artifact_stores_query_and_hides_every_secret() -> None:
    s = ControlPlaneSettings(artifact_store="s3://bucket/prefix?secret=s3cr3t", router_tokens=("s3cr3t-r",),
                             redis_url="redis://:s3cr3t@r/0", key_pepper="s3cr3t" * 8, ui_session_secret="s3cr3t" * 4)
    assert "s3cr3t" not in repr(s) and "artifact_store='s3://bucket/prefix'" in repr(s)
