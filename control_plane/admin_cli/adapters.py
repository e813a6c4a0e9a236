"""`loraplane adapters list|show|load|upload|unload|activate|update|pin|unpin|delete`.

    export LORAPLANE_URL=http://127.0.0.1:8080 LORAPLANE_TOKEN=…   # an admin token to change things
    loraplane adapters load org/pirate /srv/adapters/pirate --base-model demo
    loraplane adapters list
    loraplane adapters show org/pirate --json
    loraplane adapters update org/pirate --base-model demo   # re-target it to another base model
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from control_plane.admin_cli import render
from control_plane.admin_cli.client import adapter_path
from control_plane.admin_cli.options import Session, connected, run

# the files of a PEFT LoRA folder that an upload sends (control_plane/artifacts/upload.py)
UPLOAD_FILES = ("adapter_config.json", "adapter_model.safetensors")


@click.group(help="The adapter registry: list, show, load, upload, unload, activate, update, pin, unpin, delete.")
def adapters() -> None:
    pass


@adapters.command("list")
@click.option("--base-model", default="", help="only adapters of this base model")
@click.option("--prefix", default="", help="only names starting with this")
@click.option("--label", multiple=True, help="key=value or key; repeat to AND")
@click.option("--owner", default="", help="only adapters this tenant owns; '-': those no tenant owns")
@click.option("--visibility", type=click.Choice(["any", "public", "private"]), default="any", show_default=True,
              help="public: every tenant's keys may use it; private: its owner's only")
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--offset", type=int, default=0, show_default=True)
@connected
def list_(session: Session, base_model: str, prefix: str, label: tuple[str, ...], owner: str, visibility: str,
          limit: int, offset: int) -> int:
    """A page of registered adapters, by name, with their owner tenant."""
    params: dict[str, Any] = {"limit": limit, "offset": offset, "label": list(label), "visibility": visibility}
    if base_model:
        params["base_model"] = base_model
    if prefix:
        params["name_prefix"] = prefix
    if owner:
        params["owner"] = owner
    return session.finish(session.api.get("/v1/lora_adapters", params), _page)


def _page(body: dict[str, Any]) -> None:
    rows = [(a["name"], a["base_model"], render.ownership(a), a["active_version"],
             ",".join(f"{k}={v}" for k, v in sorted(a["labels"].items())), render.when(a["updated_at"]))
            for a in body["data"]]
    render.show(render.table(("NAME", "BASE MODEL", "OWNER", "ACTIVE", "LABELS", "UPDATED"), rows),
                f"{len(rows)} of {body['total']} (offset {body['offset']})")


@adapters.command()
@click.argument("name")
@connected
def show(session: Session, name: str) -> int:
    """One adapter: its versions, replicas and placements on engines."""
    return session.finish(session.api.get(adapter_path(name)), detail)


def detail(body: dict[str, Any]) -> None:
    replicas = body["replicas"]
    facts = render.table(("", ""), [
        ("name", body["name"]), ("base model", body["base_model"]), ("owner", render.ownership(body)),
        ("description", body["description"]),
        ("labels", ",".join(f"{k}={v}" for k, v in sorted(body["labels"].items()))),
        ("active version", body["active_version"]), ("pinned", "yes" if body["pinned"] else "no"),
        ("replicas", f"{replicas['current']} held, target {replicas['target']} "
                     f"(min {replicas['min']}, max {replicas['max']})"),
    ])
    facts.show_header = False
    versions = render.table(
        ("VERSION", "SHA256", "RANK", "ALPHA", "SIZE", "CREATED", "BY", "SOURCE"),
        [(("*" if v["number"] == body["active_version"] else " ") + str(v["number"]), v["sha256"][:12], v["rank"],
          v["alpha"], render.size(v["size_bytes"]), render.when(v["created_at"]), v.get("created_by") or "-",
          v["uri"]) for v in body["versions"]],
        title="versions (* active)")
    placements = render.table(
        ("ENGINE", "VERSION", "DESIRED", "OBSERVED", "RESIDENCY", "ERROR"),
        [(p["engine"], p["version"], p["desired"], p["observed"], p["residency"], p["last_error"])
         for p in body["placements"]], title="placements")
    render.show(facts, versions, placements)
    if body.get("engines") is not None:  # an answer to a change: what each engine did
        render.engines(body)


def _replicas(min_replicas: int | None, max_replicas: str | None) -> dict[str, Any] | None:
    if min_replicas is None and max_replicas is None:
        return None
    high: int | str | None = max_replicas
    if max_replicas is not None and max_replicas != "all":
        if not max_replicas.isdigit():
            raise click.BadParameter("a count or 'all'", param_hint="--max-replicas")
        high = int(max_replicas)
    return {"min": min_replicas, "max": high}


@adapters.command()
@click.argument("name")
@click.argument("path")
@click.option("--base-model", help="needed when adapter_config.json names none")
@click.option("--pinned", is_flag=True, help="keep it in a device slot on its engines, never evicted")
@click.option("--engine", "engines", multiple=True, help="place it exactly on these engines (repeat)")
@click.option("--description")
@click.option("--label", multiple=True, help="key=value; repeat")
@click.option("--min-replicas", type=int)
@click.option("--max-replicas", help="a count or 'all'")
@connected
def load(session: Session, name: str, path: str, base_model: str | None, pinned: bool, engines: tuple[str, ...],
         description: str | None, label: tuple[str, ...], min_replicas: int | None, max_replicas: str | None) -> int:
    """Register the adapter folder PATH (on the control plane's side: under its --lora-roots, or an
    s3:// URL) as NAME's next version, make it active and place it."""
    body: dict[str, Any] = {"lora_name": name, "lora_path": path, "pinned": pinned}
    extra = {"base_model": base_model, "description": description, "replicas": _replicas(min_replicas, max_replicas),
             "engines": list(engines) or None, "labels": _labels(label)}
    body.update({k: v for k, v in extra.items() if v is not None})
    return session.finish(session.api.call("POST", "/v1/load_lora_adapter", json=body), _loaded)


def _labels(pairs: tuple[str, ...]) -> dict[str, str] | None:
    if not pairs:
        return None
    if not all("=" in p for p in pairs):
        raise click.BadParameter("labels are key=value", param_hint="--label")
    return dict(p.split("=", 1) for p in pairs)


def _loaded(body: dict[str, Any]) -> None:
    reused = "" if body["created"] else " (identical files: the existing version)"
    render.show(f"{body['name']} version {body['version']}{reused}: sha256 {body['sha256'][:12]}, rank "
                f"{body['rank']}, {len(body['target_modules'])} target modules")
    render.engines(body)


@adapters.command()
@click.argument("name")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--base-model", help="needed when adapter_config.json names none")
@click.option("--description")
@click.option("--pinned", is_flag=True, help="keep it in a device slot on its engines, never evicted")
@click.option("--no-activate", is_flag=True, help="record the version without making it active")
@connected
def upload(session: Session, name: str, source: Path, base_model: str | None, description: str | None,
           pinned: bool, no_activate: bool) -> int:
    """Send the local SOURCE (a PEFT folder, or a .tar.gz of its two files) as NAME's next version."""
    fields = {"base_model": base_model, "description": description, "pinned": str(pinned).lower(),
              "activate": str(not no_activate).lower()}
    fields = {k: v for k, v in fields.items() if v is not None}
    path = adapter_path(name, "versions")
    if source.is_dir():
        missing = [f for f in UPLOAD_FILES if not (source / f).is_file()]
        if missing:
            raise click.BadParameter(f"{source} lacks {', '.join(missing)}", param_hint="SOURCE")
        with (source / UPLOAD_FILES[0]).open("rb") as config, (source / UPLOAD_FILES[1]).open("rb") as weights:
            files = [("files", (UPLOAD_FILES[0], config, "application/json")),
                     ("files", (UPLOAD_FILES[1], weights, "application/octet-stream"))]
            reply = session.api.call("POST", path, files=files, data=fields)
    else:
        with source.open("rb") as tarball:
            reply = session.api.call("POST", path, content=tarball, params=fields,
                                     headers={"Content-Type": "application/gzip"})
    return session.finish(reply, _loaded)


@adapters.command()
@click.argument("name")
@connected
def unload(session: Session, name: str) -> int:
    """Take NAME off every engine (in-flight requests finish); its versions stay registered."""
    reply = session.api.call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
    return session.finish(reply, render.engines)


@adapters.command()
@click.argument("name")
@click.argument("version", type=click.IntRange(min=1))
@connected
def activate(session: Session, name: str, version: int) -> int:
    """Make VERSION the one NAME serves (roll back or forward); its engines switch in place."""
    reply = session.api.call("POST", adapter_path(name, "activate"), json={"version": version})
    return session.finish(reply, detail)


@adapters.command()
@click.argument("name")
@click.option("--base-model", help="re-target NAME to this base model: engines of the old one unload it, "
              "engines of this one load it (an admin token)")
@click.option("--min-replicas", type=int)
@click.option("--max-replicas", help="a count or 'all'")
@connected
def update(session: Session, name: str, base_model: str | None, min_replicas: int | None,
           max_replicas: str | None) -> int:
    """Change NAME's base model and/or replica counts (what is left out is kept; pin and unpin set the pin)."""
    body = {k: v for k, v in (("base_model", base_model), ("replicas", _replicas(min_replicas, max_replicas)))
            if v is not None}
    if not body:
        raise click.UsageError("nothing to change: give --base-model, --min-replicas or --max-replicas")
    return session.finish(session.api.call("PATCH", adapter_path(name), json=body), detail)


def _pin(session: Session, name: str, pinned: bool) -> int:
    return session.finish(session.api.call("PATCH", adapter_path(name), json={"pinned": pinned}), detail)


@adapters.command()
@click.argument("name")
@connected
def pin(session: Session, name: str) -> int:
    """Keep NAME in a device slot on every engine holding it, never evicted."""
    return _pin(session, name, True)


@adapters.command()
@click.argument("name")
@connected
def unpin(session: Session, name: str) -> int:
    """Let NAME's engines evict it from their device slots again."""
    return _pin(session, name, False)


@adapters.command()
@click.argument("name")
@click.option("--version", type=click.IntRange(min=1), help="delete only this version (neither active nor placed)")
@connected
def delete(session: Session, name: str, version: int | None) -> int:
    """Remove NAME and all its versions (refused while an engine should hold it: unload first)."""
    path = adapter_path(name) if version is None else adapter_path(name, "versions", str(version))
    what = name if version is None else f"{name} version {version}"
    return session.finish(session.api.call("DELETE", path), lambda _: render.show(f"deleted {what}"))


def main(argv: list[str]) -> int:
    return run(adapters, argv, "loraplane adapters")
