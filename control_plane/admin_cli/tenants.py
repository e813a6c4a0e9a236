"""`loraplane tenants list|show|create|update|set-limits|keys|create-key|revoke-key|move`: tenants, their API
keys, quotas and sources, and which tenant owns an adapter. A key's secret is printed once, by create-key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import click
from rich.table import Table

from control_plane.admin_cli import render
from control_plane.admin_cli.options import Session, connected, run

_LIMITS = (("requests_per_minute", "--rpm", "requests per minute"),
           ("tokens_per_minute", "--tpm", "tokens per minute (prompt + generated)"),
           ("concurrent_requests", "--concurrent", "requests in flight at once"))


def limit_options(command: Callable[..., int]) -> Callable[..., int]:
    for field, flag, what in reversed(_LIMITS):
        command = click.option(flag, field, type=click.IntRange(min=1), help=f"{what} (left out: unlimited)")(command)
    return command


def _limits(values: dict[str, int | None]) -> dict[str, int]:
    return {k: v for k, v in values.items() if v is not None}


def _show_limits(limits: dict[str, Any]) -> str:
    shown = [f"{k.replace('_', ' ')} {v}" for k, v in limits.items() if v is not None]
    return ", ".join(shown) or "unlimited"


def _show_sources(sources: list[str]) -> str:
    return " ".join(sources) or "uploads only"


def source_option(command: Callable[..., int]) -> Callable[..., int]:
    return click.option("--source", "sources", multiple=True, metavar="PREFIX",
                        help="where the tenant's admin keys may load adapters from: an absolute folder (under "
                             "--lora-roots) or a URL prefix (s3://bucket/prefix, gs://, az://, hf://org[/name]); "
                             "repeat for several")(command)


@click.group(help="Tenants, their API keys, quotas and sources: list, show, create, update, set-limits, keys, "
                  "create-key, revoke-key, move (an adapter to a tenant).")
def tenants() -> None:
    pass


@tenants.command("list")
@connected
def list_(session: Session) -> int:
    """Every tenant with its quotas, sources, adapters owned and keys not revoked."""
    return session.finish(session.api.get("/v1/tenants"), lambda body: render.show(render.table(
        ("NAME", "DISPLAY NAME", "ADAPTERS", "KEYS", "LIMITS", "SOURCES"),
        [(t["name"], t["display_name"], t["adapters"], t["keys"], _show_limits(t["limits"]), _show_sources(t["sources"]))
         for t in body["data"]])))


@tenants.command()
@click.argument("name")
@connected
def show(session: Session, name: str) -> int:
    """NAME's quotas, sources, keys (ids, never secrets) and the adapters it owns, public or private."""
    path = f"/v1/tenants/{quote(name, safe='')}"
    tenant = session.api.get(path)
    if tenant.exit_code != 0:
        return session.finish(tenant, lambda _: None)
    keys, owned = session.api.get(path + "/keys"), session.api.get(path + "/adapters")
    for reply in (keys, owned):
        if reply.exit_code != 0:
            return session.finish(reply, lambda _: None)
    body = {**tenant.body, "api_keys": keys.body["data"], "owned_adapters": owned.body["adapters"]}
    return session.finish(dataclasses.replace(tenant, body=body), _tenant)


def _tenant(body: dict[str, Any]) -> None:
    facts = render.table(("", ""), [
        ("name", body["name"]), ("display name", body["display_name"]), ("limits", _show_limits(body["limits"])),
        ("sources", _show_sources(body["sources"])), ("created", render.when(body["created_at"])),
    ])
    facts.show_header = False
    render.show(facts, _keys_table(body["api_keys"], title="keys"), render.table(
        ("ADAPTER", "VISIBILITY"), [(a["name"], "public" if a["public"] else "private")
                                    for a in body["owned_adapters"]], title="adapters"))


def _keys_table(rows: list[dict[str, Any]], title: str | None = None) -> Table:
    return render.table(("KEY ID", "NAME", "SCOPES", "LIMITS", "EXPIRES", "LAST USED", "REVOKED"),
                        [(k["key_id"], k["name"], " ".join(k["scopes"]), _show_limits(k["limits"]),
                          render.when(k["expires_at"]), render.when(k["last_used_at"]), render.when(k["revoked_at"]))
                         for k in rows], title=title)


@tenants.command()
@click.argument("name")
@click.option("--display-name", default="")
@click.option("--adapters", type=click.IntRange(min=1), help="adapters it may own (left out: unlimited)")
@source_option
@limit_options
@connected
def create(session: Session, name: str, display_name: str, adapters: int | None, sources: tuple[str, ...],
           **limits: int | None) -> int:
    """Create tenant NAME with its quotas and sources (none: its keys may only upload adapter files)."""
    body = {"name": name, "display_name": display_name, "limits": _limits({**limits, "adapters": adapters}),
            "sources": list(sources)}
    return session.finish(session.api.call("POST", "/v1/tenants", json=body), lambda t: render.show(
        f"created tenant {t['name']}: {_show_limits(t['limits'])}; sources: {_show_sources(t['sources'])}"))


@tenants.command()
@click.argument("name")
@click.option("--display-name")
@source_option
@click.option("--no-sources", is_flag=True, help="remove every source (its keys may then only upload)")
@connected
def update(session: Session, name: str, display_name: str | None, sources: tuple[str, ...], no_sources: bool) -> int:
    """Set NAME's display name and/or sources (--source replaces them all); what is left out is kept."""
    if sources and no_sources:
        raise click.UsageError("give --source or --no-sources, not both")
    body: dict[str, Any] = {} if display_name is None else {"display_name": display_name}
    if sources or no_sources:
        body["sources"] = list(sources)
    if not body:
        raise click.UsageError("nothing to change: give --display-name, --source or --no-sources")
    return session.finish(session.api.call("PATCH", f"/v1/tenants/{quote(name, safe='')}", json=body),
                          lambda t: render.show(f"{t['name']}: sources: {_show_sources(t['sources'])}"))


@tenants.command("set-limits")
@click.argument("name")
@click.option("--adapters", type=click.IntRange(min=1), help="adapters it may own (left out: unlimited)")
@limit_options
@connected
def set_limits(session: Session, name: str, adapters: int | None, **limits: int | None) -> int:
    """Replace NAME's quotas (each one left out becomes unlimited)."""
    body = {"limits": _limits({**limits, "adapters": adapters})}
    return session.finish(session.api.call("PATCH", f"/v1/tenants/{quote(name, safe='')}", json=body),
                          lambda t: render.show(f"{t['name']}: {_show_limits(t['limits'])}"))


@tenants.command()
@click.argument("name")
@connected
def keys(session: Session, name: str) -> int:
    """NAME's keys (ids, never secrets)."""
    return session.finish(session.api.get(f"/v1/tenants/{quote(name, safe='')}/keys"),
                          lambda body: render.show(_keys_table(body["data"])))


@tenants.command("create-key")
@click.argument("tenant")
@click.option("--name", "key_name", required=True, help="what the key is for")
@click.option("--scope", "scopes", multiple=True, default=("inference",), show_default=True,
              help="inference and/or admin:<tenant>; repeat for several")
@click.option("--expires-at", help="RFC 3339 time with its offset, e.g. 2027-01-01T00:00:00Z")
@limit_options
@connected
def create_key(session: Session, tenant: str, key_name: str, scopes: tuple[str, ...], expires_at: str | None,
               **limits: int | None) -> int:
    """Create a key for TENANT; the key is printed this once and never shown again."""
    body: dict[str, Any] = {"name": key_name, "scopes": list(scopes), "limits": _limits(limits)}
    if expires_at:
        body["expires_at"] = expires_at
    reply = session.api.call("POST", f"/v1/tenants/{quote(tenant, safe='')}/keys", json=body)
    return session.finish(reply, lambda b: render.show(
        f"key {b['api_key']['key_id']} of {tenant} ({' '.join(b['api_key']['scopes'])}):\n{b['key']}\n"
        "(shown once: store it now)"))


@tenants.command("revoke-key")
@click.argument("tenant")
@click.argument("key_id")
@connected
def revoke_key(session: Session, tenant: str, key_id: str) -> int:
    """Revoke TENANT's key KEY_ID (routers refuse it within 5 s)."""
    reply = session.api.call("DELETE", f"/v1/tenants/{quote(tenant, safe='')}/keys/{quote(key_id, safe='')}")
    return session.finish(reply, lambda k: render.show(f"revoked {k['key_id']}"))


@tenants.command()
@click.argument("adapter")
@click.argument("tenant", required=False)
@click.option("--public/--private", default=False, help="whether every tenant may use it")
@connected
def move(session: Session, adapter: str, tenant: str | None, public: bool) -> int:
    """Give ADAPTER to TENANT (left out: to nobody), public or private."""
    reply = session.api.call("PUT", f"/v1/tenancy/adapters/{quote(adapter, safe='/')}",
                             json={"owner": tenant, "public": public})
    return session.finish(reply, lambda a: render.show(
        f"{a['name']}: owner {a['owner'] or 'nobody'}, {'public' if a['public'] else 'private'}"))


def main(argv: list[str]) -> int:
    return run(tenants, argv, "loraplane tenants")
