"""The `loraplane` console script: dispatch on the first argument to a subcommand module.

Subcommand modules are imported only when chosen, so `loraplane demo-model` does not import the
web stack and `loraplane --help` imports nothing heavy. The base install (`pip install loraplane`) has no
torch: the commands that run an engine say which extra to install instead of failing on an import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable

# name -> (module, help line); each module has `main(argv: list[str]) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("data_plane.api.server", "run a data-plane engine (OpenAI-compatible API)"),
    "control": ("control_plane.cli", "run the control plane or call its admin API"),
    "router": ("data_plane.router.cli", "run the router: one OpenAI endpoint in front of the engines"),
    "agent": ("data_plane.agent.cli", "run beside a vLLM server: it becomes an engine of the fleet"),
    "up": ("control_plane.up", "start the control plane, engines and the router on the demo model, adapters loaded"),
    "demo-model": ("data_plane.demo.cli", "write a small random Qwen2 checkpoint for demos and tests"),
    # the admin CLI, a client of the control plane's API (LORAPLANE_URL, LORAPLANE_TOKEN)
    "adapters": ("control_plane.admin_cli.adapters", "list, show, load, upload, unload, activate, update, pin, unpin, delete adapters"),
    "engines": ("control_plane.admin_cli.engines", "list, drain, remove engines"),
    "stats": ("control_plane.admin_cli.stats", "per-adapter figures across the engines (--watch to follow)"),
    "audit": ("control_plane.admin_cli.audit", "the audit trail of admin calls, newest first"),
    "tenants": ("control_plane.admin_cli.tenants", "tenants, their API keys, quotas and adapters; move adapters between them"),
}
# Commands that run the engine (or write a torch checkpoint): they need `pip install 'loraplane[engine]'`.
NEEDS_ENGINE = frozenset({"engine", "up", "demo-model"})
ENGINE_EXTRA_HINT = "install loraplane[engine] (pip install 'loraplane[engine]'): it adds torch and the engine"


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: loraplane <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_line}" for name, (_, help_line) in SUBCOMMANDS.items()]
    lines += ["", "Run `loraplane <command> --help` for a command's options."]
    return "\n".join(lines)


def _load(module_name: str) -> Callable[[list[str]], int]:
    main: Callable[[list[str]], int] = importlib.import_module(module_name).main  # each command's entry point
    return main


def run(argv: list[str]) -> int:
    """Dispatch and return the exit code (main() wraps this in sys.exit)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"loraplane: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in NEEDS_ENGINE and importlib.util.find_spec("torch") is None:
        print(f"loraplane: the {name!r} command needs the engine, which this installation lacks; "
              f"{ENGINE_EXTRA_HINT}", file=sys.stderr)
        return 1
    module_name = SUBCOMMANDS[name][0]
    try:
        command = _load(module_name)
    except ImportError as e:
        # Only "the subcommand module itself is missing" gets the friendly message; a broken import
        # inside an existing module is a bug and should show its traceback.
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise
        print(f"loraplane: the {name!r} command is not available in this installation ({e})", file=sys.stderr)
        return 1
    return int(command(rest) or 0)


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
