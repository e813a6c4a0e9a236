"""Reconciler: make every healthy engine hold what its placements desire, on a timer and after a
(re-)registration, so that an engine that was down or restarted catches up.

Each round (every `reconcile_interval_s`, and after an engine registers) starts with the fleet pass
(domain/placements/fleet.py): demand scaling, then every adapter's replicas brought back to its rules —
re-placed off engines that went stale, drain or were deleted, placed for the first time on an engine that
just registered with its base model, at most `rebalance_max_moves` moved onto engines that hold much
less. The pass only desires; the engine rounds that follow, in the same round, carry it out. So an
adapter whose engine stops heartbeating is held elsewhere within `engine_stale_after_s` plus about one
interval (the pass after the engine went stale) plus its load. Passes do not overlap in one process, and
callers that arrive while one runs share the next (`plan_from_now`): ten engines registering at once get
one pass after their registrations, not ten.

Per engine: read its GET /v1/lora_adapters, then
- a placement desired loaded/pinned whose version (by sha256) the engine does not serve → load it
  (load_inplace, so another version of the name is replaced with in-flight requests finishing on it);
- an adapter the engine serves that the control plane placed there but desires nowhere on it → unload;
- record observed state and the engine's error on the placements (answers.record_answers, as a push does),
  and where the engine keeps each loaded version (`residency`: device | host, for the routes), skipping
  the answers that would change nothing (engine_rows.news: a steady round writes only its demand);
- record the engine's queue per adapter (running, waiting) as the demand source `engine:<name>`
  (demand.replace_demand), which demand scaling combines with the routers' reports (demand.current_demand).
Names the control plane never placed on that engine (--lora-modules, pulled on demand) are left alone.

Several replicas on one PostgreSQL never reconcile one engine at once: each engine is taken with
`SELECT … FOR NO KEY UPDATE` and held until its answers are recorded; a replica that finds the row still
locked after engine_rows.LOCK_WAIT_MS (longer than a heartbeat's commit) skips that engine this round. (NO KEY: admin calls inserting placements for the engine take a
key-share lock on its row and must not wait for a round's engine calls.) Before writing, the round locks
the engine's placement rows in ascending id, the one order every placement writer uses
(domain/placements/planner.py), so it cannot deadlock with a push being recorded on another replica; a
deadlock or a lost connection while recording is retried (recording is idempotent), and what still
fails leaves the engine to the next round. SQLite (a single replica) ends its read before calling the
engine and writes under the write gate afterwards, as every SQLite writer here does.

Loads and unloads of one round go out at most `reconcile_engine_calls` at once (a first pass at fleet scale
loads hundreds on every engine); each placement's answer is recorded in the rows' order all the same.

Engines are reconciled independently and concurrently: each engine call is bounded by the client's
deadline, and one engine's failure (slow, unreachable, a malformed reply, even a bug) is that engine's
round, skipped or failed, never the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.db.models import HOLDING, DesiredState, Engine, ObservedState
from control_plane.db.session import WriteGate, failure_kind
from control_plane.db.transaction import DatabaseUnavailableError, read, transact
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.placements.answers import EngineAnswer, record_answers
from control_plane.domain.placements.demand import AdapterDemand, engine_source, replace_demand
from control_plane.domain.placements.engine_rows import EngineRow, engine_rows, news, take_engine
from control_plane.domain.placements.fleet import FleetPass, FleetReport
from control_plane.domain.placements.loads import VersionLoader
from control_plane.engine_client import EngineAt, EngineCallError, EngineClient
from control_plane.metrics import ControlPlaneMetrics
from control_plane.settings import ControlPlaneSettings
from shared.engine_admin import AdapterListing

logger = logging.getLogger(__name__)
ROUND_CALLS = 4  # one engine's round may take as long as this many engine calls at their deadline,
# plus, for each load that fetches from the artifact store, the time its bytes need


@dataclass
class EngineRound:
    """What one reconcile of one engine did (for tests and logs)."""

    engine: str
    loaded: list[str]
    unloaded: list[str]
    failed: list[str]
    skipped: bool = False  # locked by another replica, or unreachable

    @property
    def result(self) -> str:
        """Its loraplane_control_reconcile_rounds_total result (control_plane/metrics.py)."""
        if self.skipped:
            return "skipped"
        return "failed" if self.failed else "changed" if self.loaded or self.unloaded else "converged"


class Reconciler:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], gate: WriteGate, client: EngineClient,
                 settings: ControlPlaneSettings, metrics: ControlPlaneMetrics) -> None:
        self.sessions = sessions
        self.metrics = metrics
        self._drift_engines: set[str] = set()  # engines with a drift series, dropped once they leave the fleet
        self.gate = gate
        self.client = client
        self.loader = VersionLoader(client, settings)
        self.settings = settings
        self.fleet = FleetPass(settings)
        self._task: asyncio.Task[None] | None = None
        self._kicks: set[asyncio.Task[EngineRound]] = set()
        self._in_turn = asyncio.Semaphore(settings.reconcile_concurrency)
        self._planning = asyncio.Lock()
        self._passes_begun = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="reconciler")

    async def stop(self) -> None:
        for task in [self._task, *self._kicks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def kick(self, engine_name: str) -> None:
        """Reconcile one engine soon (it just registered: maybe a restart that lost its adapters), after a
        fleet pass (adapters waiting for an engine of its base model are placed on it now)."""
        async def kicked() -> EngineRound:
            await self.plan_from_now()
            return await self.reconcile_engine(engine_name)

        task = asyncio.create_task(kicked())
        self._kicks.add(task)
        task.add_done_callback(self._kicks.discard)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_s)
            try:
                await self.reconcile_all()
            except Exception:
                logger.exception("reconcile round failed")

    async def plan_from_now(self) -> None:
        """A fleet pass that begins after this call, shared with every caller waiting meanwhile: engines
        registering at once would each run a full pass (docs/performance.md#control-plane) where one serves
        them all."""
        wanted = self._passes_begun + 1
        async with self._planning:
            if self._passes_begun >= wanted:
                return  # one began after the call, while it waited, and has ended
            self._passes_begun += 1
            await self.plan()

    async def plan(self) -> FleetReport | None:
        """The fleet pass in a transaction of its own; its failure is logged and leaves the rounds to run."""
        async with self.sessions() as session:
            try:
                # not idempotent (a scaling decision once), but a pass whose commit was lost is only redone
                report = await transact(session, self.gate, self.fleet.run, what="fleet pass", idempotent=False)
            except Exception as exc:
                if failure_kind(exc) is None and not isinstance(exc, DatabaseUnavailableError):
                    logger.exception("fleet pass failed")
                else:
                    logger.warning("fleet pass: database unavailable; left for the next round")
                return None
        if report.added or report.released or report.moves:
            logger.info("fleet pass: %d placed, %d released, %d moving", len(report.added), len(report.released),
                        len(report.moves))
        return report

    async def reconcile_all(self) -> list[EngineRound]:
        await self.plan_from_now()
        async with self.sessions() as session:
            async def healthy() -> list[str]:
                return list((await session.scalars(
                    select(Engine.name).where(healthy_clause(self.settings.engine_stale_after_s)))).all())

            names = await read(session, healthy, "reconcile: list engines")  # again on a fresh connection
        rounds = list(await asyncio.gather(*(self._reconcile_in_turn(n) for n in names)))
        for gone in self._drift_engines - set(names):  # stale, drained away or deleted: no figure to keep
            self.metrics.drift.remove(gone)
        self._drift_engines &= set(names)
        return rounds

    async def _reconcile_in_turn(self, name: str) -> EngineRound:
        """A round of the interval's, at most reconcile_concurrency at once, so that heartbeats and the API
        always find a database connection (each round holds one while it calls its engine)."""
        async with self._in_turn:
            return await self.reconcile_engine(name)

    async def reconcile_engine(self, name: str) -> EngineRound:
        done = await self._bounded_round(name)
        self.metrics.reconcile_rounds.labels(done.result).inc()
        if not done.skipped:  # a skipped round saw nothing: the last figure stands
            self.metrics.drift.labels(name).set(len(done.loaded) + len(done.unloaded) + len(done.failed))
            self._drift_engines.add(name)
        return done

    async def _bounded_round(self, name: str) -> EngineRound:
        try:
            # Every call is bounded already; this bounds an engine that answers each just in time.
            async with asyncio.timeout(ROUND_CALLS * self.settings.engine_timeout_s) as bound:
                return await self._reconcile_engine(name, bound)
        except TimeoutError:
            logger.warning("reconcile of engine %s took longer than %d engine calls; left for the next round",
                           name, ROUND_CALLS)
            return EngineRound(name, [], [], [], skipped=True)
        except Exception as exc:
            kind = failure_kind(exc) or ("unavailable" if isinstance(exc, DatabaseUnavailableError) else None)
            if kind is None:
                logger.exception("reconcile of engine %s failed", name)
            else:  # rolled back (a deadlock, a lost connection): the next round starts over, nothing is lost
                logger.warning("reconcile of engine %s: database %s; left for the next round", name,
                               {"lost": "connection lost", "conflict": "deadlock"}.get(kind, "unavailable"))
            return EngineRound(name, [], [], [], skipped=True)

    async def _reconcile_engine(self, name: str, bound: asyncio.Timeout) -> EngineRound:
        async with self.sessions() as session:
            engine = await take_engine(session, name, self.settings.is_sqlite)
            if engine is None:  # deleted, or another replica holds it right now
                return EngineRound(name, [], [], [], skipped=True)
            rows = await engine_rows(session, engine.id)
            at = EngineAt(name, engine.url)
            if self.settings.is_sqlite:
                await session.commit()  # end the read: SQLite's writer lock is taken only under the gate
            try:
                listing = await self.client.list_adapters(at)
            except EngineCallError as exc:
                logger.info("reconcile: engine %s unreachable: %s", name, exc.message)
                return EngineRound(name, [], [], [], skipped=True)
            held = {a.name: a for a in listing.adapters if a.state != "draining"}
            done, answers = await self._converge(at, engine.id, rows, held, bound)
            answers = news(answers, rows)  # a steady round writes nothing but its demand
            ids = {r.adapter: r.adapter_id for r in rows}
            demand = [AdapterDemand(ids[a.name], a.waiting, a.running) for a in listing.adapters if a.name in ids]

            async def record(session: AsyncSession) -> None:
                await record_answers(session, answers)
                await replace_demand(session, engine_source(name), demand)

            await transact(session, self.gate, record, what=f"recording the reconcile of engine {name!r}",
                           idempotent=True)
            done.engine = name
            return done

    async def _converge(self, at: EngineAt, engine_id: int, rows: list[EngineRow], held: dict[str, AdapterListing],
                        bound: asyncio.Timeout) -> tuple[EngineRound, list[EngineAnswer]]:
        """Call the engine for what differs, up to reconcile_engine_calls calls at once; returns the round
        and every placement's answer to record (in the rows' order)."""
        result = EngineRound("", [], [], [])
        in_turn = asyncio.Semaphore(self.settings.reconcile_engine_calls)

        def answer(row: EngineRow, observed: ObservedState, error: str | None = None, replaced: int | None = None,
                   residency: str | None = None) -> EngineAnswer:
            return EngineAnswer(engine_id, (row.placement_id,), observed, error, replaced,
                                residency if residency in ("device", "host") else None)

        async def hold(row: EngineRow) -> EngineAnswer:
            pinned = row.desired == DesiredState.PINNED.value
            have = held.get(row.adapter)
            if have is None or have.sha256 != row.version.sha256 or have.pinned != pinned:
                async with in_turn:
                    try:
                        # the recorded bytes only: the engine refuses other files (see loads.VersionLoader)
                        when = bound.when()  # the round may take what this load's bytes need, on top
                        if when is not None:
                            bound.reschedule(when + self.loader.deadline_s(row.version) - self.settings.engine_timeout_s)
                        await self.loader.load(at, row.adapter, row.version, pinned=pinned)
                    except EngineCallError as exc:
                        self.metrics.engine_call("reconcile", "load", ok=False)
                        result.failed.append(row.adapter)
                        return answer(row, ObservedState.FAILED, exc.message)
                self.metrics.engine_call("reconcile", "load", ok=True)
                result.loaded.append(row.adapter)
            kept = held.get(row.adapter)
            residency = kept.residency if kept is not None and kept.sha256 == row.version.sha256 else None
            return answer(row, ObservedState.LOADED, replaced=row.adapter_id, residency=residency)

        async def unload(adapter: str) -> str | None:
            """One call per adapter, however many of its versions are placed here: its error, or None."""
            async with in_turn:
                try:
                    await self.client.unload(at, adapter)
                except EngineCallError as exc:
                    self.metrics.engine_call("reconcile", "unload", ok=False)
                    result.failed.append(adapter)
                    return exc.message
            self.metrics.engine_call("reconcile", "unload", ok=True)
            result.unloaded.append(adapter)
            return None

        async def gone(row: EngineRow, call: asyncio.Future[str | None] | None) -> EngineAnswer:
            error = await call if call is not None else None
            return answer(row, ObservedState.ABSENT) if error is None else answer(row, ObservedState.FAILED, error)

        wanted = {r.adapter for r in rows if r.desired in HOLDING}
        unloads: dict[str, asyncio.Future[str | None]] = {}
        calls = []
        for row in rows:
            if row.desired in HOLDING:
                calls.append(hold(row))
            elif row.adapter not in wanted:
                if row.adapter in held and row.adapter not in unloads:
                    unloads[row.adapter] = asyncio.ensure_future(unload(row.adapter))
                calls.append(gone(row, unloads.get(row.adapter)))
            # else: an older version of an adapter the engine should hold, replaced in place by its load
        try:
            return result, list(await asyncio.gather(*calls))
        finally:
            for call in unloads.values():  # the round ran out of time: no call outlives it
                call.cancel()
