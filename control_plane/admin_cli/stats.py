"""`loraplane stats [--watch]`: per adapter across the healthy engines (GET /v1/lora_stats)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Group
from rich.live import Live

from control_plane.admin_cli import render
from control_plane.admin_cli.client import ERROR, Reply
from control_plane.admin_cli.options import Session, connected, run


def figures(body: dict[str, Any]) -> Group:
    adapters = render.table(
        ("ADAPTER", "REQUESTS", "TOKENS/S 1M", "TTFT P50", "TTFT P99", "E2E P99", "LOADS", "EVICTIONS", "ENGINES"),
        [(a["name"], sum(a["requests"].values()), f"{a['generated_tokens_per_second_1m']:.1f}",
          render.seconds(a["ttft_seconds"]["p50"]), render.seconds(a["ttft_seconds"]["p99"]),
          render.seconds(a["e2e_seconds"]["p99"]), a["loads"], a["evictions"],
          ",".join(f"{e['engine']}:{e['residency'] or '-'}" for e in a["engines"])) for a in body["adapters"]])
    engines = render.table(("ENGINE", "FIGURES AGE", "ERROR"),
                           [(e["engine"], "never" if e["age_s"] is None else f"{e['age_s']:.1f} s", e["error"])
                            for e in body["engines"]])
    return Group(adapters, "", engines)

HELP = "Per adapter across the healthy engines: requests, tokens/s, TTFT and end-to-end latency, loads (GET /v1/lora_stats)."


@click.command(help=HELP)
@click.option("--watch", is_flag=True, help="refresh until interrupted")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds between refreshes with --watch")
@click.option("--count", type=click.IntRange(min=0), default=0, help="with --watch: stop after this many (0: never)")
@connected
def stats(session: Session, watch: bool, interval: float, count: int) -> int:
    if not watch:
        return session.finish(session.api.get("/v1/lora_stats"), lambda body: render.show(figures(body)))
    if session.json:  # one JSON document per line, for a script reading as it goes
        return _each(session, interval, count, lambda reply: render.print_json(reply.body, one_line=True))
    with Live(console=render.console, auto_refresh=False) as live:
        def update(reply: Reply) -> None:
            live.update(figures(reply.body), refresh=True)

        return _each(session, interval, count, update)


def _each(session: Session, interval: float, count: int, show: Callable[[Reply], None]) -> int:
    shown = 0
    try:
        while True:
            reply = session.api.get("/v1/lora_stats")
            if reply.exit_code == ERROR:  # a watch ends on an error (the problem is said on stderr)
                return session.finish(reply, lambda _: None)
            show(reply)
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def main(argv: list[str]) -> int:
    return run(stats, argv, "loraplane stats")
