"""`loraplane engines list|drain|remove`: the engines registered with the control plane."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from control_plane.admin_cli import render
from control_plane.admin_cli.options import Session, connected, run


@click.group(help="The engines registered with the control plane: list, drain, remove.")
def engines() -> None:
    pass


@engines.command("list")
@connected
def list_(session: Session) -> int:
    """Every engine with its health, base model, slots and last heartbeat."""
    return session.finish(session.api.get("/v1/engines"), _list)


def _list(body: dict[str, Any]) -> None:
    rows = [(e["name"], e["state"], e["base_model"], f"{e['slots_used']}/{e['slots_total']}", e["device_kind"],
             render.when(e["last_heartbeat"]), e["url"]) for e in body["data"]]
    render.show(render.table(("NAME", "STATE", "BASE MODEL", "SLOTS", "DEVICE", "LAST HEARTBEAT", "URL"), rows))


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


def main(argv: list[str]) -> int:
    return run(engines, argv, "loraplane engines")
