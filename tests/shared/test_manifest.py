"""The manifest digest: defined by its text form, independent of file order, sensitive to every byte."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shared.manifest import ManifestEntry, files_digest, manifest_bytes, manifest_digest


def test_digest_is_sha256_of_sorted_tab_separated_lines(tmp_path: Path) -> None:
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "a.json").write_text("{}")
    expected_text = (
        f"a.json\t2\t{hashlib.sha256(b'{}').hexdigest()}\n"
        f"b.bin\t2\t{hashlib.sha256(bytes([0, 1])).hexdigest()}\n"
    )
    got = files_digest([tmp_path / "b.bin", tmp_path / "a.json"])
    assert got == hashlib.sha256(expected_text.encode()).hexdigest()
    assert got == files_digest([tmp_path / "a.json", tmp_path / "b.bin"])


def test_any_change_changes_the_digest(tmp_path: Path) -> None:
    f = tmp_path / "adapter_config.json"
    f.write_text('{"lora_alpha": 16}')
    before = files_digest([f])
    f.write_text('{"lora_alpha": 4096}')
    assert files_digest([f]) != before


def test_names_that_would_break_the_format_are_refused() -> None:
    for bad in ("a\tb", "a\nb", "dir/a", "", "a\0"):
        with pytest.raises(ValueError):
            manifest_bytes([ManifestEntry(bad, 1, "0" * 64)])
    with pytest.raises(ValueError):
        manifest_digest([ManifestEntry("a", 1, "0" * 64), ManifestEntry("a", 2, "1" * 64)])
