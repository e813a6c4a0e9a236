"""Pusher: carry out the planner's PushOrders after the desired state has committed, and record answers.

All engines are called at once (asyncio.gather). Each answer lands on its placement rows: a load that
succeeded is observed `loaded` (the adapter's other versions on that engine `absent`, since the engine
replaced them in place), an unload `absent`, a failure `failed` with the error in `last_error`. Loads
are sent with `load_inplace`, so an engine switching versions lets in-flight requests finish on the old,
and with `expected_sha256`, the version's manifest digest, so that files edited after the version was
recorded are refused by the engine (and recorded as a failure) instead of being served as that version.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import ColumnElement, and_, or_, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DesiredState, ObservedState, Placement
from control_plane.db.session import WriteGate
from control_plane.domain.adapters.placement import PushOrder, lock_placements, of_adapter
from control_plane.domain.adapters.schemas import EngineOutcome
from control_plane.engine_client import EngineCallError, EngineClient
from control_plane.uow import transact

logger = logging.getLogger(__name__)


class Pusher:
    def __init__(self, client: EngineClient, session: AsyncSession, gate: WriteGate) -> None:
        self.client = client
        self.session = session
        self.gate = gate

    async def push(self, orders: list[PushOrder]) -> list[EngineOutcome]:
        if not orders:
            return []
        outcomes = list(await asyncio.gather(*(self._one(o) for o in orders)))
        await self._record(orders, outcomes)
        return outcomes

    async def _one(self, order: PushOrder) -> EngineOutcome:
        try:
            if order.action == "load":
                await self._load(order)
                done = "loaded"
            else:
                await self.client.unload(order.url, order.adapter)
                done = "unloaded"
        except EngineCallError as exc:
            error = exc.message if order.version is None else f"version {order.version}: {exc.message}"
            logger.warning("push %s %s to engine %s failed: %s", order.action, order.adapter, order.engine, error)
            return EngineOutcome(engine=order.engine, desired=order.desired, outcome="failed", error=error)
        return EngineOutcome(engine=order.engine, desired=order.desired, outcome=done)

    async def _load(self, order: PushOrder) -> None:
        """Load with `expected_sha256`: the engine refuses files that are not the recorded version (409
        sha256_mismatch). An engine that answers with another digest anyway (one that ignores the field)
        is a failure too: `loaded` is recorded only for the recorded bytes."""
        assert order.path is not None and order.sha256 is not None
        loaded = await self.client.load(order.url, order.adapter, order.path,
                                        pinned=order.desired == DesiredState.PINNED.value, load_inplace=True,
                                        expected_sha256=order.sha256)
        if loaded.sha256 != order.sha256:
            raise EngineCallError(f"the engine loaded sha256 {loaded.sha256[:16]}…, not the recorded "
                                  f"{order.sha256[:16]}…")

    async def _record(self, orders: list[PushOrder], outcomes: list[EngineOutcome]) -> None:
        async def record(session: AsyncSession) -> None:
            await lock_placements(session, self._touched(orders))  # ascending id, as every placement writer
            for order, outcome in zip(orders, outcomes, strict=True):
                await self._record_one(order, outcome)

        try:
            # idempotent (it writes what the engines answered), so retried on deadlocks and lost connections
            await transact(self.session, self.gate, record, what="recording a push", idempotent=True)
        except Exception:
            # The engines' answers are already in the reply; the reconciler re-reads them later.
            logger.exception("could not record the engines' answers to a push")

    @staticmethod
    def _touched(orders: list[PushOrder]) -> ColumnElement[bool]:
        """The rows `_record_one` may update: the orders' own, and the loaded adapters' other versions on
        those engines."""
        ids = [i for order in orders for i in order.placement_ids]
        loads = [and_(Placement.engine_id == o.engine_id, of_adapter(o.adapter_id))
                 for o in orders if o.action == "load" and o.adapter_id is not None]
        return or_(Placement.id.in_(ids), *loads)

    async def _record_one(self, order: PushOrder, outcome: EngineOutcome) -> None:
        observed = {"loaded": ObservedState.LOADED, "unloaded": ObservedState.ABSENT}.get(
            outcome.outcome, ObservedState.FAILED).value
        await self.session.execute(update(Placement).where(Placement.id.in_(order.placement_ids))
                                   .values(observed=observed, last_error=outcome.error))
        if outcome.outcome == "loaded" and order.adapter_id is not None:
            # load_inplace replaced whatever version of the adapter the engine held before
            await self.session.execute(update(Placement).where(
                Placement.engine_id == order.engine_id, Placement.id.not_in(order.placement_ids),
                of_adapter(order.adapter_id), Placement.desired == DesiredState.ABSENT.value,
            ).values(observed=ObservedState.ABSENT.value, last_error=None))
