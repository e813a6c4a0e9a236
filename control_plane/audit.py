"""Writing audit_events rows that stand on their own: refusals, whose main transaction was rolled back
(or never began, as for a read token on a mutating call)."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import AuditEvent
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact

logger = logging.getLogger(__name__)


def event(actor: str, action: str, target: str, outcome: str, detail: dict[str, Any] | None = None) -> AuditEvent:
    return AuditEvent(actor=actor, action=action[:64], target=target[:256], outcome=outcome[:64], detail=detail)


async def record_alone(session: AsyncSession, gate: WriteGate, row: AuditEvent) -> None:
    """Commit just this row; a failure is logged, never raised — the caller's own error is what matters."""
    async def add(session: AsyncSession) -> None:
        session.add(row)

    try:
        await transact(session, gate, add, what=f"auditing a refused {row.action}", idempotent=False)
    except Exception:
        logger.exception("could not record the audit event of a refused %s", row.action)
