"""Driver side of one training run: validate, open the MLflow run, fit on Ray, record.

The MLflow run is always closed (FINISHED or FAILED): no run is left RUNNING by an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipelines.config import Config, ConfigError
from pipelines.data import DataError, build_batch_sampler, build_datasets, dataset_labels, with_absolute_root
from pipelines.models import EmbeddingModel
from services.cluster import require_shared_state
from services.snapshots import install_data_resolver

# MLflow and Ray (services.mlflow_tracking, registry, runtime) take 5-6 s to import: they are
# imported in the functions that use them, after `preflight`, so a bad data or model setting
# fails a command in seconds.


@dataclass
class TrainOutcome:
    run_name: str
    mlflow_run_id: str
    tracking_uri: str
    checkpoint_path: str | None
    metrics: dict[str, float]
    resumed: bool
    already_finished: bool = False  # every epoch was trained before: nothing ran this time


def resolve_for_workers(cfg: Config, *, sweep: bool = False) -> Config:
    """The config the workers get, also what MLflow and config.yaml record: ``data.root``
    absolute (see ``with_absolute_root``) and an automatic ``scaling.cpus_per_worker`` made
    concrete from this machine's cores (see ``ScalingConfig.resolved``)."""
    data = with_absolute_root(cfg.data)
    scaling = cfg.scaling.resolved(os.cpu_count() or 1, sweep=sweep)
    if data is cfg.data and scaling is cfg.scaling:
        return cfg
    return dataclasses.replace(cfg, data=data, scaling=scaling)


def preflight(cfg: Config) -> int:
    """Fail on unusable data or model settings before any worker starts or any run is opened.

    Builds the data set, the rank-0 batch sampler and the model once on the driver, so a bad
    ``data.*`` value, ``model.frozen_stages`` beyond the backbone's stages or a ``model.weights``
    file of another architecture is reported here, not from inside a Ray worker. Returns the
    number of training classes.
    """
    install_data_resolver()  # data.root=s3://...: this node's verified cache (downloaded once)
    split = build_datasets(cfg.data)
    if cfg.scaling.max_workers > split.num_classes:
        # Each worker owns a contiguous, non-empty class range of the proxies.
        raise ConfigError(
            f"scaling.num_workers ({cfg.scaling.num_workers}) exceeds the {split.num_classes} training "
            f"classes of data.name={cfg.data.name}: every worker owns the proxies of at least one class"
        )
    try:  # the sampler refuses batches the training classes cannot fill (on any worker count)
        for world in cfg.scaling.worker_counts():
            build_batch_sampler(dataset_labels(split.train), cfg.data, rank=0, world_size=world,
                                seed=cfg.train.seed)
    except ValueError as exc:
        raise DataError(f"data.batch_size/data.samples_per_class: {exc}") from exc
    # A CPU build (under a second even for ResNet-50); the workers build their own copy.
    EmbeddingModel(cfg.model, in_channels=split.train[0][0].shape[0])
    return split.num_classes


def already_trained(cfg: Config, uri: str, *, log_model: bool) -> TrainOutcome | None:
    """The recorded result of ``cfg``'s run when it FINISHED every epoch (and logged its model,
    when ``log_model``), else None. Such a run is not handed to Ray again: its workers would
    only load the last checkpoint and stop, and the run would log its model a second time."""
    from mlflow.tracking import MlflowClient

    from services import mlflow_tracking as mt
    from services import registry

    found = mt.finished_training(cfg, uri)
    if found is None:
        return None
    run, metrics = found
    if log_model and registry.logged_model_of_run(MlflowClient(uri), run.info.run_id)[1] is None:
        return None  # trained without its model logged: the full path logs it
    return TrainOutcome(run_name=cfg.run_name(), mlflow_run_id=run.info.run_id, tracking_uri=uri,
                        checkpoint_path=run.data.tags["ray_checkpoint_path"], metrics=metrics, resumed=True,
                        already_finished=True)


def train(cfg: Config, *, address: str | None = None, log_model: bool = True,
          show_progress: bool = False, log_file: Path | None = None) -> TrainOutcome:
    """Train (or resume) ``cfg`` on Ray; ``show_progress``: rank 0's per-epoch bar on this console;
    ``log_file``: the command's full console log, kept with the run as ``logs/<name>``."""
    cfg = resolve_for_workers(cfg)
    preflight(cfg)
    from services import mlflow_tracking as mt
    from services import runtime

    uri = mt.resolve_tracking_uri(cfg.tracking.tracking_uri)
    mt.check_can_log(cfg, uri)  # a refused MLflow login fails here, before Ray starts (one line)
    done = already_trained(cfg, uri, log_model=log_model)
    if done is not None:
        return done
    runtime.ensure_ray(address)
    # Before the MLflow run exists: a node-local setting on a multi-node cluster leaves nothing.
    require_shared_state(cfg, uri, runtime.alive_nodes())
    run_id, resumed = mt.open_run(cfg, uri)
    status = "FAILED"
    tracker = mt.MlflowTracker(run_id, uri)
    try:
        result = runtime.fit(cfg, mlflow_run_id=run_id, mlflow_uri=uri, show_progress=show_progress)
        if result.error is not None:
            raise result.error
        ckpt_path = None
        metrics = dict(result.metrics or {})
        if result.checkpoint is not None:
            ckpt_path = runtime.checkpoint_uri(cfg, result.checkpoint)
            with result.checkpoint.as_directory() as d:
                # Final checkpoint and its config.yaml as run artifacts.
                tracker.log_artifacts(Path(d), "checkpoint")
                with tempfile.TemporaryDirectory(prefix="proxydml-config-") as cfg_dir:
                    # config.yaml also at the run's top level; log_artifacts copies it into its spool.
                    shutil.copy(Path(d) / "config.yaml", Path(cfg_dir) / "config.yaml")
                    tracker.log_artifacts(Path(cfg_dir), None)
                if "epoch" not in metrics:  # complete in storage but not in MLflow: its last epoch
                    state = json.loads((Path(d) / "trainer_state.json").read_text())
                    metrics = state["history"][-1] if state.get("history") else {}
                if log_model:
                    mt.log_pytorch_model(run_id, uri, Path(d))
            tracker.set_tags({"ray_checkpoint_path": ckpt_path})
        if log_file is not None and log_file.is_file():
            with tempfile.TemporaryDirectory(prefix="proxydml-log-") as log_dir:
                # A snapshot: the command keeps appending its last lines after this.
                shutil.copy(log_file, Path(log_dir) / log_file.name)
                tracker.log_artifacts(Path(log_dir), "logs")
        if not tracker.flush(timeout=600):
            raise RuntimeError(f"{tracker.pending()} MLflow record(s) not delivered after 600 s")
        status = "FINISHED"
        return TrainOutcome(
            run_name=cfg.run_name(), mlflow_run_id=run_id, tracking_uri=uri,
            checkpoint_path=ckpt_path, metrics=metrics, resumed=resumed,
        )
    finally:
        tracker.close(timeout=60)
        mt.end_run(run_id, uri, status)
