"""The console's session cookie: what signs in, and every way a cookie stops being a session."""

from __future__ import annotations

import dataclasses

import pytest

from control_plane.settings import ControlPlaneSettings
from control_plane.ui import session as console_session
from control_plane.ui.session import SessionCodec

SETTINGS = ControlPlaneSettings(admin_tokens=("admin-token-1",), read_tokens=("read-token-1",),
                                ui_session_secret="a-secret-of-sixteen-or-more")


def test_tokens_sign_in_with_their_role_and_the_cookie_reads_back() -> None:
    codec = SessionCodec(SETTINGS)
    assert codec.role_of("admin-token-1") == "admin" and codec.role_of("read-token-1") == "read"
    assert codec.role_of("admin-token-") is None and codec.role_of("") is None
    issued, cookie = codec.issue("read", "read-token-1")
    assert "read-token-1" not in cookie  # the token id, never the token
    assert codec.read(cookie) == issued and not issued.can_act
    assert SessionCodec(SETTINGS).read(cookie) == issued  # another replica with the same secret


def test_forged_tampered_expired_or_revoked_cookies_are_no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = SessionCodec(SETTINGS)
    _, cookie = codec.issue("read", "read-token-1")
    _, admin_cookie = codec.issue("admin", "admin-token-1")
    payload, _, signature = cookie.partition(".")
    assert codec.read(f"{admin_cookie.partition('.')[0]}.{signature}") is None  # a payload swapped in
    assert codec.read(payload + ".") is None and codec.read("") is None and codec.read(None) is None
    other = SessionCodec(dataclasses.replace(SETTINGS, ui_session_secret="another-secret-of-sixteen"))
    assert other.read(cookie) is None  # signed under another secret
    revoked = SessionCodec(dataclasses.replace(SETTINGS, read_tokens=("read-token-2",)))
    assert revoked.read(cookie) is None  # its token is no longer configured
    monkeypatch.setattr(console_session.time, "time", lambda: 10**12)
    assert codec.read(cookie) is None  # expired


def test_an_unset_secret_is_random_per_process_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    unset = dataclasses.replace(SETTINGS, ui_session_secret=None)
    _, cookie = SessionCodec(unset).issue("admin", "admin-token-1")
    assert SessionCodec(unset).read(cookie) is None
    assert "do not survive a restart nor span replicas" in caplog.text
    with pytest.raises(ValueError, match="at least 16"):
        dataclasses.replace(SETTINGS, ui_session_secret="short")
    assert "a-secret" not in repr(SETTINGS)
    assert ControlPlaneSettings.from_env({"LORAPLANE_UI_SESSION_SECRET": "x" * 20}).ui_session_secret == "x" * 20
