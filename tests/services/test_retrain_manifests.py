"""Scheduled-retraining manifests parse and hold valid ``proxydml retrain`` command lines.

Nothing is started: the KubeRay RayCronJob, the plain CronJob (``ray job submit``), the cron.d
file and the systemd service + timer are parsed, their schedules checked, and every retrain
command line goes through the real CLI parser and the real config loader (overrides).
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.config import load_config
from services.cli import build_parser
from services.retrain import EXIT_LOCKED

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
PYPROJECT = (ROOT / "pyproject.toml").read_text()
RAY_VERSION = re.search(r'"ray\[[^\]]*\]==([\d.]+)"', PYPROJECT).group(1)
IMAGE = "proxydml:" + re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)
_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$")
_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


def check_cron_schedule(schedule: str) -> None:
    """Five standard cron fields with numbers in range (no @-macros, no names)."""
    fields = schedule.split()
    assert len(fields) == 5, schedule
    for text, (low, high) in zip(fields, _RANGES):
        assert _FIELD.match(text), (schedule, text)
        for number in re.findall(r"\d+", re.sub(r"/\d+", "", text)):
            assert low <= int(number) <= high, (schedule, text)


def check_retrain_command(argv: list[str]) -> None:
    """``proxydml retrain ...``: accepted by the CLI parser; overrides valid config keys."""
    i = argv.index("proxydml") if "proxydml" in argv else next(
        n for n, a in enumerate(argv) if a.endswith("/proxydml"))
    args = build_parser().parse_args(argv[i + 1:])
    assert args.command == "retrain"
    assert args.model and args.data
    assert args.from_champion or args.config or args.from_sweep, "say where the config comes from"
    assert 0 <= args.margin < 0.5
    load_config(None, args.overrides)  # raises on an unknown key or a bad value
    storage = [o for o in args.overrides if o.startswith("tracking.storage_path=")]
    assert storage and storage[0].split("=", 1)[1].startswith("/"), "crash-resume needs a fixed storage path"


def _no_inline_secret(env: list[dict]) -> None:
    for item in env:
        if item["name"] in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
            assert "valueFrom" in item and "value" not in item, item


def _check_cluster(spec: dict) -> None:
    assert spec["rayVersion"] == RAY_VERSION
    head = spec["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    assert container["image"] == IMAGE
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http://")
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]["value"] == "1"
    _no_inline_secret(container["env"])
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for c in group["template"]["spec"]["containers"]:
            assert c["image"] == IMAGE
            _no_inline_secret(c["env"])
    for template in [head["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == ["proxydml-runs"]  # checkpoints (resume) visible from every node


def test_raycronjob_manifest():
    doc = yaml.safe_load((INFRA / "k8s" / "raycronjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCronJob"
    assert doc["metadata"]["name"]
    spec = doc["spec"]
    check_cron_schedule(spec["schedule"])
    assert spec.get("suspend") is False
    job = spec["jobTemplate"]  # a RayJob spec, as KubeRay's RayCronJobSpec.JobTemplate
    argv = shlex.split(job["entrypoint"])
    assert argv[:2] == ["proxydml", "retrain"]
    check_retrain_command(argv)
    assert job["shutdownAfterJobFinishes"] is True and job["backoffLimit"] == 0
    assert job["submissionMode"] == "K8sJobMode"
    assert yaml.safe_load(job["runtimeEnvYAML"])["env_vars"]["PROXYDML_CACHE"].startswith("/var/lib/proxydml")
    _check_cluster(job["rayClusterSpec"])


def test_cronjob_manifest_calls_ray_job_submit():
    doc = yaml.safe_load((INFRA / "k8s" / "cronjob.yaml").read_text())
    assert doc["apiVersion"] == "batch/v1" and doc["kind"] == "CronJob"
    spec = doc["spec"]
    check_cron_schedule(spec["schedule"])
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    cmd = [str(c) for c in container["command"]]
    assert cmd[:3] == ["ray", "job", "submit"]
    address = cmd[cmd.index("--address") + 1]
    assert re.fullmatch(r"http://proxydml-head-svc\.[a-z0-9.-]+:8265", address), address
    runtime_env = yaml.safe_load(cmd[cmd.index("--runtime-env-json") + 1])
    assert runtime_env["env_vars"]["PROXYDML_CACHE"]
    sep = cmd.index("--")
    assert cmd[sep + 1:sep + 3] == ["proxydml", "retrain"]
    check_retrain_command(cmd[sep + 1:])
    assert "env" not in container or all("AWS_SECRET" not in e["name"] for e in container["env"])


def test_cron_file():
    lines = [ln for ln in (INFRA / "cron" / "proxydml-retrain.cron").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    env = dict(ln.split("=", 1) for ln in lines if re.match(r"^[A-Z_]+=", ln))
    assert env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert ".venv/bin" in env["PATH"]
    jobs = [ln for ln in lines if not re.match(r"^[A-Z_]+=", ln)]
    assert len(jobs) == 1
    fields = jobs[0].split(None, 6)
    check_cron_schedule(" ".join(fields[:5]))
    assert fields[5] == "proxydml"  # cron.d lines name the user
    command = fields[6].split("&&", 1)[1].split(">>", 1)[0]
    check_retrain_command(shlex.split(command))


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((INFRA / "systemd" / name).read_text())
    return parser


def test_systemd_service_and_timer():
    service = _unit("proxydml-retrain.service")
    assert service["Service"]["Type"] == "oneshot"
    argv = shlex.split(service["Service"]["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/proxydml")
    check_retrain_command(argv)
    assert str(EXIT_LOCKED) in service["Service"]["SuccessExitStatus"].split()
    timer = _unit("proxydml-retrain.timer")
    assert timer["Timer"]["Unit"] == "proxydml-retrain.service"
    assert timer["Timer"]["Persistent"] == "true"
    assert timer["Install"]["WantedBy"] == "timers.target"
    calendar = timer["Timer"]["OnCalendar"]
    # "[weekday] Y-M-D HH:MM[:SS]" with * wildcards: the form systemd.time(7) documents.
    assert re.fullmatch(r"(\w{3}(\.\.\w{3})? )?[\d*]+-[\d*]+-[\d*]+ \d{2}:\d{2}(:\d{2})?", calendar), calendar
    if shutil.which("systemd-analyze"):  # the real parser too, where systemd is installed
        check = subprocess.run(["systemd-analyze", "calendar", calendar], capture_output=True, text=True,
                               timeout=30)
        assert check.returncode == 0, check.stderr


def test_schedule_checker_rejects_nonsense():
    for bad in ("* * * *", "61 * * * *", "@daily", "15 3 * * mon"):
        with pytest.raises(AssertionError):
            check_cron_schedule(bad)
