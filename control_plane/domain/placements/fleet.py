"""FleetPass: once per reconcile interval (and after an engine registers), every adapter brought back to
its replica rules, in one transaction that only desires; the reconciler's engine rounds that follow
carry it out (load, unload) and record what the engines answer.

In order, per adapter (ascending id), from the rows as they are:

1. demand scaling (scaling.decide) may move its target by one; the decision is audited (actor
   `control-plane`, action `scale_lora_adapter`, the reason and figures in the event's detail) and kept
   in scale_state.last_decision;
2. fill: engines added until `desired` healthy engines hold it (an engine that went stale, drains or was
   deleted no longer counts, so its adapters are re-placed within one pass of it going);
3. release: its placements on unhealthy engines and those leaving (a move's source), once `desired`
   replicas are observed loaded; after a scale-down one replica more; anything above `max`;
4. then, over all adapters, at most `--rebalance-max-moves` moves onto engines that hold much less
   (rebalance.plan_moves), counting moves still under way.

One replica decides at a time: on PostgreSQL the pass starts with `pg_try_advisory_xact_lock` and a
replica that does not get it skips the pass (the lock ends with the transaction); SQLite runs one
replica, under the write gate. Lock order (see planner.py): the pass first reads without locks to find
the adapters it changes, then locks those adapter rows (ascending id), the healthy engine rows it may
add placements on (FOR KEY SHARE, ascending id) and those adapters' placements (ascending id), reads
their placements again and decides for them on what it read under the locks. Its placement writes (adds,
releases, moves' targets) are gathered and made at the end, set-based (desired.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import audit
from control_plane.db.models import Adapter, AdapterVersion, DesiredState
from control_plane.domain.placements import view
from control_plane.domain.placements.demand import AdapterDemand, current_demand
from control_plane.domain.placements.desired import Held, desire_absent, desire_held
from control_plane.domain.placements.planner import PlacementPlanner, lock_placements
from control_plane.domain.placements.rebalance import Move, plan_moves
from control_plane.domain.placements.replicas import AdapterPlacement, EngineLoad, fill, releasable
from control_plane.domain.placements.scaling import Decision, ScaleFigures, ScalePolicy, ScaleState, decide
from control_plane.settings import ControlPlaneSettings

logger = logging.getLogger(__name__)
ACTOR = "control-plane"  # the audit actor of the control plane's own decisions
SCALE_ACTION = "scale_lora_adapter"
LEADER_LOCK = 0x6C6F7261_706C616E & 0x7FFFFFFFFFFFFFFF  # "loraplan": the advisory lock key of the pass


@dataclass
class FleetReport:
    """What one pass did (for tests and logs)."""

    skipped: bool = False  # another replica holds the pass
    added: list[tuple[str, str]] = field(default_factory=list)  # (adapter, engine)
    released: list[tuple[str, str]] = field(default_factory=list)
    moves: list[tuple[str, str, str]] = field(default_factory=list)  # (adapter, from engine, to engine)
    decisions: list[tuple[str, Decision]] = field(default_factory=list)


@dataclass
class _Outcome:
    """What the pass decides for one adapter."""

    add: list[int] = field(default_factory=list)  # engine ids
    release: list[int] = field(default_factory=list)  # placement ids
    decision: Decision | None = None
    state: ScaleState | None = None  # the new bookkeeping, when it changed

    @property
    def changes(self) -> bool:
        return bool(self.add or self.release or self.decision or self.state)


@dataclass
class _Writes:
    """The placement rows the pass changes, written set-based at its end (desired.py): a pass re-placing
    thousands of adapters makes a few statements, not several per placement."""

    held: list[Held] = field(default_factory=list)
    absent: list[int] = field(default_factory=list)  # placement ids

    def hold(self, adapter: Adapter, version: AdapterVersion, plan: AdapterPlacement, engine_ids: list[int]) -> None:
        """The active version desired on these engines, pinned where the adapter's replicas are."""
        mode = DesiredState.PINNED if plan.pinned else DesiredState.LOADED
        self.held.extend(Held(adapter.id, version.id, engine_id, mode) for engine_id in engine_ids)


class _Room:
    """Per base model and rank: how many engines can take such an adapter, their ids and those with room,
    kept while no load changes. A steady pass then scans the engines once per base model instead of once
    per adapter (adapters × engines, most of a pass at fleet scale: docs/performance.md#control-plane)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, int], tuple[int, frozenset[int], frozenset[int]]] = {}

    def forget(self) -> None:
        """A load changed (a fill, a release): every figure is read again."""
        self._memo.clear()

    def of(self, adapter: Adapter | view.ActiveRow, plan: AdapterPlacement, loads: dict[int, EngineLoad]
           ) -> tuple[int, frozenset[int], frozenset[int]]:
        key = (adapter.base_model, plan.rank)  # plan.matching is the engines of adapter.base_model
        found = self._memo.get(key)
        if found is None:
            able = plan.able(loads)
            found = self._memo[key] = (len(able), frozenset(e.id for e in able),
                                       frozenset(e.id for e in able if e.free > 0))
        return found


class FleetPass:
    def __init__(self, settings: ControlPlaneSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.planner = PlacementPlanner.of(settings)
        self.policy = ScalePolicy.of(settings)
        self.clock = clock
        # demand older than this is no demand: a router or engine that stopped reporting has no queue
        self.demand_age_s = 2 * settings.reconcile_interval_s + 1.0

    async def run(self, session: AsyncSession) -> FleetReport:
        """The pass, inside the caller's transaction."""
        if not await self._lead(session):
            return FleetReport(skipped=True)
        now = self.clock()
        rows = [r for r in await view.active_rows(session) if not view.unloaded(r)]
        leaving = set().union(*(view.leaving_ids(r.scale_state) for r in rows))
        loads = await view.engine_loads(session, self.settings.engine_stale_after_s, leaving)
        matching = await view.matching_engines(session, {r.base_model for r in rows})
        held = await view.holders(session)
        demand = await current_demand(session, self.demand_age_s)
        defaults = self.planner.defaults

        # 1. unlocked: which adapters change (and the moves), on a copy of the loads
        probe_loads = copy.deepcopy(loads)
        probe = {r.id: view.placement_of(r, r, matching[r.base_model], held.get(r.id, []), defaults) for r in rows}
        room = _Room()
        outcomes = {r.id: self._decide(r, probe[r.id], probe_loads, demand.get(r.id), now, room) for r in rows}
        busy = {i for i, o in outcomes.items() if o.add or o.release} | {
            r.id for r in rows if view.leaving_ids(r.scale_state)}
        budget = self.settings.rebalance_max_moves - len(leaving)
        moves = plan_moves(probe.values(), probe_loads, budget, busy)
        touched = sorted({i for i, o in outcomes.items() if o.changes} | {m.adapter_id for m in moves})
        if not touched:
            return FleetReport()

        # 2. locked: the same decisions again on what the rows say now (read again, as ORM objects to change)
        await self._lock(session, touched)
        fresh = await view.holders(session, touched)
        by_id = {i: row for i, row in (await view.active_adapters(session, touched)).items()
                 if not view.unloaded(row[0])}
        current = {i: view.placement_of(a, v, matching.get(a.base_model, []), fresh.get(i, []), defaults)
                   for i, (a, v) in by_id.items()}
        report, writes = FleetReport(), _Writes()
        room = _Room()  # of `loads` now, not of the probe's copy
        for adapter, version in by_id.values():
            outcome = self._decide(adapter, current[adapter.id], loads, demand.get(adapter.id), now, room)
            self._apply(session, adapter, version, current[adapter.id], outcome, loads, report, writes)
            outcomes[adapter.id] = outcome
        for move in moves:
            if move.adapter_id in by_id:
                self._move(by_id[move.adapter_id], current[move.adapter_id], move, outcomes, loads, report, writes)
        await desire_absent(session, writes.absent)
        await desire_held(session, writes.held)
        return report

    def _decide(self, adapter: Adapter | view.ActiveRow, plan: AdapterPlacement, loads: dict[int, EngineLoad],
                demand: AdapterDemand | None, now: float, engines_room: _Room) -> _Outcome:
        """Scaling, fill and release for one adapter (loads updated as if done)."""
        out = _Outcome()
        able, able_ids, with_room = engines_room.of(adapter, plan, loads)
        serving = plan.serving(loads)
        # engines with capacity for one more: those with room, and those that serve it already anyway
        room = len(with_room) + sum(1 for i in serving if i in able_ids and i not in with_room)
        rule = plan.rule
        state = ScaleState.load(adapter.scale_state)
        figures = ScaleFigures(waiting=demand.waiting if demand else 0, running=demand.running if demand else 0,
                               replicas=len(serving), target=rule.wanted(), min=rule.min,
                               ceiling=rule.ceiling(room))
        new_state, out.decision = decide(self.policy, state, figures, now)
        if out.decision is not None:
            plan.rule = rule = dataclasses.replace(rule, target=out.decision.target)
        desired = rule.desired(able)
        out.add = fill(plan, loads, desired)
        scaled_down = out.decision is not None and out.decision.target < out.decision.source
        out.release = releasable(plan, loads, desired, keep=desired if scaled_down else rule.ceiling(able))
        if out.add or out.release:
            engines_room.forget()
        kept_leaving = sorted(h.placement_id for h in plan.holders if h.leaving and h.placement_id not in out.release)
        new_state.extra = {k: v for k, v in new_state.extra.items() if k != view.LEAVING}
        if kept_leaving:
            new_state.extra[view.LEAVING] = kept_leaving
        if new_state.dump() != (adapter.scale_state or {}):
            out.state = new_state
        return out

    def _apply(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, plan: AdapterPlacement,
               outcome: _Outcome, loads: dict[int, EngineLoad], report: FleetReport, writes: _Writes) -> None:
        if outcome.decision is not None:
            d = outcome.decision
            adapter.target_replicas = d.target
            session.add(audit.event(ACTOR, SCALE_ACTION, adapter.name, f"ok {d.source}->{d.target}", d.dump()))
            report.decisions.append((adapter.name, d))
            logger.info("adapter %s: replicas %d -> %d: %s", adapter.name, d.source, d.target, d.reason)
        if outcome.state is not None:
            adapter.scale_state = outcome.state.dump() or None
        writes.hold(adapter, version, plan, outcome.add)
        report.added.extend((adapter.name, loads[engine_id].name) for engine_id in outcome.add)
        if outcome.release:
            names = {h.placement_id: h.engine_id for h in plan.holders}
            writes.absent.extend(outcome.release)
            report.released.extend((adapter.name, _name(loads, names[i])) for i in outcome.release)

    def _move(self, row: tuple[Adapter, AdapterVersion], plan: AdapterPlacement, move: Move,
              outcomes: dict[int, _Outcome], loads: dict[int, EngineLoad], report: FleetReport, writes: _Writes) -> None:
        """A planned move, if it still holds under the locks: the target desired, the source leaving."""
        adapter, version = row
        outcome = outcomes[adapter.id]
        sources = [h for h in plan.holders if h.engine_id == move.source and not h.leaving]
        target = loads.get(move.target)
        if (outcome.add or outcome.release or not sources or target is None or not target.healthy
                or any(h.engine_id == move.target for h in plan.holders)):
            return
        writes.hold(adapter, version, plan, [move.target])
        state = ScaleState.load(adapter.scale_state)
        state.extra[view.LEAVING] = sorted(view.leaving_ids(adapter.scale_state) | {h.placement_id for h in sources})
        adapter.scale_state = state.dump()
        report.moves.append((adapter.name, _name(loads, move.source), target.name))

    async def _lead(self, session: AsyncSession) -> bool:
        if self.settings.is_sqlite:
            return True
        return bool(await session.scalar(select(func.pg_try_advisory_xact_lock(LEADER_LOCK))))

    async def _lock(self, session: AsyncSession, adapter_ids: list[int]) -> None:
        await session.execute(select(Adapter.id).where(view.among(Adapter.id, adapter_ids)).order_by(Adapter.id)
                              .with_for_update())
        if not self.settings.is_sqlite:  # the rows new placements reference (key share: as an insert takes)
            await session.execute(text("SELECT id FROM engines ORDER BY id FOR KEY SHARE"))
        await lock_placements(session, view.of_adapters(adapter_ids))


def _name(loads: dict[int, EngineLoad], engine_id: int) -> str:
    engine = loads.get(engine_id)
    return engine.name if engine is not None else f"engine #{engine_id}"
