"""The one transaction helper: run work and commit, roll back on error, and run it again when that is safe.

- `transact(session, gate, work)`: `work(session)` runs under the write gate, then flush and commit;
  any error rolls back. A deadlock or serialization failure (PostgreSQL rolled the transaction back) and
  a database connection that broke before the commit was sent are retried on a fresh connection: the
  transaction did not commit, so running it again is the same call. A connection that broke during the
  COMMIT itself leaves the outcome unknown: work that is not `idempotent` answers 503 then (read it back,
  retry), never a guess. `races`: a unique-constraint violation means a concurrent call got there first;
  run `work` again, which now finds that call's rows (this is what makes concurrent identical loads converge).
- `read(session, query)`: the same rule for read-only queries (always safe to rerun).

What still fails after the attempts is a 503 `service_unavailable` saying to retry (`DatabaseUnavailableError`,
and `handle_database_error` for database errors raised anywhere else), never a 500. Audited admin calls
use it through control_plane.uow.Mutation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from litestar import Request, Response
from litestar.types import ExceptionHandlersMap
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.session import WriteGate, failure_kind
from shared.errors import ConflictError, OverloadedError
from shared.http_errors import error_response, handle_internal_error

T = TypeVar("T")
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


def handle_database_error(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """App exception handler: a database failure that escaped the retries above is a 503, not a 500."""
    if failure_kind(exc) is None:
        return handle_internal_error(request, exc)
    logger.warning("%s %s: database unavailable (%s)", request.method, request.url.path, type(exc).__name__)
    return error_response(DatabaseUnavailableError())


def database_error_handlers() -> ExceptionHandlersMap:
    """For the app's exception_handlers: database errors map to 503 when the connection failed."""
    return {DBAPIError: handle_database_error, ConnectionError: handle_database_error}
