"""`loraplane tenants …` as an operator runs it (a subprocess, URL and token in the environment) against a
real `loraplane control` process: create a tenant with quotas and sources, create a key (printed once),
list keys (ids only), set limits, update or clear the sources (what the tenant's admin key may then load
over HTTP follows them), move an adapter to the tenant and make it public, revoke the key; a read
token's create is exit code 2 with the server's 403."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from shared.tenants import split_key
from tests.data_plane.api.conftest import REPO_ROOT
from tests.e2e.test_control_plane_engines import ADMIN, READ, control_plane


def test_tenants_commands(tmp_path: Path) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    adapters = write_demo_adapters(base, root)
    with control_plane(tmp_path, root) as url:
        def cli(*argv: str, token: str = ADMIN) -> subprocess.CompletedProcess[str]:
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
                   "LORAPLANE_URL": url, "LORAPLANE_TOKEN": token, "LORAPLANE_CONFIG": str(tmp_path / "none.toml")}
            return subprocess.run([sys.executable, "-m", "shared.cli", "tenants", *argv], capture_output=True,
                                  text=True, env=env, cwd=REPO_ROOT, timeout=60)

        made = cli("create", "team-a", "--display-name", "Team A", "--rpm", "60", "--adapters", "3",
                   "--source", f"{root}/demo-poet/", "--source", "s3://Bucket/team-a/")
        assert made.returncode == 0 and "requests per minute 60" in made.stdout, made.stderr
        assert f"sources: {root}/demo-poet s3://bucket/team-a" in made.stdout
        # no router requires keys here: the quota reaches no client, and the answer and the CLI say so
        assert "loraplane: warning: no router" in made.stderr and "--require-api-key" in made.stderr
        refused = cli("create", "team-b", token=READ)
        assert refused.returncode == 2 and "403" in refused.stderr
        key = cli("create-key", "team-a", "--name", "ci", "--scope", "inference", "--tpm", "1000")
        assert key.returncode == 0, key.stderr
        secret_line = next(line for line in key.stdout.splitlines() if line.startswith("lp_"))
        key_id, secret = split_key(secret_line.strip())
        listed = cli("keys", "team-a")
        assert key_id in listed.stdout and secret not in listed.stdout
        assert cli("set-limits", "team-a", "--tpm", "5000").returncode == 0
        sources_tenant_key_may_load_from(cli, url, root, adapters)
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "demo-poet", "lora_path": str(
            adapters["demo-poet"]), "base_model": "demo"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 200, r.text
        private = cli("move", "demo-poet", "team-a", "--private")
        assert private.returncode == 0 and "owner team-a, private" in private.stdout, private.stderr
        assert "loraplane: warning: no router" in private.stderr and "--require-api-key" in private.stderr
        moved = cli("move", "demo-poet", "team-a", "--public")
        assert moved.returncode == 0 and "owner team-a, public" in moved.stdout, moved.stderr
        assert "warning" not in moved.stderr  # a public adapter needs no router to stay public
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["tenancy"] == {"enforced": False, "routers": []}
        listing = cli("list")
        assert "team-a" in listing.stdout and "tokens per minute 5000" in listing.stdout
        assert "SOURCES" in listing.stdout and "uploads only" in listing.stdout
        assert cli("revoke-key", "team-a", key_id).returncode == 0
        keys = httpx.get(url + "/v1/tenants/team-a/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert [k["revoked_at"] is not None for k in keys["data"] if k["key_id"] == key_id] == [True]
        assert cli("revoke-key", "team-a", "000000000000").returncode == 2


def sources_tenant_key_may_load_from(cli, url: str, root: Path, adapters: dict[str, Path]) -> None:  # noqa: ANN001
    """A tenant admin key loads under its tenant's sources only, as `update` sets them."""
    made = cli("create-key", "team-a", "--name", "ops", "--scope", "admin:team-a")
    key = next(line for line in made.stdout.splitlines() if line.startswith("lp_")).strip()

    def load(name: str, folder: Path) -> httpx.Response:
        return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder),
                          "base_model": "demo"}, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    assert load("a-poet", adapters["demo-poet"]).status_code == 200
    refused = load("a-pirate", adapters["demo-pirate"])
    assert refused.status_code == 403 and "not under any source of tenant 'team-a'" in refused.text
    updated = cli("update", "team-a", "--source", str(root), "--json")
    assert updated.returncode == 0 and json.loads(updated.stdout)["sources"] == [str(root)], updated.stderr
    assert load("a-pirate", adapters["demo-pirate"]).status_code == 200
    cleared = cli("update", "team-a", "--no-sources")
    assert cleared.returncode == 0 and "sources: uploads only" in cleared.stdout, cleared.stderr
    refused = load("a-short", adapters["demo-short"])
    assert refused.status_code == 403 and "has no sources" in refused.text
    assert "loraplane tenants update team-a --source" in refused.json()["error"]["message"]
    bad = cli("update", "team-a", "--source", "relative/folder")
    assert bad.returncode == 2 and "400" in bad.stderr and "absolute folder" in bad.stderr
    assert cli("update", "team-a").returncode == 2  # nothing to change
    assert cli("update", "team-a", "--source", str(root), "--no-sources").returncode == 2
    # the key may not set its tenant's sources itself
    assert cli("update", "team-a", "--source", str(root), token=key).returncode == 2
