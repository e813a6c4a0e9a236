"""One reader's shell: the walked blocks run in order, each in `bash -e -o pipefail`, with what a block
leaves (variables, exported or not; functions such as the virtualenv's `deactivate`; the folder) handed
to the next one, as a terminal keeps it.

Every `curl` is a shim (curl_shim.sh, first on PATH) that fails on a status other than 2xx, unless the
command's line in the page states its status (`curl … # → 404`): then that status, and only it, passes.
A python block runs as `.venv/bin/python FILE` in the same folder and environment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.docs_walk.pages import Block
from tests.docs_walk.ports import Ports

_EXPECTED = re.compile(r"#\s*→\s*([1-5]\d\d)\b")
_FAILED = re.compile(r"^@@failed (\d+) (\d+): (.*)$", re.M)
# bash's own variables (and the walk's), not a reader's: never handed from one block to the next
_SHELL_OWN = ("BASH*|FUNCNAME|LINENO|RANDOM|SRANDOM|SECONDS|PIPESTATUS|SHLVL|_|EPOCH*|SHELLOPTS|BASHOPTS|UID|EUID|"
              "PPID|GROUPS|DIRSTACK|HISTCMD|OPTIND|OPTARG|OLDPWD|PWD|IFS|COMP_WORDBREAKS|HOSTNAME|HOSTTYPE|"
              "MACHTYPE|OSTYPE|COLUMNS|LINES|PS4|__walk*")
_PROLOGUE = f"""\
__walk_save() {{
  local __walk_n __walk_d
  for __walk_n in $(compgen -v); do
    case $__walk_n in {_SHELL_OWN}) continue;; esac
    __walk_d=$(declare -p "$__walk_n" 2>/dev/null) || continue
    [[ $__walk_d =~ ^declare\\ -[a-zA-Z]*r ]] || printf '%s\\n' "$__walk_d"
  done > "$WALK_STATE.new"
  for __walk_n in $(compgen -A function); do
    case $__walk_n in __walk*) ;; *) declare -f "$__walk_n";; esac
  done >> "$WALK_STATE.new"
  printf 'cd %q\\n' "$PWD" >> "$WALK_STATE.new"
  mv "$WALK_STATE.new" "$WALK_STATE"
}}
if [ -f "$WALK_STATE" ]; then source "$WALK_STATE"; fi
trap '__walk_save' EXIT
set -eE -o pipefail
trap 'echo "@@failed $LINENO $?: $BASH_COMMAND" >&2' ERR
"""
_PROLOGUE_LINES = _PROLOGUE.count("\n")


def logical_lines(text: str) -> list[str]:
    """The block's lines with backslash continuations joined (newlines kept), as bash reads commands."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        if out and out[-1].rstrip("\n").endswith("\\"):
            out[-1] += line
        else:
            out.append(line)
    return out


def mark_expected(text: str) -> str:
    """Each command whose line says `# → NNN` runs with CURL_EXPECT=NNN (it must be a curl call)."""
    out = []
    for command in logical_lines(text):
        found = _EXPECTED.search(command)
        if found and not command.lstrip().startswith("#"):
            if not command.lstrip().startswith("curl "):
                raise ValueError(f"an expected status is for a line starting with curl: {command.strip()}")
            command = f"CURL_EXPECT={found.group(1)} {command.lstrip()}"
        out.append(command)
    return "".join(out)


@dataclass
class Session:
    """The walk's shell in `folder` (the stack's working directory, as `make run`'s is the clone), with
    its scripts and state in `tools`."""

    folder: Path
    tools: Path
    ports: Ports
    env: dict[str, str]

    def __post_init__(self) -> None:
        shim_dir = self.tools / "bin"
        shim_dir.mkdir(parents=True, exist_ok=True)
        real = shutil.which("curl")
        assert real is not None, "curl is not installed"
        shim = (Path(__file__).parent / "curl_shim.sh").read_text().replace("@REAL_CURL@", real)
        (shim_dir / "curl").write_text(shim)
        (shim_dir / "curl").chmod(0o755)
        self.env = {**self.env, "PATH": f"{shim_dir}:{self.env['PATH']}", "WALK_STATE": str(self.tools / "state.sh"),
                    "LORAPLANE_URL": self.ports.control_url()}
        self.count = 0
        self.seconds: dict[str, float] = {}  # per block run, for the test's report

    def run(self, block: Block, timeout_s: float = 180) -> str:
        """Runs `block` (its ports substituted); its output, or an AssertionError naming the page, the
        line and the command that failed, with the block's output."""
        self.count += 1
        body = self.ports.substitute(block.text)
        if block.language == "python":
            program = self.tools / f"block-{self.count}.py"
            program.write_text(body)
            body = f".venv/bin/python {program}\n"
        script = self.tools / f"block-{self.count}.sh"
        script.write_text(_PROLOGUE + mark_expected(body))
        started = time.monotonic()
        try:
            done = subprocess.run(["bash", str(script)], cwd=self.folder, env=self.env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as e:
            output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            raise AssertionError(f"{block.where()}: still running after {timeout_s} s\n{_tail(output)}") from None
        self.seconds[block.where()] = round(time.monotonic() - started, 1)
        if done.returncode != 0:
            raise AssertionError(self._failure(block, done.returncode, done.stdout))
        return done.stdout

    def _failure(self, block: Block, code: int, output: str) -> str:
        failed = _FAILED.search(output)
        if failed is None or block.language == "python":
            return f"{block.where()} exited {code}\n--- its output ---\n{_tail(_FAILED.sub('', output))}"
        line = block.line + int(failed.group(1)) - _PROLOGUE_LINES
        return (f"{block.where()}: the command at {block.page}:{line} exited {failed.group(2)}:\n"
                f"    {failed.group(3)}\n--- the block's output ---\n{_tail(_FAILED.sub('', output))}")


def _tail(text: str, size: int = 4000) -> str:
    return text if len(text) <= size else "…" + text[-size:]
