"""VerifiedFiles: a recorded sha256 is answered only for the very file verified, unchanged since."""

from __future__ import annotations

import os
from pathlib import Path

from data_plane.adapters.artifacts.verified_files import VerifiedFiles


def test_an_unchanged_file_is_known_and_any_write_or_replacement_forgets_it(tmp_path: Path) -> None:
    verified = VerifiedFiles()
    f = tmp_path / "adapter_model.safetensors"
    f.write_bytes(b"x" * 100)
    verified.remember(f, "a" * 64)
    assert verified.sha256_of(f) == "a" * 64
    assert verified.sha256_of(tmp_path / "other") is None

    with f.open("r+b") as fh:  # same size, new content: the mtime moves
        fh.write(b"y")
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert verified.sha256_of(f) is None

    verified.remember(f, "b" * 64)
    replacement = tmp_path / "new"
    replacement.write_bytes(b"y" + b"x" * 99)
    os.utime(replacement, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns))  # even the same mtime
    replacement.replace(f)  # another inode
    assert verified.sha256_of(f) is None


def test_forget_under_drops_a_folder_only(tmp_path: Path) -> None:
    verified = VerifiedFiles()
    for folder in ("d1", "d10"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "w").write_bytes(b"w")
        verified.remember(tmp_path / folder / "w", folder * 32)
    verified.forget_under(tmp_path / "d1")
    assert verified.sha256_of(tmp_path / "d1" / "w") is None
    assert verified.sha256_of(tmp_path / "d10" / "w") == "d10" * 32
