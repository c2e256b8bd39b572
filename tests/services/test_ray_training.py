"""A real 2-worker Ray Train run: per-epoch metrics, checkpoint, MLflow record, resume."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.checkpoint import CHECKPOINT_FILES
from services import training

pytestmark = pytest.mark.ray

METRIC_KEYS = {"recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8", "map_at_r", "r_precision",
               "precision_at_1", "loss"}


def test_two_worker_run_reports_checkpoints_logs_and_resumes(ray_cluster, tmp_path, local_mlflow, digits_config):
    cfg = digits_config(local_mlflow, tmp_path / "runs", epochs=2, steps=6)
    first = training.train(cfg)
    assert not first.resumed
    assert first.metrics["epoch"] == 2
    assert METRIC_KEYS <= set(first.metrics)
    # Digits 5-9 unseen in training: 5 classes, chance R@1 ~ 0.2.
    assert first.metrics["recall_at_1"] > 0.5

    ckpt = Path(first.checkpoint_path)
    assert ckpt.parent == tmp_path / "runs" / cfg.run_name()
    assert {p.name for p in ckpt.iterdir()} >= set(CHECKPOINT_FILES)
    stored = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert stored["loss"]["name"] == "proxy_anchor" and stored["train"]["epochs"] == 2

    client = MlflowClient(local_mlflow)
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["loss.name"] == "proxy_anchor"
    assert run.data.params["scaling.num_workers"] == "2"
    assert set(run.data.params) == set(cfg.flat())
    assert run.data.tags["ray_run_name"] == cfg.run_name()
    assert run.data.tags["world_size"] == "2" and run.data.tags["dataset"] == "digits"
    assert run.data.tags["loss"] == "proxy_anchor" and run.data.tags["git_sha"]
    # cpus_per_worker left automatic: this machine's cores / 2 workers, recorded concrete, and
    # each worker computes with that many torch threads.
    cpus = max(1, (os.cpu_count() or 1) // 2)
    assert run.data.params["scaling.cpus_per_worker"] == str(float(cpus))
    assert stored["scaling"]["cpus_per_worker"] == cpus
    assert run.data.tags["torch_threads"] == str(cpus)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "recall_at_1")] == [1, 2]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"checkpoint", "config.yaml"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")} >= {
        f"checkpoint/{f}" for f in CHECKPOINT_FILES
    }
    # The trained embedder is logged with mlflow.pytorch and loads back as a working model.
    import mlflow.pytorch
    import torch

    from pipelines.data import build_datasets

    mlflow.set_tracking_uri(local_mlflow)
    model = mlflow.pytorch.load_model(f"runs:/{first.mlflow_run_id}/model")
    images = torch.stack([build_datasets(cfg.data).test[i][0] for i in range(3)])
    assert model(images).shape == (3, 64)
    state = yaml.safe_load((ckpt / "trainer_state.json").read_text())
    assert state["mlflow_run_id"] == first.mlflow_run_id

    # System metrics sampled on the rank-0 worker's node while it trained.
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)

    loss_history = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]

    # Same run started again with one more epoch: resumes from epoch 2, same MLflow run.
    second = training.train(digits_config(local_mlflow, tmp_path / "runs", epochs=3, steps=6))
    assert second.resumed and second.mlflow_run_id == first.mlflow_run_id
    assert second.metrics["epoch"] == 3
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history][:2] == loss_history
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    runs = client.search_runs([run.info.experiment_id])
    assert len(runs) == 1
