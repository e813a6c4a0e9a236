"""`loraplane audit`: the audit trail, newest first (GET /v1/audit)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import click

from control_plane.admin_cli import render
from control_plane.admin_cli.options import Session, connected, run

HELP = "The audit trail, newest first: every mutating call, done or refused (GET /v1/audit)."


@click.command(help=HELP)
@click.option("--adapter", help="rows on this adapter (its name, or name@version)")
@click.option("--actor", help="the caller, as the rows name it (role:name, e.g. admin:ops)")
@click.option("--action", help="e.g. load_lora_adapter, pin_lora_adapter, drain_engine")
@click.option("--since", help="at or after this time (ISO 8601, e.g. 2026-01-31T12:00:00Z; no offset: UTC)")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--offset", type=int, default=0, show_default=True)
@connected
def audit(session: Session, adapter: str | None, actor: str | None, action: str | None, since: str | None,
          limit: int, offset: int) -> int:
    params: dict[str, Any] = {"adapter": adapter, "actor": actor, "action": action, "since": _with_offset(since),
                              "limit": limit, "offset": offset}
    reply = session.api.get("/v1/audit", {k: v for k, v in params.items() if v is not None})
    return session.finish(reply, _page)


def _with_offset(since: str | None) -> str | None:
    """The API wants RFC 3339 with its offset; a time given without one is UTC (left as typed if unparseable:
    the server's 400 names the problem)."""
    if since is None:
        return None
    try:
        when = dt.datetime.fromisoformat(since)
    except ValueError:
        return since
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).isoformat()


def _page(body: dict[str, Any]) -> None:
    rows = [(render.when(e["at"]), e["actor"], e["action"], e["target"], e["outcome"]) for e in body["data"]]
    render.show(render.table(("AT", "ACTOR", "ACTION", "TARGET", "OUTCOME"), rows),
                f"{len(rows)} of {body['total']} (offset {body['offset']})")


def main(argv: list[str]) -> int:
    return run(audit, argv, "loraplane audit")
