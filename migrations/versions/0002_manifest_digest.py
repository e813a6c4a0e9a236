"""manifest digest: adapter_versions.sha256 becomes the manifest digest of the version's files

Revision ID: 0002_manifest_digest
Revises: 0001
Create Date: 2026-12-02

Until 0001 a version's sha256 was loraplane's first content hash (the files in name order, each framed by
its name and size). From here on it is the manifest digest of shared.manifest (sha256 over the sorted
`name<TAB>size<TAB>sha256` lines of adapter_config.json and adapter_model.safetensors): the value pushes
carry as `expected_sha256`, engines compute and compare, and the prefix-cache namespace derives from.

For each existing version, the files at its `uri` are read and the old hash recomputed first:
- the files are readable and still hash to the recorded value → sha256 becomes their manifest digest;
- otherwise (missing, unreadable, or edited since they were registered) → the old value is KEPT, and
  a warning names the version. Recomputing from edited files would launder the edit into the version's
  identity; keeping the old value means every engine refuses to load that version (its digest can match
  no files), and the refusal is recorded on the placement. Register the intended files again to get a
  new, loadable version.
The downgrade does the same in reverse (manifest digest → old hash, only for files that still match).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from shared.manifest import files_digest

revision = "0002_manifest_digest"
down_revision = "0001"
branch_labels = None
depends_on = None

logger = logging.getLogger("alembic.runtime.migration")
_FILES = ("adapter_config.json", "adapter_model.safetensors")
_versions = sa.table("adapter_versions", sa.column("id", sa.BigInteger), sa.column("uri", sa.String),
                     sa.column("sha256", sa.String), sa.column("number", sa.Integer))


def legacy_sha256(files: list[Path]) -> str:
    """The hash of revision 0001 (frozen here: the migration must not change with the code)."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        digest.update(f.name.encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _rehash(old: Callable[[list[Path]], str], new: Callable[[list[Path]], str]) -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.select(_versions.c.id, _versions.c.uri, _versions.c.sha256, _versions.c.number)).all()
    for row in rows:
        files = [Path(row.uri) / name for name in _FILES]
        try:
            matches = old(files) == row.sha256
            replacement = new(files) if matches else None
        except (OSError, ValueError) as exc:
            logger.warning("adapter version id %s (v%s at %s): files not readable (%s); sha256 kept",
                           row.id, row.number, row.uri, type(exc).__name__)
            continue
        if replacement is None:
            logger.warning("adapter version id %s (v%s at %s): files changed since registration; sha256 kept, "
                           "so engines will refuse to load it", row.id, row.number, row.uri)
            continue
        conn.execute(sa.update(_versions).where(_versions.c.id == row.id).values(sha256=replacement))


def upgrade() -> None:
    _rehash(legacy_sha256, files_digest)


def downgrade() -> None:
    _rehash(files_digest, legacy_sha256)
