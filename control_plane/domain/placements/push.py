"""Pusher: carry out the planner's PushOrders after the desired state has committed, and record answers.

All engines are called at once (asyncio.gather). Each answer lands on its placement rows through
answers.record_answers, the rule the reconciler uses too. Loads are sent with `load_inplace`, so an engine
switching versions lets in-flight requests finish on the old, and with `expected_sha256`, the version's
manifest digest, so that files edited after the version was recorded are refused by the engine (and
recorded as a failure) instead of being served as that version.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DesiredState, ObservedState
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from control_plane.domain.placements.answers import EngineAnswer, record_answers
from control_plane.domain.placements.loads import VersionLoader
from control_plane.domain.placements.planner import PushOrder
from control_plane.engine_client import EngineAt, EngineCallError
from control_plane.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)


class EngineOutcome(msgspec.Struct, kw_only=True):
    """What one engine was asked to hold (`desired`) and how the push went: `loaded` / `unloaded`, or
    `failed` with the engine's (or the connection's) `error`; the reconciler retries failed ones."""

    engine: str
    desired: str
    outcome: Literal["loaded", "unloaded", "failed"]
    error: str | None = None


_OBSERVED = {"loaded": ObservedState.LOADED, "unloaded": ObservedState.ABSENT, "failed": ObservedState.FAILED}


class Pusher:
    def __init__(self, loader: VersionLoader, session: AsyncSession, gate: WriteGate,
                 metrics: ControlPlaneMetrics) -> None:
        self.loader = loader
        self.metrics = metrics
        self.client = loader.client
        self.session = session
        self.gate = gate

    async def push(self, orders: list[PushOrder]) -> list[EngineOutcome]:
        if not orders:
            return []
        outcomes = list(await asyncio.gather(*(self._one(o) for o in orders)))
        for order, outcome in zip(orders, outcomes, strict=True):
            self.metrics.engine_call("push", order.action, outcome.outcome != "failed")
        await self._record([_answer(o, outcome) for o, outcome in zip(orders, outcomes, strict=True)])
        return outcomes

    async def _one(self, order: PushOrder) -> EngineOutcome:
        done: Literal["loaded", "unloaded"]
        at = EngineAt(order.engine, order.url)
        try:
            if order.action == "load":
                assert order.recorded is not None
                await self.loader.load(at, order.adapter, order.recorded,
                                       pinned=order.desired == DesiredState.PINNED.value)
                done = "loaded"
            else:
                await self.client.unload(at, order.adapter)
                done = "unloaded"
        except EngineCallError as exc:
            error = exc.message if order.version is None else f"version {order.version}: {exc.message}"
            logger.warning("push %s %s to engine %s failed: %s", order.action, order.adapter, order.engine, error)
            return EngineOutcome(engine=order.engine, desired=order.desired, outcome="failed", error=error)
        return EngineOutcome(engine=order.engine, desired=order.desired, outcome=done)

    async def _record(self, answers: list[EngineAnswer]) -> None:
        async def record(session: AsyncSession) -> None:
            await record_answers(session, answers)

        try:
            # idempotent (it writes what the engines answered), so retried on deadlocks and lost connections
            await transact(self.session, self.gate, record, what="recording a push", idempotent=True)
        except Exception:
            # The engines' answers are already in the reply; the reconciler re-reads them later.
            logger.exception("could not record the engines' answers to a push")


def _answer(order: PushOrder, outcome: EngineOutcome) -> EngineAnswer:
    loaded = outcome.outcome == "loaded"
    return EngineAnswer(engine_id=order.engine_id, placement_ids=order.placement_ids,
                        observed=_OBSERVED[outcome.outcome], error=outcome.error,
                        replaced_adapter_id=order.adapter_id if loaded else None)
