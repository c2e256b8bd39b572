"""A worker killed in the middle of a 2-worker run: Ray restarts the group from the last
checkpoint and the run ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.config import load_config
from services import training

pytestmark = pytest.mark.ray

EPOCHS = 6


def _cfg(tmp_path, uri, name, *extra):
    return load_config("digits", [
        f"train.epochs={EPOCHS}", "scaling.num_workers=2", "scaling.max_failures=2",
        "data.image_size=24", f"tracking.tracking_uri={uri}", f"tracking.storage_path={tmp_path / 'runs'}",
        f"tracking.run_name={name}", *extra,
    ])


def _train_worker_pids() -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return [a.pid for a in actors]


def test_killed_worker_restarts_from_checkpoint_and_matches_uninterrupted_run(ray_cluster, tmp_path, local_mlflow):
    reference = training.train(_cfg(tmp_path, local_mlflow, "uninterrupted"), log_model=False)

    cfg = _cfg(tmp_path, local_mlflow, "killed")
    run_dir = tmp_path / "runs" / "killed"
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=training.train(cfg, log_model=False)))
    thread.start()
    deadline = time.monotonic() + 300
    # Ray Train writes this file once a reported checkpoint is registered: epoch 1 is safe,
    # epoch 2 is running.
    while not (run_dir / "checkpoint_manager_snapshot.json").exists():
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    pids = _train_worker_pids()
    assert len(pids) == 2
    os.kill(max(pids), signal.SIGKILL)
    thread.join(timeout=600)
    result = outcome["result"]

    assert result.metrics["epoch"] == EPOCHS
    for key in ("loss", "recall_at_1", "map_at_r", "r_precision"):
        # Data order is seeded and the optimiser state restored exactly; what differs is DDP
        # re-bucketing gradients after the first step of every (re)start, which changes the
        # float summation order: last-bit noise, measured at ~1e-5 on these metrics.
        assert result.metrics[key] == pytest.approx(reference.metrics[key], abs=1e-4), key
    client = MlflowClient(local_mlflow)
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(result.mlflow_run_id, "map_at_r")]
    assert steps == list(range(1, EPOCHS + 1))  # complete and duplicate-free across the restart
    state = json.loads((Path(result.checkpoint_path) / "trainer_state.json").read_text())
    assert state["resumes"] == 1 and state["world_size"] == 2  # exactly one restart, from a checkpoint
