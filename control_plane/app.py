"""The control plane's Litestar app: `create_app(settings)`.

Database access goes through advanced-alchemy's SQLAlchemyPlugin (a session per request); Alembic
migrations are applied at start; errors are OpenAI-style bodies; metrics live on the app's own registry.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import msgspec
from advanced_alchemy.extensions.litestar import SQLAlchemyPlugin
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.openapi import OpenAPIConfig
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.artifacts.controller import ArtifactController
from control_plane.artifacts.spool import clean_spools
from control_plane.artifacts.store import ArtifactStore
from control_plane.artifacts.sweeper import StoreSweeper
from control_plane.db import migrate
from control_plane.db.session import WriteGate, create_engine, plugin_config
from control_plane.db.transaction import database_error_handlers
from control_plane.domain.adapters.controller import AdapterController
from control_plane.domain.audit.controller import AuditController
from control_plane.domain.engines.collector import EngineCollector
from control_plane.domain.engines.controller import EngineController
from control_plane.domain.engines.service import ReconcilerHooks
from control_plane.domain.placements.reconcile import Reconciler
from control_plane.domain.routers.controller import RouterController
from control_plane.domain.routes.cache import RoutesCache
from control_plane.domain.routes.controller import RoutesController
from control_plane.domain.stats.controller import StatsController
from control_plane.domain.stats.history import HistorySampler
from control_plane.domain.stats.service import StatsCache
from control_plane.domain.tenants.controller import TenancyController, TenantController
from control_plane.domain.tenants.enforcement import enforcing_routers
from control_plane.domain.tenants.keys import TenantAuth
from control_plane.domain.tenants.revocations import RevocationPublisher
from control_plane.engine_client import EngineClient
from control_plane.metrics import CONTENT_TYPE, ControlPlaneMetrics
from control_plane.settings import ControlPlaneSettings
from control_plane.ui.controller import Console
from shared.errors import OverloadedError
from shared.http_errors import exception_handlers
from shared.key_checks import KeyChecks
from shared.key_secrets import KeyHasher
from shared.openapi import document_app, route_doc

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


class TenancyHealth(msgspec.Struct, kw_only=True):
    enforced: bool  # some router that reported lately requires API keys (tenants' privacy and quotas hold)
    routers: list[str]  # those routers, by name


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok"]
    tenancy: TenancyHealth


@get("/health", operation_id="health", tags=["system"], opt=route_doc(response=Health, errors=(503,)))
async def health(db_session: AsyncSession) -> Health:
    """200 while the database answers, saying whether tenancy is enforced (by which routers: those that
    reported lately with --require-api-key); 503 (OpenAI-style body) when the database does not answer."""
    try:
        await db_session.execute(text("SELECT 1"))
        routers = await enforcing_routers(db_session)
    except Exception as exc:
        logger.warning("health check: database unavailable: %s", type(exc).__name__)
        raise OverloadedError("The control plane's database is unavailable.") from None
    return Health(status="ok", tenancy=TenancyHealth(enforced=bool(routers), routers=routers))


@get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics(state: State) -> Response[bytes]:
    """Prometheus exposition of the control plane's metrics."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _contract_errors(handler: Any) -> list[int]:
    """Statuses every guarded route may answer besides its own: 401/403 (the guards), 429 (a tenant key's
    failed attempts: shared/key_checks.py) and 503 (the database is unavailable; /health lists its own)."""
    return [401, 403, 429, 503] if handler.resolve_guards() else []


def create_app(settings: ControlPlaneSettings) -> Litestar:
    engine = create_engine(settings)
    app_metrics = ControlPlaneMetrics()
    engine_client = EngineClient(settings.engine_token_secret, settings.engine_timeout_s,
                                 allowed_networks=settings.engine_allowed_networks)
    gate = WriteGate(serialize=settings.is_sqlite)
    # Sessions outside a handler's own (the plugin's is per request and only handlers get it).
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    reconciler = Reconciler(sessions, gate, engine_client, settings, app_metrics)
    assert settings.artifact_store is not None  # ControlPlaneSettings.__post_init__ sets the default
    artifact_store = ArtifactStore(settings.artifact_store)
    sweeper = StoreSweeper(sessions, gate, artifact_store, settings.store_gc_grace_s, app_metrics)
    stats_cache = StatsCache()
    history = HistorySampler(sessions, gate, settings, engine_client, stats_cache)  # the console's charts
    engine_gc = EngineCollector(sessions, gate, settings)  # engines silent past engine_gc_after_s
    tenant_auth = TenantAuth(sessions, gate, KeyHasher(settings.key_pepper),
                             KeyChecks(settings.key_failures_per_address, settings.key_failures_per_key,
                                       settings.key_failure_window_s))
    revocations = RevocationPublisher(settings.redis_url, settings.redis_prefix, on_publish=tenant_auth.forget)

    async def apply_migrations(_: Litestar) -> None:
        assert settings.data_dir is not None  # ControlPlaneSettings.__post_init__ sets the default
        await asyncio.to_thread(clean_spools, settings.data_dir)  # what a killed process left mid-upload
        await migrate.check_integrity(engine)  # a damaged SQLite file stops the start, saying so
        if settings.migrate_on_start:
            await migrate.upgrade(engine)
        await reconciler.start()
        await history.start()
        await sweeper.start()
        await engine_gc.start()

    async def stop_background(_: Litestar) -> None:
        await engine_gc.stop()
        await sweeper.stop()
        await history.stop()
        await reconciler.stop()
        await engine_client.aclose()
        await revocations.aclose()

    state: dict[str, Any] = {
        "settings": settings,
        "metrics": app_metrics,
        "write_gate": gate,
        "engine_client": engine_client,  # httpx pool for pushes to engines
        "version_loader": reconciler.loader,  # how pushes and reconciles tell an engine to load a version
        "artifact_store": artifact_store,  # every version's bytes (control_plane/artifacts)
        "reconciler": reconciler,
        # how the engines registry (below placements) asks for reconciles
        "reconciler_hooks": ReconcilerHooks(kick=reconciler.kick, reconcile_all=reconciler.reconcile_all),
        "routes_cache": RoutesCache(),  # the encoded routing table while its rows are unchanged
        "stats_cache": stats_cache,  # each engine's last figures for GET /v1/lora_stats
        "audit_sessions": sessions,
        "tenant_auth": tenant_auth,  # tenant keys (lp_…) and what they may touch (control_plane.auth)
        "revocations": revocations,  # key revocations and quota changes, published to the routers
    }
    console = Console(settings)
    app = Litestar(
        route_handlers=[health, metrics, AdapterController, EngineController, StatsController, ArtifactController,
                        RoutesController, RouterController, AuditController, TenantController, TenancyController,
                        console.router],
        plugins=[SQLAlchemyPlugin(config=plugin_config(engine))],
        on_startup=[apply_migrations],
        on_shutdown=[stop_background],
        state=State(state),
        # lost DB connection: 503; a 404 under /ui: the console's page
        exception_handlers={**exception_handlers(), **database_error_handlers(), NotFoundException: console.not_found},
        middleware=[app_metrics.middleware],
        logging_config=None,  # the process configures logging at its edge (shared/logging_setup.py), not the app
        # handlers' docstrings are their operations' descriptions
        openapi_config=OpenAPIConfig(title="loraplane control plane", version=VERSION, path="/schema",
                                     use_handler_docstrings=True),
    )
    document_app(app, extra_errors=_contract_errors)
    return app
