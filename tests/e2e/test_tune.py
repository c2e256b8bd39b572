"""Ray Tune sweeps end to end: ASHA + Optuna over 2-worker trials, nested in MLflow, resumable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.config import ConfigError, from_dict, load_config
from pipelines.tracking import LocalReporter
from pipelines.train import run as train_locally
from services import sweep

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _base(uri: str, storage: Path, *extra: str):
    return load_config("digits", [
        "train.epochs=2", "train.max_steps_per_epoch=3", "scaling.num_workers=2",
        f"tracking.tracking_uri={uri}", f"tracking.storage_path={storage}", *extra,
    ])


def _children(client: MlflowClient, parent_id: str):
    exp = client.get_run(parent_id).info.experiment_id
    return client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")


def test_asha_optuna_sweep_nests_in_mlflow_and_its_best_config_trains(ray_cluster, tmp_path, local_mlflow):
    base = _base(local_mlflow, tmp_path / "runs")
    out = sweep.run_sweep(base, "digits_quick", samples=4, scheduler="asha", search="optuna", max_concurrent=2)
    assert len(out.trials) == 4 and not out.resumed

    client = MlflowClient(local_mlflow)
    parent = client.get_run(out.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep_name"] == out.name
    assert parent.data.params["space.optim.lr"] == "loguniform[0.0003, 0.003]"
    sweep_artifacts = {a.path for a in client.list_artifacts(out.parent_run_id, "sweep")}
    assert {"sweep/best_config.yaml", "sweep/parallel_coordinates.png", "sweep/parameter_scatter.png",
            "sweep/digits_quick.yaml"} <= sweep_artifacts

    children = _children(client, out.parent_run_id)
    assert len(children) == 4
    trial_ids = {t["trial_id"] for t in out.trials}
    for child in children:
        assert child.data.tags["trial_id"] in trial_ids
        assert child.info.run_name == f"{out.name}-{child.data.tags['trial_id']}"
        assert 3e-4 <= float(child.data.params["optim.lr"]) <= 3e-3
        assert 8.0 <= float(child.data.params["loss.alpha"]) <= 48.0
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "map_at_r")]
        assert steps[0] == 1 and steps == sorted(set(steps))
        assert child.info.status in ("FINISHED", "KILLED")

    best_yaml = sweep.best_config(out.name, local_mlflow)
    best = from_dict(yaml.safe_load(best_yaml))
    winner = max(out.trials, key=lambda t: t["metric"])
    assert best.optim.lr == pytest.approx(winner["params"]["optim.lr"])
    metrics = train_locally(
        load_config(None, [f"{k}={v}" for k, v in best.flat().items()
                           if v is not None and not isinstance(v, list) and not k.startswith("tracking.")]
                    + ["scaling.num_workers=1", "train.epochs=1"]),
        LocalReporter(tmp_path / "best"),
    )
    assert metrics["recall_at_1"] > 0.5


def test_space_errors_come_before_any_trial(tmp_path):
    base = _base("sqlite:///unused.db", tmp_path)
    bad = tmp_path / "bad.yaml"
    cases = [
        ({"loss.temprature": {"uniform": [0.1, 0.2]}}, "'loss.temprature' is not a config field"),
        ({"loss.temperature": {"uniform": [-0.1, 0.2]}}, "loss.temperature=-0.1 is outside the valid domain"),
        ({"loss.V": {"uniform": [0.5, 50]}}, "loss.V=0.5 is outside the valid domain"),
        ({"loss.alpha": {"loguniform": [0.0, 1.0]}}, "loguniform needs low > 0"),
        ({"optim.lr": {"normal": [0.1, 0.2]}}, "unknown domain 'normal'"),
    ]
    for space, message in cases:
        bad.write_text(yaml.safe_dump(space))
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            sweep.load_sweep(base.__class__() if "V" in str(space) else base, bad, samples=2,
                             scheduler="asha", search="optuna", max_concurrent=None, cluster_cpus=4)
    with pytest.raises(ConfigError, match="the cluster holds 2 trial"):
        sweep.load_sweep(base, "digits_quick", samples=4, scheduler="asha", search="optuna",
                         max_concurrent=3, cluster_cpus=4)
    with pytest.raises(ConfigError, match="Optuna samples"):
        bad.write_text(yaml.safe_dump({"optim.lr": {"grid": [0.001, 0.01]}}))
        sweep.load_sweep(base, bad, samples=2, scheduler="asha", search="optuna", max_concurrent=None,
                         cluster_cpus=4)
    ok = dict(samples=2, scheduler="asha", search="random", max_concurrent=None, cluster_cpus=4)
    with pytest.raises(ConfigError, match="train.eval_every must be 1 in a sweep"):
        sweep.load_sweep(from_dict({**base.to_dict(), "train": {**base.to_dict()["train"], "eval_every": 2}}),
                         "digits_quick", **ok)
    with pytest.raises(ConfigError, match="ASHA grace period must be in"):
        sweep.load_sweep(base, "digits_quick", grace_period=base.train.epochs + 1, **ok)
    with pytest.raises(ConfigError, match="reduction factor must be >= 2"):
        sweep.load_sweep(base, "digits_quick", reduction_factor=1, **ok)
    with pytest.raises(ConfigError, match="preset point 0: loss.nope not in the search space"):
        sweep.load_sweep(base, "digits_quick", points=[{"loss.nope": 1.0}], **ok)
    with pytest.raises(ConfigError, match="3 preset points but only 2 trial"):
        sweep.load_sweep(base, "digits_quick", points=[{}, {}, {}], **ok)


def test_cli_passes_asha_settings_and_rejects_bad_ones_before_any_trial(capsys, tmp_path):
    from services import cli

    runs = tmp_path / "runs"
    argv = ["tune", "--space", "digits_quick", "--samples", "2", f"tracking.storage_path={runs}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    assert cli.main([*argv, "--grace", "99"]) == 2
    assert "ASHA grace period must be in [1, train.epochs=" in capsys.readouterr().err
    assert cli.main([*argv, "--reduction-factor", "1"]) == 2
    assert "ASHA reduction factor must be >= 2, got 1" in capsys.readouterr().err
    assert not runs.exists() and not (tmp_path / "mlflow.db").exists()  # nothing half-written


@pytest.mark.parametrize("space", sorted(p.name for p in sweep.SEARCH_DIR.glob("*.yaml")))
def test_shipped_spaces_validate(space):
    recipe = {"proxy_isa.yaml": "proxy_isa_cub", "proxy_nca_pp.yaml": "proxy_nca_pp_cub",
              "proxy_synthesis.yaml": "proxy_synthesis_cub",
              "emoji_proxy_anchor.yaml": "emoji_proxy_anchor"}.get(space, "digits")
    base = load_config(recipe)
    spec = sweep.load_sweep(base, space, samples=4, scheduler="asha", search="optuna", max_concurrent=None,
                            cluster_cpus=64)
    assert spec.space and spec.name().startswith("sweep-")


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_cluster, tmp_path, local_mlflow):
    import ray

    args = [sys.executable, "-m", "services.cli", "tune", "--space", "digits_quick", "--samples", "3",
            "--max-concurrent", "1", "--scheduler", "none", "--address", ray.get_runtime_context().gcs_address,
            "train.epochs=1", "train.max_steps_per_epoch=3", f"tracking.tracking_uri={local_mlflow}",
            f"tracking.storage_path={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = MlflowClient(local_mlflow)

    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    parent_id = None
    # One trial at a time: a second child run exists only once the first trial has finished.
    while True:
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()[-3000:]
        parents = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                     filter_string="tags.kind = 'sweep'")
        if parents:
            parent_id = parents[0].info.run_id
            if len(_children(client, parent_id)) >= 2:
                break
        time.sleep(1)
    first.send_signal(signal.SIGINT)  # Ctrl-C
    first.wait(timeout=120)
    done_before = {c.data.tags["trial_id"]: client.get_metric_history(c.info.run_id, "map_at_r")
                   for c in _children(client, parent_id)}

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(resumed)" in second.stdout

    children = _children(client, parent_id)
    trial_ids = [c.data.tags["trial_id"] for c in children]
    assert len(children) == 3 and len(set(trial_ids)) == 3
    finished_first = [t for t, hist in done_before.items() if hist]
    assert finished_first
    for child in children:
        history = client.get_metric_history(child.info.run_id, "map_at_r")
        assert [m.step for m in history] == [1], (child.data.tags["trial_id"], history)
        if child.data.tags["trial_id"] in finished_first:  # not run again: same record
            assert [m.timestamp for m in history] == [m.timestamp for m in done_before[child.data.tags["trial_id"]]]
