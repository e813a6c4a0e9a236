"""What every admin command shares: the connection options, --json, and running a click group as a
`main(argv) -> int` for shared.cli's dispatch table."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from control_plane.admin_cli import render
from control_plane.admin_cli.client import ERROR, Api, Reply, Unreachable
from control_plane.admin_cli.config import ConfigError, resolve


@dataclass
class Session:
    """One command's connection and output mode."""

    api: Api
    json: bool

    def finish(self, reply: Reply, show: Callable[[Any], None]) -> int:
        """Print the answer (as JSON, or with `show` when it is a success or a push's outcome), its
        `warnings` and the problem on stderr, and return the exit code."""
        if self.json:
            render.print_json(reply.body)
        elif reply.exit_code != ERROR or reply.pushed:
            show(reply.body)
        for warning in reply.warnings():
            click.echo(f"loraplane: warning: {warning}", err=True)
        problem = reply.problem()
        if problem is not None:
            click.echo(f"loraplane: {problem}", err=True)
        return reply.exit_code


def connected(command: Callable[..., int]) -> Callable[..., int]:
    """Add --url, --token, --profile, --timeout and --json to a command; it gets `session` instead."""
    @click.option("--json", "as_json", is_flag=True, help="print the control plane's JSON answer (for scripts)")
    @click.option("--timeout", type=float, default=300.0, show_default=True,
                  help="seconds to wait for an answer (a load waits for the engines)")
    @click.option("--profile", help="a table of the profile file (LORAPLANE_PROFILE; default: default)")
    @click.option("--token", help="bearer token (LORAPLANE_TOKEN, or the profile; prefer those: a flag's value "
                  "is left in shell history)")
    @click.option("--url", help="the control plane (LORAPLANE_URL, or the profile; default http://127.0.0.1:8080)")
    @functools.wraps(command)
    def wrapper(url: str | None, token: str | None, profile: str | None, timeout: float, as_json: bool,
                **kwargs: Any) -> int:
        try:
            api = Api(resolve(url, token, profile, timeout))
        except ConfigError as exc:
            click.echo(f"loraplane: {exc}", err=True)
            return ERROR
        try:
            return command(Session(api, as_json), **kwargs)
        except Unreachable as exc:
            click.echo(f"loraplane: {exc}", err=True)
            return ERROR
        finally:
            api.close()

    return wrapper


def run(command: click.Command, argv: list[str], prog_name: str) -> int:
    """Run a click command or group on argv and return its exit code (click's own 2 for usage errors)."""
    try:
        return int(command.main(args=argv, prog_name=prog_name, standalone_mode=False) or 0)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return ERROR
    except BrokenPipeError:  # `loraplane adapters list | head`
        sys.stderr.close()
        return 0
