"""`loraplane engines list|drain|remove`: the engines registered with the control plane; `loraplane engines
token NAME`: engine NAME's admin token, derived locally from the secret (no call: no answer carries one)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import click

from control_plane.admin_cli import render
from control_plane.admin_cli.client import ERROR
from control_plane.admin_cli.options import Session, connected, run
from control_plane.engine_tokens import ENGINE_SECRET_ENV, engine_admin_token, engine_secret_from
from shared.names import name_problem


@click.group(help="The engines registered with the control plane: list, drain, remove; an engine's admin token.")
def engines() -> None:
    pass


@engines.command("list")
@connected
def list_(session: Session) -> int:
    """Every engine with its kind, health, base model, slots, last heartbeat and addresses (admin; inference
    when it is elsewhere)."""
    return session.finish(session.api.get("/v1/engines"), _list)


def _list(body: dict[str, Any]) -> None:
    # `kind` and `inference_url` are absent from an older control plane's answer: its engines are all loraplane's
    rows = [(e["name"], e["state"], e.get("kind", "loraplane"), e["base_model"], f"{e['slots_used']}/{e['slots_total']}",
             e["device_kind"], render.when(e["last_heartbeat"]), e["url"], e.get("inference_url"))
            for e in body["data"]]
    render.show(render.table(("NAME", "STATE", "KIND", "BASE MODEL", "SLOTS", "DEVICE", "LAST HEARTBEAT", "URL",
                              "INFERENCE URL"), rows))


def _one(body: dict[str, Any]) -> None:
    render.show(f"{body['name']}: {body['state']}")


@engines.command()
@click.argument("name")
@connected
def drain(session: Session, name: str) -> int:
    """Give NAME no new placements from now on (until it registers again); what it holds stays."""
    return session.finish(session.api.call("POST", f"/v1/engines/{quote(name, safe='/')}/drain"), _one)


@engines.command()
@click.argument("name")
@connected
def remove(session: Session, name: str) -> int:
    """Forget NAME and its placements (the engine keeps running and may register again)."""
    reply = session.api.call("DELETE", f"/v1/engines/{quote(name, safe='/')}")
    return session.finish(reply, lambda _: render.show(f"removed {name}"))


@engines.command()
@click.argument("name")
def token(name: str) -> int:
    """Print engine NAME's admin token (its --admin-token), derived from the secret the control plane holds:
    LORAPLANE_ENGINE_ADMIN_TOKEN, or the file LORAPLANE_ENGINE_ADMIN_TOKEN_FILE names. Computed here, with no
    call to the control plane. E.g. LORAPLANE_ADMIN_TOKEN=$(loraplane engines token e1) loraplane engine …"""
    try:
        secret = engine_secret_from(os.environ)
    except ValueError as exc:
        click.echo(f"loraplane: {exc}", err=True)
        return ERROR
    if secret is None:
        click.echo(f"loraplane: set {ENGINE_SECRET_ENV} (or {ENGINE_SECRET_ENV}_FILE) to the control plane's "
                   "engine secret: each engine's admin token is derived from it", err=True)
        return ERROR
    problem = name_problem(name)
    if problem is not None:
        raise click.BadParameter(f"{problem}: not an engine name", param_hint="NAME")
    click.echo(engine_admin_token(secret, name))
    return 0


def main(argv: list[str]) -> int:
    return run(engines, argv, "loraplane engines")
