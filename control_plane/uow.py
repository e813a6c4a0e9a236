"""One mutating admin call = one transaction with its audit row, retried on a lost race.

`Mutation.run` is how every service changes state:
- `prepare` (optional) runs first, outside any transaction: slow checks such as reading adapter files;
- `work(session)` then runs under the write gate; the audit row is added and everything commits together;
- a unique-constraint violation means a concurrent call got there first: roll back and run `work` again,
  which now finds that call's rows (this is what makes concurrent identical loads converge);
- a refusal (LoraplaneError) rolls everything back, then records only the audit row with the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import audit
from control_plane.auth import Principal
from control_plane.db.session import WriteGate
from control_plane.metrics import ControlPlaneMetrics
from shared.errors import ConflictError, LoraplaneError

T = TypeVar("T")
P = TypeVar("P")
logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 8


class Mutation:
    def __init__(self, session: AsyncSession, gate: WriteGate, metrics: ControlPlaneMetrics) -> None:
        self.session = session
        self.gate = gate
        self.metrics = metrics

    async def run(
        self, actor: Principal, action: str, target: str,
        work: Callable[[AsyncSession, P], Awaitable[T]],
        prepare: Callable[[], Awaitable[P]] | None = None,
    ) -> T:
        try:
            prepared = await prepare() if prepare is not None else None
            result = await self._transact(actor, action, target, work, prepared)  # type: ignore[arg-type]
        except LoraplaneError as exc:
            await self._record_refusal(actor, action, target, f"{exc.status_code} {exc.error_type}")
            raise
        except Exception:
            await self._record_refusal(actor, action, target, "500 internal_error")
            raise
        self.metrics.mutations.labels(action, "ok").inc()
        return result

    async def _transact(self, actor: Principal, action: str, target: str,
                        work: Callable[[AsyncSession, P], Awaitable[T]], prepared: P) -> T:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            async with self.gate.hold():
                try:
                    result = await work(self.session, prepared)
                    self.session.add(audit.event(actor.token_id, action, target, "ok"))
                    await self.session.commit()
                    return result
                except IntegrityError:
                    await self.session.rollback()
                    logger.debug("%s on %r lost a race (attempt %d), retrying", action, target, attempt)
                    if attempt == MAX_ATTEMPTS:
                        raise ConflictError(f"{action} on {target!r} kept colliding with concurrent changes; "
                                            "retry the call") from None
                except BaseException:
                    await self.session.rollback()
                    raise
            await asyncio.sleep(random.uniform(0, 0.005 * attempt))  # jitter: let the winner commit
        raise AssertionError("unreachable")

    async def _record_refusal(self, actor: Principal, action: str, target: str, outcome: str) -> None:
        self.metrics.mutations.labels(action, outcome).inc()
        await audit.record_alone(self.session, self.gate, audit.event(actor.token_id, action, target, outcome))
