"""infra/ runs MLflow with basic authentication by default (compose and Kubernetes), and the
MLflow login of the Ray pods comes from a Secret or the shell, never from a file in the repo.

Nothing is started: the files are parsed, and the command that creates the compose service
account goes through the real CLI parser.
"""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import yaml

from services.cli import build_parser

INFRA = Path(__file__).resolve().parents[2] / "infra"


def _compose() -> dict:
    return yaml.safe_load((INFRA / "docker" / "compose.yaml").read_text())


def _docs(rel: str) -> list[dict]:
    return list(yaml.safe_load_all((INFRA / rel).read_text()))


def _ini(text: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read_string(text)
    return parser["mlflow"]


def test_compose_mlflow_asks_for_a_login_and_binds_loopback_by_default():
    services = _compose()["services"]
    mlflow = services["mlflow"]
    cmd = [str(c) for c in mlflow["command"]]
    assert cmd[cmd.index("--app-name") + 1] == "basic-auth" and "--enable-workspaces" in cmd
    env = mlflow["environment"]
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert str(env[key]).startswith("${") and ":?" in str(env[key]), key  # from the shell, required
    assert mlflow["ports"] == ["${MLFLOW_BIND_ADDRESS:-127.0.0.1}:5000:5000"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in mlflow["volumes"]}
    assert mounted[env["MLFLOW_AUTH_CONFIG_PATH"]] == "./basic_auth.ini"
    ini = _ini((INFRA / "docker" / "basic_auth.ini").read_text())
    assert "admin_password" not in ini and ini["database_uri"].startswith("sqlite:////var/lib/mlflow-auth/")
    assert any(v.startswith("mlflow-auth:/var/lib/mlflow-auth") for v in mlflow["volumes"])
    assert "/var/lib/mlflow-auth" in (INFRA / "docker" / "Dockerfile").read_text()  # owned by the image's user


def test_compose_service_account_reaches_the_jobs_from_the_shell():
    services = _compose()["services"]
    users = services["mlflow-users"]
    (line,) = users["command"]
    # The container's shell expands $$VARS; with the compose defaults:
    line = line.replace("$$PROXYDML_MLFLOW_USER", "proxydml-bot").replace("$$PROXYDML_MLFLOW_ROLE", "trainer")
    argv = shlex.split(line)
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.stack_command, args.password_env) == ("stack", "user", "PROXYDML_MLFLOW_PASSWORD")
    assert args.tracking_uri == "http://mlflow:5000"
    assert str(users["environment"]["PROXYDML_MLFLOW_PASSWORD"]).startswith("${PROXYDML_MLFLOW_PASSWORD:?")
    head = services["ray-head"]
    assert head["depends_on"]["mlflow-users"]["condition"] == "service_completed_successfully"
    assert str(head["environment"]["MLFLOW_TRACKING_PASSWORD"]).startswith("${PROXYDML_MLFLOW_PASSWORD:?")
    for name, svc in services.items():  # no MLflow password written down anywhere
        for key, value in (svc.get("environment") or {}).items():
            if "PASSWORD" in key or "SECRET" in key:
                assert str(value).startswith("${"), f"{name}.{key}"


def _ray_pod_envs(doc: dict) -> list[dict[str, dict]]:
    spec = doc["spec"]
    spec = spec.get("rayClusterSpec", spec) if doc["kind"] != "RayCronJob" else spec["jobTemplate"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [{e["name"]: e for e in c["env"]} for t in templates for c in t["spec"]["containers"]]


def test_ray_pods_read_the_mlflow_login_from_a_secret():
    for rel in ("k8s/raycluster.yaml", "k8s/rayjob.yaml", "k8s/raycronjob.yaml"):
        (doc,) = _docs(rel)
        for env in _ray_pod_envs(doc):
            for key, secret_key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
                ref = env[key]["valueFrom"]["secretKeyRef"]
                assert (ref["name"], ref["key"]) == ("proxydml-mlflow", secret_key) and "value" not in env[key], rel
        runtime_env = doc["spec"].get("runtimeEnvYAML") or doc["spec"].get("jobTemplate", {}).get("runtimeEnvYAML", "")
        assert "MLFLOW_TRACKING" not in runtime_env, rel  # Ray logs runtime_env env_vars


def test_k8s_mlflow_server_asks_for_a_login_and_stays_inside_the_cluster():
    docs = {d["kind"]: d for d in _docs("k8s/mlflow.yaml")}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:2] == ["mlflow", "server"] and cmd[cmd.index("--app-name") + 1] == "basic-auth"
    env = {e["name"]: e for e in container["env"]}
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_BACKEND_STORE_URI",
                "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[key]["valueFrom"] and "value" not in env[key], key
    ini = _ini(docs["ConfigMap"]["data"]["basic_auth.ini"])
    assert "admin_password" not in ini and env["MLFLOW_AUTH_CONFIG_PATH"]["value"] == "/etc/proxydml/basic_auth.ini"
    assert docs["Service"]["spec"]["type"] == "ClusterIP"  # the team reaches it through a TLS Ingress
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
