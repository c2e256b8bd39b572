"""A worker killed in the middle of a 2-worker Ray Train run: Ray restarts the group from the
last checkpoint and the run ends exactly (to the bit) where an uninterrupted 2-worker run of
the same config ends (the recipe on two plain gloo processes, no Ray), and ``proxydml eval``
on its final checkpoint gives the metrics the run logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from services import training
from tests.distributed import whole_run_workers as workers
from tests.distributed.launch import launch

pytestmark = pytest.mark.ray

EPOCHS = 6


def _train_worker_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    # This session's cluster: without an address the State API picks any Ray on the machine.
    actors = list_actors(address=ray.get_runtime_context().gcs_address,
                         filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return [a.pid for a in actors]


def test_killed_worker_restarts_from_checkpoint_and_matches_uninterrupted_run(ray_cluster, tmp_path, local_mlflow,
                                                                             digits_config):
    cfg = digits_config(local_mlflow, tmp_path / "runs", "scaling.max_failures=2", "data.image_size=24",
                        "tracking.run_name=killed", epochs=EPOCHS)
    # The uninterrupted run: what each Ray Train worker of `cfg` runs, on two forked processes.
    ref_dir = tmp_path / "uninterrupted"
    resolved = training.resolve_for_workers(cfg)
    launch(workers.config_worker, 2, (2, str(tmp_path / "store"), resolved.to_dict(), str(ref_dir)))
    reference = json.loads((ref_dir / f"checkpoint_{EPOCHS:06d}" / "trainer_state.json").read_text())["history"][-1]

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
    for key in ("loss", "recall_at_1", "map_at_r", "r_precision", "precision_at_1"):
        # Exact: the data order and every augmentation seed come from (seed, epoch, position),
        # the optimiser, scheduler and RNG state are restored, BatchNorm is synchronised (one
        # state on both ranks), and with two ranks every all-reduce is a + b = b + a.
        assert result.metrics[key] == reference[key], key
    # `proxydml eval` on the final checkpoint gives the metrics the run logged, to the bit.
    out = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--checkpoint", result.checkpoint_path,
                          "--json"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("recall_at_1", "recall_at_8", "map_at_r", "r_precision", "precision_at_1"):
        assert printed[key] == result.metrics[key], key
    client = MlflowClient(local_mlflow)
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(result.mlflow_run_id, "map_at_r")]
    assert steps == list(range(1, EPOCHS + 1))  # complete and duplicate-free across the restart
    state = json.loads((Path(result.checkpoint_path) / "trainer_state.json").read_text())
    assert state["resumes"] == 1 and state["world_size"] == 2  # exactly one restart, from a checkpoint
