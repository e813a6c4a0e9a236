"""The database engine and advanced-alchemy's Litestar plugin config, built from the settings.

SQLite is opened in WAL mode with foreign keys on and a busy timeout. Its write transactions are also
funnelled through one in-process lock (`WriteGate`): two deferred SQLite transactions that both read and
then write deadlock, and SQLite answers that with an immediate "database is locked" rather than waiting.
PostgreSQL needs no such gate: unique constraints and row locks order concurrent writers there.

PostgreSQL connections can die under a call (a restart, a failover, `pg_terminate_backend`): the pool
pings each connection as it is checked out (`pool_pre_ping`), a connection that failed mid-query is
invalidated, and `failure_kind` tells callers (control_plane.db.transaction) which errors are worth another attempt.
`has_sqlstate` looks down the same chain of wrapped errors for one PostgreSQL error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Literal

from advanced_alchemy.extensions.litestar import AsyncSessionConfig, SQLAlchemyAsyncConfig
from advanced_alchemy.extensions.litestar._utils import delete_aa_scope_state, get_aa_scope_state
from advanced_alchemy.extensions.litestar.plugins.init.config.common import SESSION_TERMINUS_ASGI_EVENTS
from litestar.types import Message, Scope
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from control_plane.settings import ControlPlaneSettings

logger = logging.getLogger(__name__)
SQLITE_BUSY_TIMEOUT_S = 30
# SQLSTATEs: class 08 is "connection exception"; 57P01-57P03 are the server shutting the session down.
_LOST_SQLSTATES = ("57P01", "57P02", "57P03")
# deadlock_detected, serialization_failure: PostgreSQL rolled the transaction back; running it again is safe.
_CONFLICT_SQLSTATES = ("40P01", "40001")
FailureKind = Literal["lost", "conflict"]


def error_chain(exc: BaseException) -> Iterator[tuple[BaseException, str]]:
    """`exc` and the errors under it, each with its SQLSTATE ("" for none), outermost first: SQLAlchemy
    wraps the driver's error (`.orig`), whose `__cause__` is asyncpg's own. At most 8, each once."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 8 and current not in seen:
        seen.append(current)
        yield current, str(getattr(current, "sqlstate", None) or "")
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__


def has_sqlstate(exc: BaseException, sqlstate: str) -> bool:
    """Some error in `exc`'s chain carries this SQLSTATE."""
    return any(state == sqlstate for _, state in error_chain(exc))


def failure_kind(exc: BaseException) -> FailureKind | None:
    """`lost`: the database connection broke (the call may be retried on a new one); `conflict`: a deadlock
    or serialization failure that rolled the transaction back; None: any other error (a bug, a constraint)."""
    if not isinstance(exc, DBAPIError | ConnectionError) and not type(exc).__module__.startswith("asyncpg"):
        return None  # not the database's (a timeout of our own, a bug)
    for current, state in error_chain(exc):
        if getattr(current, "connection_invalidated", False) or isinstance(current, ConnectionError):
            return "lost"
        if state.startswith("08") or state in _LOST_SQLSTATES:
            return "lost"
        if state in _CONFLICT_SQLSTATES:
            return "conflict"
        if type(current).__name__ in ("InternalClientError", "ConnectionDoesNotExistError") or \
                "connection is closed" in str(current):
            return "lost"  # asyncpg's own words for a connection that is gone (or left in a broken state)
    return None


def create_engine(settings: ControlPlaneSettings) -> AsyncEngine:
    url = make_url(settings.database_url)
    if not settings.is_sqlite:
        return create_async_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine.sync_engine, "connect")
    def _sqlite_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
        cursor.execute("PRAGMA foreign_keys=ON")  # SQLite leaves them off unless asked, per connection
        cursor.execute("PRAGMA case_sensitive_like=ON")  # name-prefix filters behave as on PostgreSQL
        cursor.close()

    return engine


def plugin_config(engine: AsyncEngine) -> SQLAlchemyAsyncConfig:
    """One session per request (dependency `db_session`), closed as the response starts.

    Services commit themselves (see control_plane.db.transaction), so closing is all that is left to do: nothing is
    committed implicitly. The plugin's own handler closes too, but a close that fails (the server ended the
    connection after the handler's last statement, so the implicit rollback cannot be sent) would turn an
    answered call into a 500; `close_request_session` invalidates that connection instead.
    """
    config = SQLAlchemyAsyncConfig(
        engine_instance=engine,
        session_config=AsyncSessionConfig(expire_on_commit=False),
        create_all=False,  # Alembic owns the schema
    )
    # the plugin makes each config's scope key unique (a process may build several apps), so read it back
    config.before_send_handler = _session_closer(config.session_scope_key)
    return config


def _session_closer(scope_key: str) -> Callable[[Message, Scope], Awaitable[None]]:
    async def close_request_session(message: Message, scope: Scope) -> None:
        session = get_aa_scope_state(scope, scope_key)
        if session is None or message["type"] not in SESSION_TERMINUS_ASGI_EVENTS:
            return
        delete_aa_scope_state(scope, scope_key)
        try:
            await session.close()
        except Exception as exc:
            if failure_kind(exc) is None:
                raise
            logger.warning("closing a request's session: database connection lost (%s); discarding it",
                           type(exc).__name__)
            with contextlib.suppress(Exception):
                await session.invalidate()  # the broken connection leaves the pool instead of returning

    return close_request_session


class WriteGate:
    """Serialises write transactions where the database needs it (SQLite); a no-op on PostgreSQL."""

    def __init__(self, serialize: bool) -> None:
        self._lock = asyncio.Lock() if serialize else None

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        if self._lock is None:
            yield
            return
        async with self._lock:
            yield
