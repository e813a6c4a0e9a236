"""The console's routes (/ui, left out of the OpenAPI document): thin handlers that read a page through
the services (`pages`) or run one service call for a form, and render a template.

Every page needs a session (else: the sign-in page); every form carries the session's CSRF token, which
the handler checks first (403 without it), and a form that changes state needs an admin session (403
for a read one, whose pages show no such buttons). A form's answer is a redirect back to the page it
came from, saying how the call went (POST, redirect, GET: a reload repeats nothing).
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from litestar import Controller, MediaType, Request, Response, Router, get, post
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.datastructures import Cookie, State
from litestar.di import Provide
from litestar.exceptions import NotFoundException
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import audit
from control_plane.domain.adapters import schemas
from control_plane.domain.adapters.controller import provide_adapter_service
from control_plane.domain.adapters.service import AdapterService
from control_plane.domain.audit.controller import provide_audit_service
from control_plane.domain.audit.service import AuditQuery, AuditService
from control_plane.domain.engines.controller import provide_engine_service
from control_plane.domain.engines.service import EngineService
from control_plane.domain.placements.push import EngineOutcome
from control_plane.domain.routers.service import list_routers
from control_plane.settings import ControlPlaneSettings
from control_plane.ui import pages
from control_plane.ui.session import COOKIE, MAX_AGE_S, ConsoleSession, SessionCodec, SignInLimits, over_https
from shared.errors import InvalidRequestError, LoraplaneError
from shared.http_errors import handle_http_exception

HERE = Path(__file__).parent
_TEMPLATES = JinjaTemplateEngine(engine_instance=jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, undefined=jinja2.StrictUndefined))
_LOGIN_CSRF = "loraplane_console_login"  # the sign-in form's own double-submit token (no session yet)
# Only our own files: scripts, styles (htmx adds an inline style for its indicators) and images.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'"
_ACTIONS = ("load", "unload", "activate", "rollback", "pin", "unpin")


def _cookie(request: Request[Any, Any, Any], key: str, value: str, max_age: int) -> Cookie:
    """Secure when the request came over https (TLS may end at a trusted proxy: X-Forwarded-Proto); a
    Secure cookie would be dropped on plain http."""
    return Cookie(key=key, value=value, path="/ui", httponly=True, samesite="strict", max_age=max_age,
                  secure=over_https(request))


def _html(template: str, status_code: int = 200, cookies: list[Cookie] | None = None, **context: Any) -> Response[str]:
    body = _TEMPLATES.get_template(template).render(**context)
    return Response(body, media_type=MediaType.HTML, status_code=status_code, cookies=cookies or [],
                    headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                             "Content-Security-Policy": _CSP})


def _back(page: str, **query: str) -> Redirect:
    return Redirect(f"{page}?{urlencode({k: v for k, v in query.items() if v})}", status_code=303)


def _refused(message: str, session: ConsoleSession | None) -> Response[str]:
    return _html("refused.html", status_code=403, session=session, message=message, page="")


class ConsoleController(Controller):
    path = "/ui"
    include_in_schema = False
    dependencies = {"adapters": Provide(provide_adapter_service), "engines": Provide(provide_engine_service),
                    "audit": Provide(provide_audit_service)}

    @get("/", name="console-home")
    async def home(self) -> Redirect:
        return Redirect("/ui/fleet", status_code=303)

    @get("/login")
    async def login_page(self, request: Request[Any, Any, Any], error: str = "") -> Response[str]:
        token = secrets.token_urlsafe(24)
        return _html("login.html", session=None, page="login", csrf=token, error=error,
                     cookies=[_cookie(request, _LOGIN_CSRF, token, 600)])

    @post("/login")
    async def login(self, request: Request[Any, Any, Any], codec: SessionCodec, sign_ins: SignInLimits,
                    state: State) -> Response[Any]:
        host = request.client.host if request.client else "unknown"
        wait = sign_ins.wait_s(host)
        if wait is not None:  # before any token is compared
            response = _html("refused.html", status_code=429, session=None, page="", message=(
                f"Too many failed sign-ins from your address; try again in {wait:.0f} s."))
            response.headers["Retry-After"] = str(max(1, int(wait + 0.999)))
            return response
        form = await request.form()
        sent, expected = str(form.get("csrf", "")), request.cookies.get(_LOGIN_CSRF, "")
        if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
            return _refused("The sign-in form expired or did not come from this console; reload it.", None)
        offered = str(form.get("token", "")).strip()
        role = codec.role_of(offered) if offered else None
        if role is None:
            failures = sign_ins.fail(host)
            async with state.audit_sessions() as db:  # the address, never what was offered
                row = audit.event(f"address:{host}"[:32], "console_sign_in", "/ui/login", "401 authentication_error",
                                  detail={"address": host, "failures_in_window": failures})
                await audit.record_alone(db, state.write_gate, row)
            return _back("/ui/login", error="That token is not a read or admin token of this control plane.")
        _, cookie = codec.issue(role, offered)
        response = Redirect("/ui/fleet", status_code=303)
        response.cookies = [_cookie(request, COOKIE, cookie, MAX_AGE_S), _cookie(request, _LOGIN_CSRF, "", 0)]
        return response

    @post("/logout")
    async def logout(self, request: Request[Any, Any, Any], codec: SessionCodec) -> Response[Any]:
        session = await codec.current(request)
        form = await request.form()
        if session is None or not _csrf_ok(session, str(form.get("csrf", ""))):
            return _refused("This form did not come from your console session.", session)
        await codec.end(request, session)  # a copy of the cookie is refused from now on
        response = Redirect("/ui/login", status_code=303)
        response.cookies = [_cookie(request, COOKIE, "", 0)]
        return response

    @get("/fleet")
    async def fleet(self, request: Request[Any, Any, Any], state: State, codec: SessionCodec,
                    engines: EngineService, db_session: AsyncSession,
                    live: bool = False, notice: str = "", error: str = "") -> Response[Any]:
        session = await codec.current(request)
        if session is None:
            return Redirect("/ui/login", status_code=303)
        rows = await pages.fleet(engines, db_session)
        settings = state.settings
        return _html("fleet_live.html" if live else "fleet.html", session=session, page="fleet", rows=rows,
                     routers=await list_routers(db_session), stale_after_s=settings.engine_stale_after_s,
                     gc_after_s=settings.engine_gc_after_s, notice=notice[:300], error=error[:300])

    @post("/fleet")
    async def remove_engine(self, request: Request[Any, Any, Any], codec: SessionCodec, state: State,
                            engines: EngineService) -> Response[Any]:
        """The Fleet page's Remove button (action `remove_engine`, name): the service call of
        DELETE /v1/engines/{name}, as the signed-in admin token, audited as that call is."""
        checked = await _admin_form(request, codec, state, "Removing engines")
        if not isinstance(checked, tuple):
            return checked
        session, form = checked
        name = form.get("name", "").strip()
        if form.get("action") != "remove_engine" or not name:
            return _refused(f"Unknown action {form.get('action', '')[:40]!r}.", session)
        try:
            await engines.delete(name, session.principal)
        except LoraplaneError as exc:
            return _back("/ui/fleet", error=exc.message)
        return _back("/ui/fleet", notice=f"Removed engine {name} and its placements.")

    @get("/adapters")
    async def adapter_list(self, request: Request[Any, Any, Any], codec: SessionCodec, adapters: AdapterService,
                           live: bool = False, search: str = "", base_model: str = "", label: str = "",
                           owner: str = "", offset: int = 0) -> Response[Any]:
        session = await codec.current(request)
        if session is None:
            return Redirect("/ui/login", status_code=303)
        filters = pages.AdapterFilters(search=search[:128], base_model=base_model[:256], label=label[:400],
                                       owner=owner.strip()[:64])
        error = ""
        try:
            details, total = await pages.adapters(adapters, filters, max(0, offset))
        except LoraplaneError as exc:
            details, total, error = [], 0, exc.message
        return _html("adapters_live.html" if live else "adapters.html", session=session, page="adapters",
                     adapters=details, total=total, filters=filters, offset=max(0, offset), error=error,
                     per_page=pages.ADAPTERS_PER_PAGE, query=urlencode(filters.__dict__))

    @get("/adapter")
    async def adapter_page(self, request: Request[Any, Any, Any], codec: SessionCodec, state: State,
                           adapters: AdapterService, audit: AuditService, db_session: AsyncSession, name: str,
                           live: str = "", notice: str = "", error: str = "") -> Response[Any]:
        """One adapter's page: /ui/adapter?name=NAME (the form the console's own links and forms use)."""
        return await _adapter_page(request, codec, state, adapters, audit, db_session, name, live, notice, error)

    @get("/adapters/{name:path}")
    async def adapter_at_path(self, request: Request[Any, Any, Any], codec: SessionCodec, state: State,
                              adapters: AdapterService, audit: AuditService, db_session: AsyncSession, name: str,
                              live: str = "", notice: str = "", error: str = "") -> Response[Any]:
        """The same page at /ui/adapters/NAME (names may hold `/`: the rest of the path is the name)."""
        return await _adapter_page(request, codec, state, adapters, audit, db_session, name.lstrip("/"), live,
                                   notice, error)

    @get("/audit")
    async def audit_page(self, request: Request[Any, Any, Any], codec: SessionCodec, audit: AuditService,
                         live: bool = False, adapter: str = "", actor: str = "", action: str = "",
                         offset: int = 0) -> Response[Any]:
        session = await codec.current(request)
        if session is None:
            return Redirect("/ui/login", status_code=303)
        filters = {"adapter": adapter[:256], "actor": actor[:256], "action": action[:64]}
        try:
            trail = await audit.page(AuditQuery(limit=pages.AUDIT_PER_PAGE, offset=max(0, offset),
                                                adapter=filters["adapter"] or None, actor=filters["actor"] or None,
                                                action=filters["action"] or None))
            events, total, error = trail.data, trail.total, ""
        except LoraplaneError as exc:
            events, total, error = [], 0, exc.message
        return _html("audit_live.html" if live else "audit.html", session=session, page="audit", events=events,
                     total=total, filters=filters, offset=max(0, offset), error=error, per_page=pages.AUDIT_PER_PAGE,
                     query=urlencode(filters))

    @post("/adapter")
    async def act(self, request: Request[Any, Any, Any], codec: SessionCodec, state: State,
                  adapters: AdapterService) -> Response[Any]:
        """One admin form on the Adapters or Adapter page: load (name, path), unload, activate (version),
        rollback, pin, unpin; the service call the API's handler makes, as the signed-in token."""
        checked = await _admin_form(request, codec, state, "Changing adapters")
        if not isinstance(checked, tuple):
            return checked
        session, form = checked
        name, action = form.get("name", "").strip(), form.get("action", "")
        if action not in _ACTIONS or not name:
            return _refused(f"Unknown action {action[:40]!r}.", session)
        try:
            notice = await _run(adapters, session, action, name, form)
        except LoraplaneError as exc:
            return _back("/ui/adapter", name=name, error=exc.message)
        return _back("/ui/adapter", name=name, notice=notice)


async def _adapter_page(request: Request[Any, Any, Any], codec: SessionCodec, state: State, adapters: AdapterService,
                        audit: AuditService, db_session: AsyncSession, name: str, live: str, notice: str,
                        error: str) -> Response[Any]:
    session = await codec.current(request)
    if session is None:
        return Redirect("/ui/login", status_code=303)
    if not name:
        return Redirect("/ui/adapters", status_code=303)
    try:
        detail, trail, charts = await pages.adapter(adapters, audit, db_session, name,
                                                    state.settings.reconcile_interval_s)
    except LoraplaneError as exc:
        return _html("missing.html", status_code=exc.status_code, session=session, page="adapters",
                     message=exc.message)
    # live=1: the state and placements; live=charts: the charts (each refreshed on its own timer)
    template = {"": "adapter.html", "charts": "adapter_charts.html"}.get(live, "adapter_live.html")
    return _html(template, session=session, page="adapters", adapter=detail, trail=trail, charts=charts,
                 rollback=pages.rollback_target(detail), notice=notice, error=error,
                 name_query=urlencode({"name": name}))


async def _admin_form(request: Request[Any, Any, Any], codec: SessionCodec, state: State,
                      what: str) -> tuple[ConsoleSession, dict[str, str]] | Response[str]:
    """The session and fields of a form that changes state, or the 403 page: without the session's CSRF
    token, or from a read session (audited as `console_<action>`, as the API's admin guard audits a read
    token's attempt)."""
    session = await codec.current(request)
    form = {k: str(v) for k, v in (await request.form()).items()}
    if session is None or not _csrf_ok(session, form.get("csrf", "")):
        return _refused("This form did not come from your console session (CSRF token missing or wrong); "
                        "reload the page and try again.", session)
    if not session.can_act:
        async with state.audit_sessions() as db:
            row = audit.event(session.principal.actor, f"console_{form.get('action', '')[:40]}",
                              form.get("name", "")[:256] or request.url.path, "403 permission_error")
            await audit.record_alone(db, state.write_gate, row)
        return _refused(f"{what} needs an admin token; you signed in with a read token.", session)
    return session, form


def _csrf_ok(session: ConsoleSession, sent: str) -> bool:
    return hmac.compare_digest(sent.encode(), session.csrf.encode())


async def _run(service: AdapterService, session: ConsoleSession, action: str, name: str, form: dict[str, str]) -> str:
    """The service call behind one console action; what the page then says about it."""
    actor = session.principal
    if action == "load":
        loaded = await service.load(schemas.AdapterCreate(lora_name=name, lora_path=form.get("path", "")), actor)
        return f"Loaded {name} version {loaded.version}{_outcomes(loaded.engines)}"
    if action == "unload":
        unloaded = await service.unload(schemas.AdapterUnload(lora_name=name), actor)
        return f"Unloaded {name}{_outcomes(unloaded.engines)}"
    if action in ("activate", "rollback"):
        version = form.get("version", "")
        if not version.isdigit():
            raise InvalidRequestError("version must be a number", param="version")
        activated = await service.activate(name, schemas.AdapterActivate(version=int(version)), actor)
        return f"Version {version} of {name} is active{_outcomes(activated.engines)}"
    updated = await service.update(name, schemas.AdapterUpdate(pinned=action == "pin"), actor)
    return f"{name} is {'pinned' if action == 'pin' else 'unpinned'}{_outcomes(updated.engines)}"


def _outcomes(engines: list[EngineOutcome]) -> str:
    if not engines:
        return "."
    return ": " + ", ".join(f"{e.engine} {e.outcome}" + (f" ({e.error})" if e.error else "") for e in engines) + "."


class Console:
    """The console's pages and its vendored assets under /ui (`router`, registered by control_plane.app), and
    its answer to a 404 under /ui (`not_found`, the app's handler of NotFoundException); the session
    codec is made here, once per app, so that an unset secret is drawn (and logged) once."""

    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.codec = codec = SessionCodec(settings)
        static = create_static_files_router(path="/ui/static", directories=[HERE / "static"], include_in_schema=False,
                                            name="console-static")
        sign_ins = SignInLimits(settings.key_failures_per_address, settings.key_failure_window_s)
        self.router = Router(path="/", route_handlers=[ConsoleController, static], include_in_schema=False,
                             dependencies={"codec": Provide(lambda: codec, sync_to_thread=False),
                                           "sign_ins": Provide(lambda: sign_ins, sync_to_thread=False)})

    def not_found(self, request: Request[Any, Any, Any], exc: NotFoundException) -> Response[Any]:
        """A 404 under /ui is the console's page saying so, with the console's links when signed in;
        elsewhere it is the API's JSON error."""
        path = request.url.path
        if path != "/ui" and not path.startswith("/ui/"):
            return handle_http_exception(request, exc)
        return _html("missing.html", status_code=404, session=self.codec.read(request.cookies.get(COOKIE)),
                     page="", message=f"There is no console page at {path}.")
