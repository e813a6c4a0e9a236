"""One mutating admin call = one transaction with its audit row, retried when that is safe.

`Mutation.run` is how every service changes state:
- `prepare` (optional) runs first, outside any transaction: slow checks such as reading adapter files;
- `work(session)` then runs under the write gate; the audit row is added and everything commits together;
- a unique-constraint violation means a concurrent call got there first: roll back and run `work` again,
  which now finds that call's rows (this is what makes concurrent identical loads converge);
- a deadlock or serialization failure (PostgreSQL rolled the transaction back) and a database connection
  that broke before the commit was sent are retried the same way, on a fresh connection: the transaction
  did not commit, so running it again is the same call. A connection that broke during the COMMIT itself
  leaves the outcome unknown: a mutation answers 503 then (read it back, retry), never a guess;
- a refusal (LoraplaneError) rolls everything back, then records only the audit row with the outcome.

`read` and `transact` give the same rule to read-only queries (always safe to rerun) and to the small
unaudited writes (heartbeats, an engine adopting an adapter, recording push answers), which are idempotent.
What still fails after the attempts is a 503 `service_unavailable` saying to retry (`DatabaseUnavailableError`,
and `handle_database_error` for database errors raised anywhere else), never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from litestar import Request, Response
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import audit
from control_plane.auth import Principal
from control_plane.db.session import WriteGate, failure_kind
from control_plane.metrics import ControlPlaneMetrics
from shared.errors import ConflictError, LoraplaneError, OverloadedError
from shared.http_errors import error_response, handle_internal_error

T = TypeVar("T")
P = TypeVar("P")
logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 8  # lost unique-constraint races (each one means another call made progress)
DB_ATTEMPTS = 4  # broken connections, deadlocks: a fresh connection each time, with a growing pause
DB_PAUSE_S = 0.08


class DatabaseUnavailableError(OverloadedError):
    """503 service_unavailable: the database could not complete the call (connection lost, deadlocks)."""

    def __init__(self, outcome_unknown: bool = False) -> None:
        super().__init__(
            "The control plane lost its database connection while committing this change, so it may or may "
            "not have been applied; read it back, then retry." if outcome_unknown else
            "The control plane's database connection failed during this call; nothing was changed. Retry.")


async def reset(session: AsyncSession) -> None:
    """Roll back after a failure; a session whose connection is too broken even for that is invalidated
    (its connection leaves the pool) so that the next statement starts on a fresh one."""
    try:
        await session.rollback()
    except Exception as exc:  # asyncpg: InternalClientError on a connection that died mid-operation
        logger.debug("rollback failed (%s); invalidating the session's connection", type(exc).__name__)
        with contextlib.suppress(Exception):
            await session.invalidate()


async def _pause(attempt: int) -> None:
    await asyncio.sleep(random.uniform(0, 0.005 * attempt))  # jitter: let the winner commit


async def _pause_for_database(attempt: int) -> None:
    # longer: a restarting server or a failover takes a moment; 4 attempts span about half a second
    await asyncio.sleep(random.uniform(0.5, 1.0) * DB_PAUSE_S * attempt)


def _retryable(exc: BaseException, what: str, attempt: int) -> bool:
    """Whether `exc` from a transaction that did not commit is worth another attempt (it is logged)."""
    kind = failure_kind(exc)
    if kind is None:
        return False
    logger.warning("%s: database %s (%s, attempt %d of %d)", what,
                   "connection lost" if kind == "lost" else "deadlock or serialization failure",
                   type(exc).__name__, attempt, DB_ATTEMPTS)
    return True


async def read(session: AsyncSession, query: Callable[[], Awaitable[T]], what: str = "read") -> T:
    """A read-only query: run it again on a fresh connection when the connection broke under it."""
    for attempt in range(1, DB_ATTEMPTS + 1):
        try:
            return await query()
        except Exception as exc:
            if not _retryable(exc, what, attempt):
                raise
            await reset(session)
            if attempt == DB_ATTEMPTS:
                raise DatabaseUnavailableError() from None
        await _pause_for_database(attempt)
    raise AssertionError("unreachable")


async def transact(session: AsyncSession, gate: WriteGate, work: Callable[[AsyncSession], Awaitable[T]], *,
                   what: str, idempotent: bool, races: bool = False) -> T:
    """`work` and a commit, attempted again while that is safe (see the module doc). `idempotent` work may
    also be rerun when the connection broke during the COMMIT; `races`: a unique-constraint violation is a
    lost race, rerun too (ConflictError after MAX_ATTEMPTS)."""
    db_failures = 0
    for attempt in range(1, MAX_ATTEMPTS + 1):
        failures_before = db_failures
        async with gate.hold():
            committing = False
            try:
                result = await work(session)
                await session.flush()  # errors up to here: nothing was sent to COMMIT
                committing = True
                await session.commit()
                return result
            except IntegrityError:
                await reset(session)
                if not races:
                    raise
                logger.debug("%s lost a race (attempt %d), retrying", what, attempt)
                if attempt == MAX_ATTEMPTS:
                    raise ConflictError(f"{what} kept colliding with concurrent changes; retry the call") from None
            except Exception as exc:
                await reset(session)
                db_failures += 1
                if not _retryable(exc, what, db_failures):
                    raise
                if committing and failure_kind(exc) == "lost" and not idempotent:
                    raise DatabaseUnavailableError(outcome_unknown=True) from None
                if db_failures == DB_ATTEMPTS:
                    raise DatabaseUnavailableError() from None
            except BaseException:
                await reset(session)
                raise
        await (_pause_for_database(db_failures) if db_failures > failures_before else _pause(attempt))
    raise AssertionError("unreachable")


def handle_database_error(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """App exception handler: a database failure that escaped the retries above is a 503, not a 500."""
    if failure_kind(exc) is None:
        return handle_internal_error(request, exc)
    logger.warning("%s %s: database unavailable (%s)", request.method, request.url.path, type(exc).__name__)
    return error_response(DatabaseUnavailableError())


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
        async def audited(session: AsyncSession) -> T:
            result = await work(session, prepared)
            session.add(audit.event(actor.token_id, action, target, "ok"))
            return result

        return await transact(self.session, self.gate, audited, what=f"{action} on {target!r}",
                              idempotent=False, races=True)

    async def _record_refusal(self, actor: Principal, action: str, target: str, outcome: str) -> None:
        self.metrics.mutations.labels(action, outcome).inc()
        await audit.record_alone(self.session, self.gate, audit.event(actor.token_id, action, target, outcome))


def database_error_handlers() -> dict[type[Exception], Callable[[Request, Exception], Response[dict[str, Any]]]]:
    """For the app's exception_handlers: database errors map to 503 when the connection failed."""
    return {DBAPIError: handle_database_error, ConnectionError: handle_database_error}
