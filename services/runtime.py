"""The one module of ``services/`` that touches Ray.

Starts (or joins) a Ray cluster, runs the pipeline's training loop on Ray Train V2 workers
and adapts Ray's session to the pipeline's Reporter protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Keep every Ray process (GCS, raylet, workers, gloo) on loopback; must be set before import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports leave the machine
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train V2 re-routes print() through a logger and tees it: every epoch line twice.
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

from pipelines import train as train_pipeline  # noqa: E402
from pipelines.config import Config, from_dict  # noqa: E402
from pipelines.tracking import NullTracker  # noqa: E402


def ensure_ray(address: str | None = None) -> None:
    """Join ``address`` (or $RAY_ADDRESS), else start a local cluster on loopback."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # Locally, more logical CPUs than cores: the Train controller and a Tune driver need a
    # slot each and sit idle most of the time (measured: with 2 slots on 2 cores, trials starve).
    # The dashboard process also serves the State API that Ray Train's controller polls;
    # without it the driver log fills with "State API may be temporarily unavailable".
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 4),
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def gpu_available() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


class RayReporter:
    """The pipeline's Reporter on top of the Ray Train session."""

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            yield None
            return
        with ckpt.as_directory() as d:
            yield Path(d)

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint)


def _system_metrics(run_id: str, uri: str) -> Any:
    """MLflow's CPU/memory/disk/network (and GPU) sampler on the rank-0 worker's node.

    Off with MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false; it stops by itself (never raises)
    if the tracking server goes away, so it cannot disturb training.
    """
    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true").lower() == "false":
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, tracking_uri=uri)
    monitor.start()
    return monitor


def _train_loop(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    # Ray Train logs one INFO line per report on every worker; keep the epoch summaries readable.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    # ...including the one logged by a module whose logger is named by its file path.
    from ray.train.v2._internal.execution import context as _train_context

    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    cfg = from_dict(loop_config["config"])
    run_id = loop_config.get("mlflow_run_id")
    if not run_id or ray.train.get_context().get_world_rank() != 0:
        train_pipeline.run(cfg, RayReporter(), NullTracker())
        return
    from services.mlflow_tracking import MlflowTracker

    # In this worker process only: one quick HTTP attempt per call, so the tracker's own
    # buffer-and-backoff loop notices an outage at once instead of inside MLflow's retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    tracker = MlflowTracker(run_id, loop_config["mlflow_uri"])
    monitor = _system_metrics(run_id, loop_config["mlflow_uri"])
    try:
        # The run id travels in every checkpoint: a restarted worker continues the same run.
        train_pipeline.run(cfg, RayReporter(), tracker, extra_state={"mlflow_run_id": run_id})
    finally:
        if monitor is not None:
            monitor.finish()
        if not tracker.close(timeout=loop_config.get("flush_timeout_s", 600)):
            print(f"warning: {tracker.pending()} MLflow record(s) could not be delivered", flush=True)


def storage(cfg: Config) -> tuple[str, Any]:
    """(storage_path, pyarrow filesystem or None) for Ray Train checkpoints.

    ``s3://bucket/prefix`` goes to S3 or an S3-compatible server: the endpoint comes from
    $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL and the keys from the environment or the AWS
    profile, never from the (logged) config. Anything else is a local or shared folder.
    """
    path = cfg.tracking.storage_path or "runs"
    if not path.startswith("s3://"):
        return str(Path(path.removeprefix("file://")).resolve()), None
    import pyarrow.fs

    bucket_prefix = path.removeprefix("s3://").strip("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        from services.stack import ray_storage

        bucket, _, prefix = bucket_prefix.partition("/")
        return ray_storage(endpoint, bucket, prefix)
    return bucket_prefix, pyarrow.fs.S3FileSystem()


def checkpoint_uri(cfg: Config, checkpoint: ray.train.Checkpoint) -> str:
    """Where a checkpoint lives, as a user would type it (s3://... or a local path)."""
    if (cfg.tracking.storage_path or "").startswith("s3://"):
        return f"s3://{checkpoint.path}"
    return checkpoint.path


def fit(cfg: Config, *, mlflow_run_id: str | None = None, mlflow_uri: str | None = None,
        callbacks: list[Any] | None = None) -> ray.train.Result:
    """Run (or resume, when a run of the same name exists in storage) one training run."""
    path, filesystem = storage(cfg)
    use_gpu = cfg.scaling.use_gpu == "true" or (cfg.scaling.use_gpu == "auto" and gpu_available())
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"config": cfg.to_dict(), "mlflow_run_id": mlflow_run_id, "mlflow_uri": mlflow_uri},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        # nccl on GPUs, gloo on CPUs: chosen by what the workers were given.
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.run_name(),
            storage_path=path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Ray Train's per-report INFO lines drown the epoch summaries the pipeline prints.
            logging_config=ray.LoggingConfig(log_level="WARNING"),
            callbacks=callbacks,
        ),
    )
    return trainer.fit()


# -- Ray Tune ----------------------------------------------------------------------------------
def cluster_cpus() -> float:
    return float(ray.cluster_resources().get("CPU", 0))


def _tune_domain(dim: Any) -> Any:
    from ray import tune

    low_high = dim.values
    if dim.kind == "loguniform":
        return tune.loguniform(*low_high)
    if dim.kind == "uniform":
        return tune.uniform(*low_high)
    if dim.kind == "randint":
        return tune.randint(*low_high)
    if dim.kind == "choice":
        return tune.choice(list(dim.values))
    return tune.grid_search(list(dim.values))


def _trial_driver(params: dict[str, Any], *, base: dict[str, Any], sweep: str, parent_run_id: str,
                  mlflow_uri: str, storage_path: str) -> None:
    """One trial: a full multi-worker TorchTrainer run, its reports forwarded to Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from services import mlflow_tracking as mt
    from services.sweep import apply

    trial_id = tune.get_context().get_trial_id()
    cfg = apply(from_dict(base), params)
    cfg.tracking.run_name = f"{sweep}-{trial_id}"  # Tune trial ids survive a sweep restore
    cfg.tracking.storage_path = storage_path
    run_id, _ = mt.open_run(cfg, mlflow_uri, extra_tags={
        "mlflow.parentRunId": parent_run_id, "sweep_name": sweep, "trial_id": trial_id,
    })
    status = "FAILED"
    try:
        result = fit(cfg, mlflow_run_id=run_id, mlflow_uri=mlflow_uri, callbacks=[TuneReportCallback()])
        if result.error is not None:
            raise result.error
        status = "FINISHED"
    finally:
        # A trial stopped early by ASHA ends here too (the actor is torn down): KILLED is
        # then set by the driver when it collects results.
        mt.end_run(run_id, mlflow_uri, status)


def tune_sweep(spec: Any, *, parent_run_id: str, mlflow_uri: str, storage_root: str) -> list[dict[str, Any]]:
    """Run (or resume) a sweep; returns one dict per trial: id, params, metric, status."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    name = spec.name()
    storage = str(Path(storage_root).resolve())
    trainable = tune.with_resources(
        tune.with_parameters(
            _trial_driver, base=spec.base.to_dict(), sweep=name, parent_run_id=parent_run_id,
            mlflow_uri=mlflow_uri, storage_path=str(Path(storage) / name / "trials"),
        ),
        # The trial driver only waits on its Train workers: a sliver of a CPU (STACK.md).
        {"cpu": 0.01},
    )
    path = str(Path(storage) / name)
    if tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True)
    else:
        scheduler = (
            ASHAScheduler(time_attr="epoch", max_t=spec.base.train.epochs, grace_period=1, reduction_factor=2)
            if spec.scheduler == "asha" else FIFOScheduler()
        )
        search_alg = None
        if spec.search == "optuna":
            from ray.tune.search.optuna import OptunaSearch

            search_alg = OptunaSearch(seed=spec.base.train.seed)
        space = {d.key: _tune_domain(d) for d in spec.space}
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=spec.metric, mode=spec.mode, scheduler=scheduler, search_alg=search_alg,
                num_samples=1 if spec.search == "grid" else spec.samples,
                max_concurrent_trials=spec.max_concurrent,
            ),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=1),
        )
    grid = tuner.fit()
    trials = []
    for result in grid:
        metrics = result.metrics or {}
        trials.append({
            "trial_id": metrics.get("trial_id") or Path(result.path).name,
            "params": dict(result.config or {}),
            "metric": metrics.get(spec.metric),
            "epochs": metrics.get("epoch"),
            "error": repr(result.error) if result.error else None,
        })
    return trials


# -- Ray Jobs ----------------------------------------------------------------------------------
def run_job(entrypoint: str, *, address: str | None = None, env: dict[str, str] | None = None,
            follow: bool = True, poll_s: float = 1.0, out: Any = None) -> tuple[str, str, int | None]:
    """Submit ``entrypoint`` as a Ray Job and (``follow``) stream its logs until it ends.

    ``address``: the cluster's dashboard (``http://host:8265``) or GCS address; None = RAY_ADDRESS,
    else the local running cluster. Returns (submission id, final status, driver exit code);
    with ``follow=False`` the status is the one right after submission.
    """
    import asyncio
    import sys
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    out = out or sys.stdout
    # Ray lets RAY_ADDRESS override an explicit address; an explicit --address must win.
    hidden = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
              if address and k in os.environ}
    try:
        client = JobSubmissionClient(address)
    finally:
        os.environ.update(hidden)
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env} if env else None)
    print(f"submitted Ray job {job_id} to {client.get_address()}: {entrypoint}", file=out, flush=True)
    if not follow:
        return job_id, str(client.get_job_status(job_id)), None

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    try:
        asyncio.run(tail())
    except Exception as exc:  # the log stream broke (proxy, restart): keep polling the status
        print(f"(log stream ended: {exc}; polling the job status)", file=out, flush=True)
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while (status := client.get_job_status(job_id)) not in terminal:
        time.sleep(poll_s)
    info = client.get_job_info(job_id)
    return job_id, str(status.value if hasattr(status, "value") else status), info.driver_exit_code
