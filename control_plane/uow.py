"""One mutating admin call = one transaction with its audit row, retried when that is safe.

`Mutation.run` is how every service changes state:
- `prepare` (optional) runs first, outside any transaction: slow checks such as reading adapter files;
- `work(session)` then runs in control_plane.db.transaction.transact (under the write gate, retried on lost
  races, deadlocks and connections that broke before the commit); the audit row (its actor `role:name`,
  control_plane.auth, and the `detail` made of the work's result) is added, unless `changed` says the
  work changed nothing, and everything commits together;
- a refusal (LoraplaneError) rolls everything back, then records only the audit row with the outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import audit
from control_plane.auth import Principal
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from control_plane.metrics import ControlPlaneMetrics
from shared.errors import LoraplaneError

T = TypeVar("T")
P = TypeVar("P")


class Mutation:
    def __init__(self, session: AsyncSession, gate: WriteGate, metrics: ControlPlaneMetrics) -> None:
        self.session = session
        self.gate = gate
        self.metrics = metrics

    async def run(
        self, actor: Principal, action: str, target: str,
        work: Callable[[AsyncSession, P], Awaitable[T]],
        prepare: Callable[[], Awaitable[P]] | None = None,
        changed: Callable[[T], bool] | None = None,
        detail: Callable[[T], dict[str, Any]] | None = None,
    ) -> T:
        """`changed(result)` False: the work changed nothing, and no `ok` row is recorded (a refusal still is);
        `detail(result)`: the `ok` row's detail (what the change was, e.g. a re-target's old and new base)."""
        try:
            prepared = await prepare() if prepare is not None else None
            result = await self._transact(actor, action, target, work, prepared, changed, detail)  # type: ignore[arg-type]
        except LoraplaneError as exc:
            await self._record_refusal(actor, action, target, f"{exc.status_code} {exc.error_type}")
            raise
        except Exception:
            await self._record_refusal(actor, action, target, "500 internal_error")
            raise
        self.metrics.mutations.labels(action, "ok").inc()
        return result

    async def _transact(self, actor: Principal, action: str, target: str,
                        work: Callable[[AsyncSession, P], Awaitable[T]], prepared: P,
                        changed: Callable[[T], bool] | None,
                        detail: Callable[[T], dict[str, Any]] | None) -> T:
        async def audited(session: AsyncSession) -> T:
            result = await work(session, prepared)
            if changed is None or changed(result):
                session.add(audit.event(actor.actor, action, target, "ok", detail(result) if detail else None))
            return result

        return await transact(self.session, self.gate, audited, what=f"{action} on {target!r}",
                              idempotent=False, races=True)

    async def _record_refusal(self, actor: Principal, action: str, target: str, outcome: str) -> None:
        self.metrics.mutations.labels(action, outcome).inc()
        await audit.record_alone(self.session, self.gate, audit.event(actor.actor, action, target, outcome))
