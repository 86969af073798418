"""The Kubernetes manifests (`deploy/k8s`), rendered by `kubectl kustomize` as `kubectl apply -k`
would: every object valid offline (built-in kinds against kubernetes-validate's schemas,
strict; KEDA's against the minimal schemas vendored in `deploy/k8s/schemas`, since that tool
ships no CRD schemas), and what the runtime needs of them: every stage of the deployed
pipeline scaled on its own input stream's lag, probes on endpoints that exist, a grace
period longer than the drain, settings the runtime knows, non-root read-only containers
with resources and a disruption budget. The kustomizations keep to what both kubectl 1.20's
kustomize (v2.0.3: Debian's `kubernetes-client`, which CI installs) and today's (v5) accept;
with both on PATH, their renders are compared object by object."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from omni_runtime import keys
from omni_runtime.cli import parse_args
from omni_runtime.observe.probes import HEALTH_PATH, READY_PATH
from omni_runtime.pipeline import load_pipeline
from omni_runtime.settings import Settings
from tests.services import unavailable

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes these manifests are for (policy/v1, seccompProfile, ...)."""
SERVE_PATHS = {"/ready", "/health"}
"""What `serve` answers besides the API (omni_runtime/http/app.py; checked below)."""


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        unavailable("no kubectl", "kubectl (its kustomize, to render deploy/k8s)")
    return found


def render(overlay: str, binary: str | None = None) -> list[dict[str, Any]]:
    out = subprocess.run(
        [binary or kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def kubectls_on_path() -> list[str]:
    """Every distinct kubectl binary on PATH (e.g. Debian's 1.20 put first, a recent one after)."""
    found: dict[str, str] = {}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("kubectl", path=folder) if folder else None
        if candidate is not None:
            found.setdefault(os.path.realpath(candidate), candidate)
    return list(found.values())


def canonical(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Objects by (kind, namespace, name), with what differs only in spelling made equal:
    Secret data decoded (one kustomize wraps long base64 lines) and an empty `annotations: {}`
    (kustomize v2.0.3 leaves one on a replaced generated Secret) dropped."""
    out = {}
    for doc in json.loads(json.dumps(docs)):
        meta = doc["metadata"]
        if meta.get("annotations") == {}:
            del meta["annotations"]
        if doc["kind"] == "Secret":
            doc["data"] = {k: base64.b64decode(v).decode() for k, v in doc["data"].items()}
        out[(doc["kind"], meta.get("namespace", ""), meta["name"])] = doc
    return out


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def keda_schema(kind: str) -> dict[str, Any]:
    path = K8S / "schemas" / f"keda.sh_v1alpha1_{kind.lower()}.json"
    return dict(json.loads(path.read_text()))


def config(docs: list[dict[str, Any]]) -> dict[str, str]:
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "omni-config"]
    return dict(cm["data"])


def omni_containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) for every container running omni-runtime."""
    return [
        (dep, c)
        for dep in of_kind(docs, "Deployment")
        for c in dep["spec"]["template"]["spec"]["containers"]
        if c.get("args", [""])[0] == "omni-runtime"
    ]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_offline(overlay: str) -> None:
    for doc in render(overlay):
        if doc["apiVersion"].startswith("keda.sh/"):  # a CRD: our vendored minimal schema
            jsonschema.validate(doc, keda_schema(doc["kind"]))
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kubectl_on_path_renders_the_same_objects(overlay: str) -> None:
    """kubectl 1.20's kustomize (v2.0.3) and a recent one build the same objects: the tree
    keeps to fields both understand (`bases:`, secretGenerator `env:`, `patchesJson6902` with
    files, no `labels:`), and this holds it there where both binaries are installed."""
    first, *others = kubectls_on_path() or [kubectl()]  # one alone: it renders, nothing to compare
    expected = canonical(render(overlay, first))
    assert expected
    for other in others:
        got = canonical(render(overlay, other))
        assert sorted(got) == sorted(expected), (first, other)
        for key, doc in expected.items():
            assert got[key] == doc, (key, first, other)


def test_the_vendored_keda_schema_refuses_a_bad_trigger() -> None:
    """The schema can fail: a number where KEDA wants a string, an unknown field."""
    so = next(d for d in render(OVERLAYS[0]) if d["kind"] == "ScaledObject")
    bad = json.loads(json.dumps(so))
    bad["spec"]["triggers"][0]["metadata"]["lagCount"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, keda_schema("ScaledObject"))
    bad = json.loads(json.dumps(so))
    bad["spec"]["minReplicas"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, keda_schema("ScaledObject"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_stage_scales_on_its_input_streams_lag(overlay: str) -> None:
    docs = render(overlay)
    names = keys.Names(config(docs)["OMNI_NAMESPACE"])
    workers = {}
    pipelines = set()
    for dep, c in omni_containers(docs):
        if c["args"][1] == "worker":
            workers[int(flag(c["args"], "--stage"))] = dep["metadata"]["name"]
        pipelines.add(flag(c["args"], "--pipeline"))
    (pipeline_path,) = pipelines  # every process runs the same pipeline file
    pipeline = load_pipeline(ROOT / pipeline_path)
    assert sorted(workers) == list(range(pipeline.last_stage + 1))
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in of_kind(docs, "ScaledObject")}
    for stage, deployment in workers.items():
        triggers = scaled[deployment]["spec"]["triggers"]
        (lag,) = [t for t in triggers if t["type"] == "redis-streams"]
        meta = lag["metadata"]
        assert meta["stream"] == names.stage_in(stage), (deployment, meta)
        assert meta["consumerGroup"] == keys.WORKERS_GROUP
        assert int(meta["lagCount"]) > 0 and "pendingEntriesCount" not in meta
        assert lag["authenticationRef"]["name"] in {
            t["metadata"]["name"] for t in of_kind(docs, "TriggerAuthentication")
        }
    serve = [dep["metadata"]["name"] for dep, c in omni_containers(docs) if c["args"][1] == "serve"]
    assert serve and all(name in scaled for name in serve)


def serve_routes() -> set[str]:
    """The paths `serve`'s app answers (built on fakeredis: only its routes are read)."""
    from omni_runtime.http.app import create_app
    from omni_runtime.http.gateway import Gateway
    from omni_runtime.http.settings import ServeSettings
    from tests.integration.http_support import fake_redis_clients

    pipelines = [load_pipeline(ROOT / "workers" / "omni.yaml")]
    gateway = Gateway(pipelines, Settings(redis_url="redis://unused"), fake_redis_clients(),
                      ServeSettings())  # fmt: skip
    return {getattr(r, "path", "") for r in create_app(gateway).routes}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_point_at_real_endpoints(overlay: str) -> None:
    docs = render(overlay)
    metrics_port = int(config(docs)["OMNI_METRICS_PORT"])
    assert serve_routes() >= SERVE_PATHS
    for dep, c in omni_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        role = c["args"][1]
        served = int(flag(c["args"], "--port")) if role == "serve" else metrics_port
        paths = SERVE_PATHS if role == "serve" else {READY_PATH, HEALTH_PATH}
        probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
        assert c.get("readinessProbe") and c.get("livenessProbe"), dep["metadata"]["name"]
        for probe in probes:
            get = probe["httpGet"]
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert port == served and get["path"] in paths, (dep["metadata"]["name"], get)
        assert c["readinessProbe"]["httpGet"]["path"] in {READY_PATH, "/ready"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_exceeds_the_drain_and_settings_are_real(overlay: str) -> None:
    docs = render(overlay)
    env = config(docs)
    settings = Settings.model_validate(  # an unknown OMNI_* name is an error here
        {k.removeprefix("OMNI_").lower(): v for k, v in env.items()}
    )
    for dep, c in omni_containers(docs):
        spec = dep["spec"]["template"]["spec"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > settings.drain_s + pause, (dep["metadata"]["name"], grace)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_are_locked_down_sized_and_budgeted(overlay: str) -> None:
    docs = render(overlay)
    budgets = [
        pdb["spec"]["selector"]["matchLabels"] for pdb in of_kind(docs, "PodDisruptionBudget")
    ]
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for c in pod["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(c["resources"]["requests"])
            assert {"cpu", "memory"} <= set(c["resources"]["limits"])
        if dep["metadata"]["name"] == "omni-redis":
            continue  # one pod, Recreate: nothing to budget
        labels = pod["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in sel.items()) for sel in budgets), dep


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrators_and_workers_are_named_after_their_pod(overlay: str) -> None:
    """A container started again in place bears its pod's name, so a worker reads its own
    backlog and an orchestrator gives its previous life's slots up (`docs/deploy.md`); the
    command line, its `$(POD_NAME)` expanded as Kubernetes does, parses."""
    roles = set()
    for dep, c in omni_containers(render(overlay)):
        role = c["args"][1]
        if role == "serve":
            continue
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", dep
        pod = f"{dep['metadata']['name']}-7c9d5b8f6d-x2x4q"
        args = [a.replace("$(POD_NAME)", pod) for a in c["args"][1:]]
        parsed = parse_args(args)
        if role == "worker":
            assert parsed.worker_id == pod and parsed.replaces is None
        else:
            assert parsed.orchestrator_id == parsed.replaces == pod
        roles.add(role)
    assert roles == {"orchestrator", "worker"}
