"""infra/: the compose file and the KubeRay manifests parse and hold what the stack needs.

Nothing here starts a container; it checks structure, the addresses each server binds, that
no secret is written down, and that the training entrypoints are valid ``proxydml train``
command lines (their overrides are resolved by the real config loader).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
# Regexes, not tomllib: the project supports Python 3.10.
PYPROJECT = (ROOT / "pyproject.toml").read_text()
RAY_VERSION = re.search(r'"ray\[[^\]]*\]==([\d.]+)"', PYPROJECT).group(1)
TORCH_VERSION = re.search(r'"torch==([\d.]+)"', PYPROJECT).group(1)
IMAGE = "proxydml:" + re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)
SECRET_KEYS = ("AWS_SECRET_ACCESS_KEY", "MINIO_ROOT_PASSWORD", "POSTGRES_PASSWORD", "AWS_ACCESS_KEY_ID",
               "MINIO_ROOT_USER")


def _load(rel: str) -> dict:
    return yaml.safe_load((INFRA / rel).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker/compose.yaml")


def _cmd(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _flag(cmd: list[str], name: str) -> str | None:
    """Value of ``--name V`` or ``--name=V``."""
    for i, tok in enumerate(cmd):
        if tok == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    return None


def _check_train_command(argv: list[str]) -> None:
    """``proxydml train [--config R] key=value...`` whose overrides the config loader accepts."""
    from pipelines.config import load_config

    i = argv.index("proxydml")
    assert argv[i + 1] == "train", argv
    rest = argv[i + 2:]
    recipe = _flag(rest, "--config")
    overrides = [a for a in rest if "=" in a and not a.startswith("--")]
    recipe = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", recipe) if recipe else None  # compose default
    load_config(recipe, overrides)


# ---------------------------------------------------------------- compose ---------------------


def test_compose_has_the_stack_services(compose):
    services = compose["services"]
    assert {"minio", "postgres", "mlflow", "ray-head", "trainer"} <= set(services)
    for name, svc in services.items():
        assert svc.get("image"), f"{name} has no image"
    for name in ("mlflow", "ray-head", "trainer"):
        assert services[name]["image"] == IMAGE
        assert services[name]["build"]["dockerfile"] == "infra/docker/Dockerfile"
    assert (INFRA / "docker" / "Dockerfile").is_file()


def test_compose_mlflow_serves_s3_artifacts_on_the_container_network(compose):
    mlflow = compose["services"]["mlflow"]
    cmd = _cmd(mlflow)
    assert cmd[:2] == ["mlflow", "server"]
    # 0.0.0.0 *inside its container*: ray-head and trainer reach it as http://mlflow:5000
    # (127.0.0.1 there would be the container's own loopback). The host sees it only on
    # 127.0.0.1 through the port mapping checked below.
    assert _flag(cmd, "--host") == "0.0.0.0"
    assert _flag(cmd, "--port") == "5000"
    assert _flag(cmd, "--workers") == "1"
    assert _flag(cmd, "--artifacts-destination").startswith("s3://")
    assert "mlflow:5000" in _flag(cmd, "--allowed-hosts").split(",")
    env = mlflow["environment"]
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql")
    assert "@postgres:5432/" in env["MLFLOW_BACKEND_STORE_URI"]
    deps = mlflow["depends_on"]
    assert deps["postgres"]["condition"] == "service_healthy"
    assert deps["minio-init"]["condition"] == "service_completed_successfully"
    # Clients get only the tracking URI, never S3 keys.
    ray_env = compose["services"]["ray-head"]["environment"]
    assert ray_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert not any(k.startswith("AWS_") for k in ray_env)


def test_compose_publishes_only_on_loopback_and_writes_no_secret(compose):
    published = [p for svc in compose["services"].values() for p in svc.get("ports", [])]
    assert published, "the host needs at least MLflow and MinIO"
    # MLflow's bind address is the operator's choice (it asks for a login); it defaults to loopback.
    published = [re.sub(r"^\$\{MLFLOW_BIND_ADDRESS:-([^}]*)\}", r"\1", str(p)) for p in published]
    assert all(str(p).startswith("127.0.0.1:") for p in published), published
    assert "ports" not in compose["services"]["postgres"]
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for key in SECRET_KEYS:
            if key in env:
                assert str(env[key]).startswith("${"), f"{name}.{key} is written down"
        uri = env.get("MLFLOW_BACKEND_STORE_URI", "")
        assert not uri or ":${POSTGRES_PASSWORD" in uri


def test_compose_ray_head_and_trainer(compose):
    head = compose["services"]["ray-head"]
    cmd = _cmd(head)
    assert cmd[:3] == ["ray", "start", "--head"] and "--block" in cmd
    assert _flag(cmd, "--dashboard-host") == "0.0.0.0"
    assert head["environment"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    trainer = compose["services"]["trainer"]
    tcmd = _cmd(trainer)
    assert tcmd[:3] == ["ray", "job", "submit"]
    assert _flag(tcmd, "--address") == "http://ray-head:8265"
    _check_train_command(tcmd)
    assert trainer["depends_on"]["ray-head"]["condition"] == "service_healthy"


# ---------------------------------------------------------------- KubeRay ---------------------


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _check_ray_cluster_spec(spec: dict) -> None:
    assert spec["rayVersion"] == RAY_VERSION
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (container,) = _containers(head["template"])
    assert container["image"] == IMAGE
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http://")
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]["value"] == "1"
    assert "valueFrom" in env["AWS_SECRET_ACCESS_KEY"]  # from a Secret, never inline
    groups = spec["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert group["groupName"] and "rayStartParams" in group
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for c in _containers(group["template"]):
            assert c["image"] == IMAGE
            assert c["resources"]["requests"]["cpu"]
    # Ray Train checkpoints must be visible to every node: one shared volume everywhere.
    for template in [head["template"]] + [g["template"] for g in groups]:
        claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == ["proxydml-runs"]


def test_raycluster_manifest():
    doc = _load("k8s/raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == "RayCluster"
    assert doc["metadata"]["name"]
    _check_ray_cluster_spec(doc["spec"])


def test_rayjob_manifest_runs_proxydml_train():
    doc = _load("k8s/rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == "RayJob"
    spec = doc["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["proxydml", "train"]
    _check_train_command(argv)
    assert "tracking.storage_path=/var/lib/proxydml/runs" in argv  # the shared PVC
    assert spec["shutdownAfterJobFinishes"] is True
    assert yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    _check_ray_cluster_spec(spec["rayClusterSpec"])


def test_dockerfile_installs_the_pinned_project():
    text = (INFRA / "docker" / "Dockerfile").read_text()
    assert f"TORCH_VERSION={TORCH_VERSION}" in text
    for folder in ("proxies", "pipelines", "services"):
        assert f"COPY {folder} " in text
    assert "pip install . " in text and "wget" in text  # KubeRay's probes call wget
