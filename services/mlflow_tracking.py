"""MLflow adapter: the driver opens (or re-opens) one run per training run; rank 0 logs to it.

A run is found again by its ``ray_run_name`` tag, so starting the same training run twice
(a resume) appends to the same MLflow run instead of creating a second one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from pipelines.config import Config

# MLflow caps a param value at 6000 characters and a batch at 100 params.
_PARAM_BATCH = 100


def local_store(root: Path | None = None) -> tuple[str, str]:
    """(tracking URI, artifact root) of the embedded default: sqlite + files under ./mlruns."""
    root = (root or Path.cwd() / "mlruns").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


def tracking_uri(cfg: Config) -> str:
    """Configured URI, else $MLFLOW_TRACKING_URI, else the local sqlite store."""
    return cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store()[0]


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def ensure_experiment(client: MlflowClient, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if uri.startswith("sqlite:///"):  # embedded store: keep artifacts next to the database
        artifact_location = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except mlflow.exceptions.MlflowException:  # created concurrently by another driver
        exp = client.get_experiment_by_name(name)
        assert exp is not None
        return exp.experiment_id


def run_tags(cfg: Config) -> dict[str, str]:
    return {
        "loss": cfg.loss.name + ("+ps" if cfg.synthesis.enabled else ""),
        "dataset": cfg.data.name,
        "git_sha": git_sha(),
        "world_size": str(cfg.scaling.num_workers),
        "ray_run_name": cfg.run_name(),
    }


def open_run(cfg: Config, uri: str | None = None) -> tuple[str, bool]:
    """Find the run tagged with this run name or create it. Returns (run_id, resumed)."""
    uri = uri or tracking_uri(cfg)
    client = MlflowClient(uri)
    exp_id = ensure_experiment(client, cfg.experiment_name(), uri)
    found = client.search_runs(
        [exp_id], filter_string=f"tags.ray_run_name = '{cfg.run_name()}'", max_results=1
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "world_size", str(cfg.scaling.num_workers))
        return run_id, True
    run = client.create_run(exp_id, run_name=cfg.run_name(), tags=run_tags(cfg))
    params = [Param(k, _param_value(v)) for k, v in cfg.flat().items()]
    for i in range(0, len(params), _PARAM_BATCH):
        client.log_batch(run.info.run_id, params=params[i : i + _PARAM_BATCH])
    return run.info.run_id, False


def _param_value(value: Any) -> str:
    return "" if value is None else str(value)


def end_run(run_id: str, uri: str, status: str) -> None:
    MlflowClient(uri).set_terminated(run_id, status=status)


class MlflowTracker:
    """The pipeline's Tracker protocol on top of an existing MLflow run."""

    def __init__(self, run_id: str, uri: str) -> None:
        self.run_id = run_id
        self.client = MlflowClient(uri)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
