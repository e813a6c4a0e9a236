"""deploy/*.Dockerfile, checked without Docker (base images cannot be pulled here): each says how to build
it, every path a COPY names is in the build context (the repository root less .dockerignore), the control
plane installs the base package only and the engine the engine extra, at the torch version pyproject.toml
pins; the context leaves out the virtualenv, the tests and the caches."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests.deploy.context import IgnoreRules, context_files

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"control-plane": REPO_ROOT / "deploy" / "control-plane.Dockerfile",
               "engine": REPO_ROOT / "deploy" / "engine.Dockerfile"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, `\\` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for keyword, args in instructions(dockerfile):
        if keyword in ("COPY", "ADD"):
            words = shlex.split(args)
            if any(w.startswith("--from") for w in words):
                continue  # from another stage, not from the context
            sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


def pip_installs(dockerfile: Path) -> list[str]:
    return [cmd.strip() for keyword, args in instructions(dockerfile) if keyword == "RUN"
            for cmd in re.split(r"&&|;", args) if "pip install" in cmd]


@pytest.fixture(scope="module")
def context() -> set[str]:
    return {f.as_posix() for f in context_files(REPO_ROOT)}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_header_says_how_to_build_it(name: str) -> None:
    header = DOCKERFILES[name].read_text().split("FROM", 1)[0]
    # run from the repository root, which is the context (the trailing `.`)
    assert re.search(rf"^#\s+docker build -f deploy/{name}\.Dockerfile .*\s\.$", header, re.MULTILINE), header
    assert all(line.startswith("#") or not line.strip() for line in header.splitlines())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_is_in_the_build_context(name: str, context: set[str]) -> None:
    sources = copy_sources(DOCKERFILES[name])
    assert {"pyproject.toml", "README.md", "shared/", "control_plane/", "migrations/"} <= set(sources), sources
    for source in sources:
        path = source.rstrip("/")
        assert (REPO_ROOT / path).exists(), f"{name}: COPY {source}: not in the repository"
        in_context = path in context or any(f.startswith(path + "/") for f in context)
        assert in_context, f"{name}: COPY {source}: excluded by .dockerignore"


def test_the_control_plane_installs_the_base_package_and_the_engine_the_engine_extra() -> None:
    control, engine = (pip_installs(DOCKERFILES[n]) for n in ("control-plane", "engine"))
    assert control and not any("[engine" in cmd or "torch" in cmd for cmd in control), control
    assert any(shlex.split(cmd)[-1] == "." for cmd in control), control  # the package itself, no extra
    assert any('".[engine]"' in cmd or "'.[engine]'" in cmd for cmd in engine), engine
    assert "FROM python:3.11-slim" in DOCKERFILES["control-plane"].read_text()


def test_the_engine_image_installs_the_torch_version_pyproject_pins() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [req for req in extras["engine"] if req.startswith("torch")]
    assert re.fullmatch(r"torch==[\d.]+", pin), f"torch is pinned exactly, got {pin!r}"
    args = dict(a.split("=", 1) for k, a in instructions(DOCKERFILES["engine"]) if k == "ARG" and "=" in a)
    assert f"torch=={args['TORCH_VERSION']}" == pin
    assert args["TORCH_INDEX_URL"].endswith("/cpu")  # the CPU build unless told otherwise
    assert any("--index-url" in cmd and "TORCH_INDEX_URL" in cmd for cmd in pip_installs(DOCKERFILES["engine"]))
    # the base install has no torch at all
    assert not any(req.startswith("torch") for req in
                   tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_dockerignore_keeps_the_context_small(context: set[str]) -> None:
    rules = IgnoreRules.read(REPO_ROOT / ".dockerignore")
    for path in (".venv/bin/python", ".venv", ".git/HEAD", "tests/conftest.py", "bench/x.py", ".demo/model/a",
                 ".loraplane/control.db", "control_plane/__pycache__/app.cpython-311.pyc", "loraplane.egg-info/PKG-INFO"):
        assert rules.excludes(path), path
    for path in ("pyproject.toml", "README.md", "control_plane/app.py", "migrations/versions/0001_initial_schema.py"):
        assert not rules.excludes(path), path
    assert not any(f.startswith((".venv/", "tests/", ".git/")) for f in context)
    size = sum((REPO_ROOT / f).stat().st_size for f in context)
    assert size < 5 * 2**20, f"the build context is {size / 2**20:.1f} MiB"


def test_ignore_rules_follow_dockers_matching(tmp_path: Path) -> None:
    (tmp_path / ".dockerignore").write_text("# comment\n/build\n**/*.log\ndocs/*\n!docs/keep.md\na?c\n")
    rules = IgnoreRules.read(tmp_path / ".dockerignore")
    assert rules.excludes("build") and rules.excludes("build/x/y")  # a directory takes its contents
    assert rules.excludes("x.log") and rules.excludes("deep/er/x.log") and not rules.excludes("x.logs")
    assert rules.excludes("docs/a.md") and not rules.excludes("docs/keep.md")  # the last match decides
    assert not rules.excludes("docs") and not rules.excludes("src/build")  # patterns anchor at the root
    assert rules.excludes("abc") and not rules.excludes("abbc")


def test_the_engine_image_has_a_compiler_for_the_cpu_kernels() -> None:
    """The engine compiles its CPU kernels on first use (data_plane/model/cpu_extension.py): its image
    keeps a C++ compiler, else the engine falls back to the slower torch ops there."""
    runs = [args for keyword, args in instructions(DOCKERFILES["engine"]) if keyword == "RUN"]
    installs = [cmd for args in runs for cmd in re.split(r"&&|;", args) if "apt-get install" in cmd]
    assert any({"g++", "build-essential"} & set(shlex.split(cmd)) for cmd in installs), installs


def test_the_wheel_ships_every_kernel_source(tmp_path: Path, context: set[str]) -> None:
    """A wheel built from the build context (what the image's `pip install .` installs) holds every C++
    source of data_plane, so the installed engine finds the files it compiles."""
    import shutil
    import subprocess
    import sys
    import zipfile

    sources = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "data_plane").rglob("*.cpp")}
    assert sources and sources <= context, sources - context
    for rel in context:  # a clean copy: no build/ folder of an earlier build can lend it the files
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, tmp_path / "src" / rel)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(tmp_path / "src")],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("loraplane-*.whl")
    assert sources <= set(zipfile.ZipFile(wheel).namelist()), sources - set(zipfile.ZipFile(wheel).namelist())
