"""The one module of ``services/`` that touches Ray.

Starts (or joins) a Ray cluster, runs the pipeline's training loop on Ray Train V2 workers
and adapts Ray's session to the pipeline's Reporter protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

# Keep every Ray process (GCS, raylet, workers, gloo) on loopback; must be set before import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports leave the machine
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train V2 re-routes print() through a logger and tees it: every epoch line twice.
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")

import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from ray.tune import Callback as TuneCallback  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402

from pipelines import train as train_pipeline  # noqa: E402
from pipelines.config import Config, from_dict, load_yaml  # noqa: E402
from pipelines.gallery import GalleryEmbedder, GalleryItems, decode_batch, embed_items, image_channels  # noqa: E402
from pipelines.tracking import NullProgress, NullTracker, Progress  # noqa: E402
from services.auth import use_credentials, worker_credentials  # noqa: E402
from services.cluster import ClusterError, probe  # noqa: E402
from services.console import SweepProgress  # noqa: E402
from services.net import free_port  # noqa: E402
from services.s3 import endpoint_from_env, ray_storage, retrying_s3_filesystem  # noqa: E402
from services.search_space import Dimension, SweepSpec, apply, in_process_trials, num_samples  # noqa: E402

# services.mlflow_tracking (MLflow, ~1.4 s to import) is imported inside the functions that
# log: every Ray Train worker imports this module, and only rank 0 logs to MLflow.


def ensure_ray(address: str | None = None) -> None:
    """Join ``address`` (or $RAY_ADDRESS), else start a fresh local instance on loopback.

    ``auto`` joins the cluster a ``ray start`` on this machine runs. Without an address a new
    instance starts (``address="local"``) even when /tmp/ray/ray_current_cluster names a
    cluster: that file outlives a killed cluster, and Ray would try to join the dead one.
    An address where no cluster answers is a ClusterError (one line) at once, not minutes of
    Ray's retries.
    """
    if ray.is_initialized():
        return
    named_by = "--address" if address else "$RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        target = address
        if address == "auto":
            # The cluster `ray start` recorded in /tmp/ray/ray_current_cluster ($RAY_TMPDIR/ray),
            # not Ray's fallback of any GCS process found on the machine (someone else's).
            from ray._private.utils import read_ray_address

            target = read_ray_address() or ""
            if not target:
                raise ClusterError("--address auto: no Ray cluster was started on this machine (`ray start "
                                   "--head` records its address); give --address HOST:PORT")
            named_by = "--address auto"
        probe(target, named_by=named_by)
        try:
            ray.init(address=target, log_to_driver=True)
        except ConnectionError as exc:  # something answers there, but not a Ray cluster we can join
            raise ClusterError(f"cannot join the Ray cluster at {target} ({named_by}): {exc}") from exc
        return
    # Locally, more logical CPUs than cores: the Train controller and a Tune driver need a
    # slot each and sit idle most of the time (measured: with 2 slots on 2 cores, trials starve).
    # The dashboard process also serves the State API that Ray Train's controller polls;
    # without it the driver log fills with "State API may be temporarily unavailable".
    dashboard_port = free_port()
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, 4),
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        # Ray's own actors reach their cluster's State API by searching the machine; with a
        # second Ray instance running there the search fails, Ray Train's placement-group
        # cleaner stops, and a trial Tune stops (ASHA, max_t) keeps its workers' CPUs for good:
        # the next trials then wait forever. Naming the dashboard here points them at ours.
        # No preemption watcher: it polls for nodes being drained (cloud spot capacity), which a
        # local instance never has, and costs every Train run one more actor process (~2 CPU-s).
        runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}",
                                  "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}},
    )


def alive_nodes() -> int:
    """Nodes of the connected cluster that are alive."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def gpu_available() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def wants_gpu(cfg: Config) -> bool:
    """Whether each worker of ``cfg`` gets a GPU: ``scaling.use_gpu`` true, or auto on a cluster with GPUs."""
    return cfg.scaling.use_gpu == "true" or (cfg.scaling.use_gpu == "auto" and gpu_available())


# How long a worker keeps retrying a checkpoint upload that fails (the storage server is down
# or unreachable) before it gives up and lets Ray's FailureConfig restart the worker group from
# the last registered checkpoint. The driver reads it when the run starts (workers do not see
# the driver's environment) and hands it to every worker; 0 = one attempt, no retry.
UPLOAD_RETRY_ENV = "PROXYDML_CHECKPOINT_UPLOAD_RETRY_S"
DEFAULT_UPLOAD_RETRY_S = 600.0
# A healthy upload of our checkpoints takes well under this; past it the worker says so.
UPLOAD_SLOW_WARN_S = 5.0
_log = logging.getLogger("proxydml.checkpoint")
T = TypeVar("T")


def upload_retry_budget() -> float:
    """Seconds of checkpoint-upload retries per report ($PROXYDML_CHECKPOINT_UPLOAD_RETRY_S)."""
    raw = os.environ.get(UPLOAD_RETRY_ENV, "")
    try:
        return max(float(raw), 0.0) if raw.strip() else DEFAULT_UPLOAD_RETRY_S
    except ValueError as exc:
        raise ValueError(f"{UPLOAD_RETRY_ENV} must be a number of seconds, got {raw!r}") from exc


def verify_upload(local_dir: str | os.PathLike[str], fs: Any, dest: str) -> None:
    """Raise OSError unless every file under ``local_dir`` is at ``(fs, dest)`` with its size.

    Why: ``pyarrow.fs.copy_files``, which Ray Train uploads checkpoints with, returns success
    when the upload of a file to S3 failed (pyarrow 25.0.1, measured: the error only shows as
    "Error ignored when destroying file" on stderr and the object is never created). Without
    this check a checkpoint missing its model.pt could be registered.
    """
    import pyarrow.fs

    local = Path(local_dir)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(dest, recursive=True, allow_not_found=True))
    remote = {Path(i.path).relative_to(dest).as_posix(): i.size for i in infos
              if i.type == pyarrow.fs.FileType.File}
    wrong = [f"{rel} ({'missing' if rel not in remote else f'{remote[rel]} of {size} bytes'})"
             for f in sorted(local.rglob("*")) if f.is_file()
             for rel, size in [(f.relative_to(local).as_posix(), f.stat().st_size)]
             if remote.get(rel) != size]
    if wrong:
        raise OSError(f"upload to {dest} incomplete: {', '.join(wrong)}")


def retry_upload(upload: Callable[[], T], *, label: str, budget_s: float, max_delay_s: float = 15.0,
                 warn_after_s: float = UPLOAD_SLOW_WARN_S) -> T:
    """``upload()``, retried with exponential backoff until it succeeds or ``budget_s`` is spent.

    Logs a warning while an attempt hangs (the S3 client retries each request for ~25 s on its
    own, see ``services.s3.S3_MAX_ATTEMPTS``) and on every failed attempt, so an outage is
    visible in the worker's log while it lasts. ``FileNotFoundError`` (the local folder is
    gone) is a bug, not an outage, and is raised at once.
    """
    deadline = time.monotonic() + budget_s
    delay, attempt = 1.0, 1
    while True:
        started = time.monotonic()
        done = threading.Event()

        def watch(attempt: int = attempt, started: float = started, done: threading.Event = done) -> None:
            interval = warn_after_s  # then 2x, 4x, ...: a long healthy upload is not a log flood
            while not done.wait(interval):
                interval = min(interval * 2, 120.0)
                _log.warning("%s: upload attempt %d still running after %.0f s: storage slow or "
                             "unreachable? (the S3 client keeps retrying)", label, attempt,
                             time.monotonic() - started)

        threading.Thread(target=watch, daemon=True, name="upload-watchdog").start()
        try:
            result = upload()
        except FileNotFoundError:
            raise
        except OSError as exc:  # pyarrow's network and S3 errors are OSErrors
            left = deadline - time.monotonic()
            if left <= 0:
                _log.error("%s: upload failed %d time(s), giving up after %.0f s (Ray restarts from "
                           "the last registered checkpoint if scaling.max_failures allows): %s",
                           label, attempt, budget_s, exc)
                raise
            wait = min(delay, left)
            _log.warning("%s: upload attempt %d failed, storage unreachable? retrying in %.0f s "
                         "(gives up after %.0f s): %s", label, attempt, wait, budget_s, exc)
            time.sleep(wait)
            delay, attempt = min(delay * 2, max_delay_s), attempt + 1
            continue
        finally:
            done.set()
        if attempt > 1 or time.monotonic() - started > warn_after_s:
            _log.warning("%s: uploaded after %d attempt(s), %.0f s", label, attempt,
                         time.monotonic() - started)
        return result


def _persist_checkpoint(checkpoint: ray.train.Checkpoint, dir_name: str, *,
                        budget_s: float) -> ray.train.Checkpoint:
    """Ray's own upload (``persist_current_checkpoint``), verified, retried (:func:`retry_upload`).

    A retry writes the whole folder again into the same checkpoint directory (each S3 object
    appears whole or not at all), and Ray registers a checkpoint only once every rank's
    upload function has returned, so a registered checkpoint is never half written.
    """
    context = ray.train.get_context()
    storage = context.get_storage()

    def upload() -> ray.train.Checkpoint:
        persisted = storage.persist_current_checkpoint(checkpoint, dir_name)
        verify_upload(checkpoint.path, persisted.filesystem, persisted.path)
        return persisted

    label = f"checkpoint {dir_name} (rank {context.get_world_rank()})"
    return retry_upload(upload, label=label, budget_s=budget_s)


@contextlib.contextmanager
def _as_folder(ckpt: ray.train.Checkpoint | None) -> Iterator[Path | None]:
    """A checkpoint Ray hands back (Train's or Tune's) as a local folder; None for none."""
    if ckpt is None:
        yield None
        return
    with ckpt.as_directory() as d:
        yield Path(d)


class RayReporter:
    """The pipeline's Reporter on top of the Ray Train session.

    Uploads to remote storage go through :func:`_persist_checkpoint` (verified, retried for
    ``upload_retry_s``); a local or shared folder keeps Ray's plain copy (a write it refuses
    means a full or missing disk, not a server briefly away).
    """

    def __init__(self, upload_retry_s: float = 0.0, show_progress: bool = False) -> None:
        self.upload_retry_s = upload_retry_s
        self.show_progress = show_progress

    def progress(self, total: int, description: str) -> Progress:
        """Ray's tqdm: the worker sends the bar's state, the driver draws it (in its terminal)."""
        if not self.show_progress:
            return NullProgress()
        from ray.experimental import tqdm_ray

        return tqdm_ray.tqdm(total=total, desc=description, unit="step")

    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        return _as_folder(ray.train.get_checkpoint())

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        upload = None
        if checkpoint is not None:
            import pyarrow.fs

            fs = ray.train.get_context().get_storage().storage_filesystem
            if not isinstance(fs, pyarrow.fs.LocalFileSystem):
                upload = functools.partial(_persist_checkpoint, budget_s=self.upload_retry_s)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=upload)


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


def _quiet_worker_logs() -> None:
    # Ray Train logs one INFO line per report on every worker; keep the epoch summaries readable.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    # ...including the one logged by a module whose logger is named by its file path.
    from ray.train.v2._internal.execution import context as _train_context

    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def _train_tracked(cfg: Config, reporter: Any, run_id: str | None, uri: str | None, *,
                   flush_timeout_s: float = 600.0, dashboard: bool = True) -> dict[str, float]:
    """The pipeline's run in this process, recorded to MLflow run ``run_id`` when given (the
    rank-0 worker of a Ray Train run, or a one-worker trial's own process). ``dashboard``:
    the run's plots at the end (not for a sweep's trials)."""
    from services.snapshots import install_data_resolver

    install_data_resolver()  # data.root=s3://...: read from this node's cache, filled once per node
    # Threads = the CPUs Ray reserved for this worker (the driver made an automatic value concrete).
    torch.set_num_threads(cfg.scaling.threads)
    if not run_id:
        return train_pipeline.run(cfg, reporter, NullTracker(), dashboard=dashboard)
    from services.mlflow_tracking import MlflowTracker

    # In this worker process only: one quick HTTP attempt per call, so the tracker's own
    # buffer-and-backoff loop notices an outage at once instead of inside MLflow's retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    tracker = MlflowTracker(run_id, uri)
    monitor = _system_metrics(run_id, uri)
    try:
        # The run id travels in every checkpoint: a restarted worker continues the same run.
        return train_pipeline.run(cfg, reporter, tracker, extra_state={"mlflow_run_id": run_id}, dashboard=dashboard)
    finally:
        if monitor is not None:
            monitor.finish()
        if not tracker.close(timeout=flush_timeout_s):
            print(f"warning: {tracker.pending()} MLflow record(s) could not be delivered", flush=True)


def _train_loop(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    _quiet_worker_logs()
    cfg = from_dict(loop_config["config"])
    reporter = RayReporter(upload_retry_s=loop_config.get("upload_retry_s", 0.0),
                           show_progress=loop_config.get("show_progress", False))
    rank0 = ray.train.get_context().get_world_rank() == 0
    _train_tracked(cfg, reporter, loop_config.get("mlflow_run_id") if rank0 else None,
                   loop_config.get("mlflow_uri"), flush_timeout_s=loop_config.get("flush_timeout_s", 600),
                   dashboard=loop_config.get("dashboard", True))


def storage(cfg: Config) -> tuple[str, Any]:
    """(storage_path, pyarrow filesystem or None) for Ray Train checkpoints.

    ``s3://bucket/prefix`` goes to S3 or an S3-compatible server: the endpoint comes from
    $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL and the keys from the environment or the AWS
    profile, never from the (logged) config. Anything else is a local or shared folder.
    """
    return storage_location(cfg.tracking.storage_path or "runs")


def storage_location(path: str) -> tuple[str, Any]:
    """(storage_path, pyarrow filesystem or None) for ``path``: a folder or s3://bucket/prefix."""
    if not path.startswith("s3://"):
        return str(Path(path.removeprefix("file://")).resolve()), None
    bucket_prefix = path.removeprefix("s3://").strip("/")
    endpoint = endpoint_from_env()
    if endpoint:
        bucket, _, prefix = bucket_prefix.partition("/")
        return ray_storage(endpoint, bucket, prefix)
    return bucket_prefix, retrying_s3_filesystem()


def checkpoint_uri(cfg: Config, checkpoint: ray.train.Checkpoint) -> str:
    """Where a checkpoint lives, as a user would type it (s3://... or a local path)."""
    if (cfg.tracking.storage_path or "").startswith("s3://"):
        return f"s3://{checkpoint.path}"
    return checkpoint.path


def _loop_with_login(mlflow_uri: str | None) -> Callable[[dict[str, Any]], None]:
    """The train loop, run as this driver's MLflow user on a server with logins.

    The login (services.auth.worker_credentials) reaches each worker's environment through an
    object-store reference: never in the train-loop config (Ray Train records it) nor in a
    runtime_env (Ray's runtime_env agent writes env_vars to its log, measured on Ray 2.60).
    """
    login = worker_credentials() if (mlflow_uri or "").startswith(("http://", "https://")) else {}
    if not login:
        return _train_loop
    login_ref = ray.put(login)

    def train_loop_as_user(loop_config: dict[str, Any]) -> None:
        use_credentials(ray.get(login_ref))
        _train_loop(loop_config)

    return train_loop_as_user


def fit(cfg: Config, *, mlflow_run_id: str | None = None, mlflow_uri: str | None = None,
        callbacks: list[Any] | None = None, show_progress: bool = False, dashboard: bool = True) -> ray.train.Result:
    """Run (or resume, when a run of the same name exists in storage) one training run;
    ``dashboard``: its plots at the end (not for a sweep's trials)."""
    # Callers pass a config made concrete by training.resolve_for_workers; this covers direct use.
    cfg = dataclasses.replace(cfg, scaling=cfg.scaling.resolved(os.cpu_count() or 1))
    path, filesystem = storage(cfg)
    use_gpu = wants_gpu(cfg)
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        _loop_with_login(mlflow_uri) if mlflow_run_id else _train_loop,
        train_loop_config={"config": cfg.to_dict(), "mlflow_run_id": mlflow_run_id, "mlflow_uri": mlflow_uri,
                           "upload_retry_s": upload_retry_budget(), "show_progress": show_progress,
                           "dashboard": dashboard},
        scaling_config=ray.train.ScalingConfig(
            # MIN-MAX: Ray's elastic worker group; after a lost node it restarts from the last
            # checkpoint on the workers the cluster still holds (the proxies are resharded).
            num_workers=((cfg.scaling.min_workers, cfg.scaling.max_workers) if cfg.scaling.elastic
                         else cfg.scaling.num_workers),
            use_gpu=use_gpu, resources_per_worker=resources,
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


def _tune_domain(dim: Dimension) -> Any:
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


class TuneReporter:
    """The pipeline's Reporter in a one-worker trial's own process: Tune persists each reported
    checkpoint into the trial's folder of the sweep storage before ``report`` returns, and hands
    the latest back when it restarts the trial (a lost node, a resumed sweep)."""

    def progress(self, total: int, description: str) -> Progress:
        return NullProgress()  # many trials side by side: the sweep's console has its own summary

    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        from ray import tune

        return _as_folder(tune.get_checkpoint())

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        from ray import tune

        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None)


def _within_space(config: dict[str, Any], dims: tuple[Dimension, ...]) -> dict[str, Any]:
    """PBT's explore step multiplies a value by 0.8 or 1.2: keep it inside its dimension."""
    for d in dims:
        if d.kind in ("loguniform", "uniform") and d.key in config:
            config[d.key] = min(max(config[d.key], d.values[0]), d.values[1])
    return config


def _record_exploit(params: dict[str, Any], cfg: Config, run_id: str, mlflow_uri: str, sweep: str) -> None:
    """When PBT restarts this trial from another trial's checkpoint (an exploit), record on its
    MLflow run which trial it cloned, at which epoch, and the values it goes on with (tags
    ``pbt.exploit.N``, ``pbt.exploits``, ``pbt.cloned_from``). A trial's own checkpoint (a
    restart, a resumed sweep) is not an exploit."""
    from ray import tune

    from services import mlflow_tracking as mt

    with _as_folder(tune.get_checkpoint()) as folder:
        if folder is None:
            return
        donor = from_dict(load_yaml(folder / "config.yaml"))
        if donor.tracking.run_name == cfg.tracking.run_name:
            return
        epoch = json.loads((folder / "trainer_state.json").read_text())["epoch"]
    was = donor.flat()
    mt.record_exploit(run_id, mlflow_uri, {
        "from_trial": donor.tracking.run_name.removeprefix(f"{sweep}-"), "epoch": epoch,
        "values": dict(params), "donor_values": {k: was.get(k) for k in params},
    })


def _trial_dirname(trial: Any, sweep: str) -> str:
    """A trial's folder in the sweep storage: its MLflow run name (ids, never a timestamp)."""
    return f"{sweep}-{trial.trial_id}"


def _trial_driver(params: dict[str, Any], *, base: dict[str, Any], sweep: str, parent_run_id: str,
                  mlflow_uri: str, storage_path: str, in_process: bool, holds: dict[str, float],
                  login: dict[str, str] | None = None) -> None:
    """One trial: trained here when ``in_process`` (decided once for the sweep by
    :func:`in_process_trials`, which also sized the trial's resources), else a full
    multi-worker TorchTrainer run whose reports are forwarded to Tune. ``holds``: the CPUs and
    GPUs the trial holds, its Train workers' included (tags ``trial_cpus``, ``trial_gpus``: the
    sweep page's compute spent).

    ``login``: the sweep driver's MLflow login (tune.with_parameters keeps it in the object
    store, out of the trial config Tune records), this actor's environment from here on.
    """
    use_credentials(login or {})
    from ray import tune

    from services import mlflow_tracking as mt

    trial_id = tune.get_context().get_trial_id()
    cfg = apply(from_dict(base), params)
    cfg.tracking.run_name = f"{sweep}-{trial_id}"  # Tune trial ids survive a sweep restore
    cfg.tracking.storage_path = storage_path
    ended = mt.ended_trial(cfg, mlflow_uri)
    if ended is not None:
        # Tune restored it from a sweep state saved before the trial ended (the driver was
        # killed): it had finished, or ASHA had stopped it. Tell Tune where it ended, train no more.
        tune.report(ended)
        return
    run_id, _ = mt.open_run(cfg, mlflow_uri, extra_tags={
        "mlflow.parentRunId": parent_run_id, "sweep_name": sweep, "trial_id": trial_id,
        "trial_cpus": f"{holds['cpus']:g}", "trial_gpus": f"{holds['gpus']:g}",
    })
    if in_process:
        _quiet_worker_logs()
        _record_exploit(params, cfg, run_id, mlflow_uri, sweep)
        _train_tracked(cfg, TuneReporter(), run_id, mlflow_uri, dashboard=False)
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        result = fit(cfg, mlflow_run_id=run_id, mlflow_uri=mlflow_uri, callbacks=[TuneReportCallback()],
                     dashboard=False)
        if result.error is not None:
            raise result.error
    # Only success is recorded here. A stopped (ASHA, max_t) or failed trial gets its status from
    # the sweep driver, from Tune's view (sweep.close_trial_runs): a FAILED written here while
    # Tune tears the actor down could land after that KILLED (seen: 1 child of 4).
    mt.end_run(run_id, mlflow_uri, "FINISHED")


# Sweep name -> the console's progress handler of the sweep running in this process. Tune
# pickles its callbacks with the sweep's state (to restore it), so the callback finds its
# handler here by name rather than holding it: a restored sweep reports to the new console.
_PROGRESS_SINKS: dict[str, Callable[[SweepProgress, bool], None]] = {}


class _SweepProgressCallback(TuneCallback):
    """Hands :class:`SweepProgress` to the sweep's handler after every step of Tune's loop and
    once at the end. ``cpus``/``gpus``: what one trial holds (its Train workers included), for
    the compute spent: each trial's reported training time times that."""

    def __init__(self, spec: SweepSpec, *, cpus: float, gpus: float) -> None:
        self.sweep, self.metric, self.mode = spec.name(), spec.metric, spec.mode
        self.epochs, self.planned = spec.base.train.epochs, num_samples(spec.samples, spec.search)
        self.cpus, self.gpus = cpus, gpus
        self.best: tuple[float, str] | None = None
        self.started = time.monotonic()

    def setup(self, **info: Any) -> None:
        self.started = time.monotonic()  # this command's time, also on a resumed sweep

    def _better(self, value: float) -> bool:
        return self.best is None or (value > self.best[0] if self.mode == "max" else value < self.best[0])

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict, **info: Any) -> None:
        value = result.get(self.metric)
        if value is not None and self._better(float(value)):
            self.best = (float(value), trial.trial_id)

    def progress(self, trials: list[Any]) -> SweepProgress:
        count = dict.fromkeys(("done", "running", "pending", "stopped", "failed"), 0)
        seconds = 0.0
        for trial in trials:
            last = trial.last_result or {}
            seconds += float(last.get("time_total_s") or 0.0)
            if last.get(self.metric) is not None and self._better(float(last[self.metric])):
                self.best = (float(last[self.metric]), trial.trial_id)  # trials a resumed sweep finished before
            if trial.status == "ERROR":
                count["failed"] += 1
            elif trial.status == "TERMINATED":
                count["done" if (last.get("epoch") or 0) >= self.epochs else "stopped"] += 1
            elif trial.status == "RUNNING":
                count["running"] += 1
            else:
                count["pending"] += 1
        return SweepProgress(planned=max(self.planned, len(trials)), metric=self.metric,
                             best=self.best[0] if self.best else None, best_trial=self.best[1] if self.best else "",
                             elapsed_s=time.monotonic() - self.started, cpu_hours=seconds * self.cpus / 3600,
                             gpu_hours=seconds * self.gpus / 3600, **count)

    def _send(self, trials: list[Any], final: bool) -> None:
        sink = _PROGRESS_SINKS.get(self.sweep)
        if sink is not None:
            sink(self.progress(trials), final)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        self._send(trials, False)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self._send(trials, True)


# Sweep name -> where the sweep running in this process records an ASHA stop (as _PROGRESS_SINKS).
_STOP_SINKS: dict[str, Callable[[str, dict[str, float]], None]] = {}


class _RecordingASHA(ASHAScheduler):
    """ASHA that records each trial it stops before the last epoch: the rung (epoch), the
    trial's value there, the cutoff it fell below and how many trials that rung had seen. The
    sweep page explains a stop with the numbers ASHA compared, which the runs' histories cannot
    give back: a cutoff depends on the order in which results reached the driver."""

    def __init__(self, sweep: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sweep = sweep

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        judged = self._rung_and_cutoff(trial.trial_id, result)
        action = super().on_trial_result(tune_controller, trial, result)
        sink = _STOP_SINKS.get(self.sweep)
        if action == self.STOP and judged is not None and sink is not None:
            sink(trial.trial_id, judged)
        return action

    def _rung_and_cutoff(self, trial_id: str, result: dict) -> dict[str, float] | None:
        """The rung this result is about to be judged at, as ASHA's bracket picks it (the
        highest milestone reached that has not recorded the trial: past it when a resumed sweep's
        fresh rungs meet a restored trial), and the cutoff there. None at the last epoch (every
        trial stops there), below the first rung, or where the rung has no value yet. Reads the
        bracket's state: the pinned Ray's ``_Bracket``."""
        epoch, value = result.get(self._time_attr), result.get(self._metric)
        bracket = self._trial_info.get(trial_id)
        if epoch is None or value is None or bracket is None or epoch >= self._max_t:
            return None
        for milestone, recorded in bracket._rungs:
            if epoch < milestone or trial_id in recorded:
                continue
            cutoff = bracket.cutoff(recorded)
            if cutoff is None:
                return None
            return {"rung": float(milestone), "epoch": float(epoch), "value": float(value),
                    "cutoff": float(self._metric_op * cutoff), "rung_trials": float(len(recorded))}
        return None


class _ResumableOptunaSearch(OptunaSearch):
    """OptunaSearch that survives a torn sweep state. Tune writes the trials and the searcher to
    storage as separate files, so a driver killed mid-write can leave a state whose trials include
    one the saved searcher never suggested; Ray's OptunaSearch then fails the resumed sweep on its
    first result (KeyError). Here such a trial's results are ignored, and its final score, when
    it reaches the searcher, is told to the study as an evaluated point."""

    def _knows(self, trial_id: str) -> bool:
        return trial_id in self._ot_trials or trial_id in self._completed_trials

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if self._knows(trial_id):
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if self._knows(trial_id):
            return super().on_trial_complete(trial_id, result, error)
        result = result or {}
        config = result.get("config") or {}
        point = {k: config[k] for k in self._space if k in config}
        if not error and result.get(self.metric) is not None and len(point) == len(self._space):
            self.add_evaluated_point(point, float(result[self.metric]))
        self._completed_trials.add(trial_id)


def tune_sweep(spec: SweepSpec, *, parent_run_id: str, mlflow_uri: str, storage_root: str,
               on_progress: Callable[[SweepProgress, bool], None] | None = None,
               ) -> tuple[list[dict[str, Any]], int | None]:
    """Run (or resume) a sweep. Returns one dict per trial (id, params, metric, status), and how
    many trials the Optuna searcher knew at the end (a warm start's earlier ones included; None
    for other searches and for a resumed sweep, whose searcher Tune restores on its own).
    ``on_progress``: called with the sweep's :class:`SweepProgress` as it goes (final: True at the end)."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from services import mlflow_tracking as mt

    name = spec.name()
    # s3://...: the sweep state and every trial's checkpoints on S3, so a trial whose node is
    # lost resumes on another node from its last checkpoint.
    root = storage_root.rstrip("/") if storage_root.startswith("s3://") else str(Path(storage_root).resolve())
    storage, filesystem = storage_location(root)
    one_process = in_process_trials(spec.base)
    workers = 1 if one_process else spec.base.scaling.num_workers
    holds = {"cpus": workers * spec.base.scaling.cpus_per_worker, "gpus": workers if wants_gpu(spec.base) else 0}
    progress = _SweepProgressCallback(spec, cpus=holds["cpus"], gpus=holds["gpus"])
    if one_process:  # the trial trains in its own process: it holds the worker's resources
        resources = {"cpu": holds["cpus"], "gpu": holds["gpus"]}
    else:  # the trial driver only waits on its Train workers: a sliver of a CPU (docs/operations.md)
        resources = {"cpu": 0.01}
    trainable = tune.with_resources(
        tune.with_parameters(
            _trial_driver, base=spec.base.to_dict(), sweep=name, parent_run_id=parent_run_id,
            mlflow_uri=mlflow_uri, login=worker_credentials(), in_process=one_process, holds=holds,
            # In-process trials keep their checkpoints in Tune's trial folder, Train runs their own.
            storage_path=f"{root}/{name}" if one_process else f"{root}/{name}/trials",
        ),
        resources,
    )
    path = f"{storage}/{name}"
    study_storage = None
    if tune.Tuner.can_restore(path, storage_filesystem=filesystem):
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True, storage_filesystem=filesystem)
    else:
        if spec.scheduler == "asha":
            scheduler = _RecordingASHA(name, time_attr="epoch", max_t=spec.base.train.epochs,
                                       grace_period=spec.grace_period, reduction_factor=spec.reduction_factor)
        elif spec.scheduler == "pbt":
            from ray.tune.schedulers import PopulationBasedTraining

            # Every epoch ends in a checkpoint, so every epoch is a chance to exploit. Synchronous:
            # the whole population reaches the epoch before the bottom quarter clones the top
            # quarter, so what is cloned does not depend on which trial happened to report first.
            scheduler = PopulationBasedTraining(
                time_attr="epoch", perturbation_interval=1, synch=True, quantile_fraction=0.25,
                hyperparam_mutations={d.key: _tune_domain(d) for d in spec.space},
                custom_explore_fn=functools.partial(_within_space, dims=tuple(spec.space)),
            )
        else:
            scheduler = FIFOScheduler()
        search_alg = None
        limit: int | None = spec.max_concurrent
        points = [dict(p) for p in spec.points] or None
        space = {d.key: _tune_domain(d) for d in spec.space}
        if spec.search == "optuna":
            import optuna

            # The searcher gets the space itself (not through the Tuner), so that the earlier
            # trials of a warm start can be told to it before the first suggestion; its study
            # lives in a storage this function keeps, to count what the searcher saw.
            study_storage = optuna.storages.InMemoryStorage()
            # A warm start draws its own random start-up points: with the earlier sweep's seed
            # Optuna would suggest that sweep's first points again, whatever it was told.
            seed = spec.base.train.seed if not spec.warm_start else int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
            search_alg = _ResumableOptunaSearch(OptunaSearch.convert_search_space(space), metric=spec.metric,
                                                mode=spec.mode, seed=seed, points_to_evaluate=points,
                                                storage=study_storage, study_name=name)
            for point, score in spec.evaluated:
                search_alg.add_evaluated_point(point, score)
            space = {}
        elif points:
            from ray.tune.search.basic_variant import BasicVariantGenerator

            # Tune applies max_concurrent_trials only to its own generator (and warns otherwise):
            # a given one carries the limit itself.
            search_alg = BasicVariantGenerator(points_to_evaluate=points, max_concurrent=spec.max_concurrent)
            limit = None
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=spec.metric, mode=spec.mode, scheduler=scheduler, search_alg=search_alg,
                num_samples=num_samples(spec.samples, spec.search),
                max_concurrent_trials=limit,
                # The next trial runs in the warm process of the last: imports and data already there.
                reuse_actors=one_process,
                trial_dirname_creator=functools.partial(_trial_dirname, sweep=name),
            ),
            run_config=tune.RunConfig(
                name=name, storage_path=storage, storage_filesystem=filesystem, verbose=1, callbacks=[progress],
                # A trial whose driver's node is lost starts again elsewhere; its TorchTrainer
                # resumes from the trial's last checkpoint (same run name and storage).
                failure_config=tune.FailureConfig(max_failures=spec.base.scaling.max_failures),
                # PBT would also exploit at the last epoch: the trial would end holding the
                # clone's weights under its own last score. Stopped there, it never is.
                stop={"epoch": spec.base.train.epochs} if spec.scheduler == "pbt" else None,
            ),
        )
    if on_progress is not None:
        _PROGRESS_SINKS[name] = on_progress
    # Tune saves the sweep's state (its trials and their checkpoints) every 10 s or more by default,
    # so a driver killed in between loses the trials started since: Tune runs others in their
    # place (sweep.close_trial_runs adopts the lost runs that had ended and tags the rest). Every
    # second keeps that window to about one trial start; the state is a few KB per trial.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    stops: dict[str, dict[str, float]] = {}

    def record_stop(trial_id: str, judged: dict[str, float]) -> None:
        # On the trial's run right away: a sweep killed now and resumed later keeps why it stopped.
        stops[trial_id] = judged
        try:
            mt.record_asha_stop(mlflow_uri, parent_run_id, trial_id, judged)
        except Exception as exc:  # noqa: BLE001 - the page loses one explanation; the sweep goes on
            logging.getLogger("proxydml.sweep").warning("trial %s: ASHA stop not recorded: %s", trial_id, exc)

    _STOP_SINKS[name] = record_stop
    try:
        grid = tuner.fit()
    finally:
        _PROGRESS_SINKS.pop(name, None)
        _STOP_SINKS.pop(name, None)
    trials = []
    for result in grid:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or Path(result.path).name
        trials.append({
            "trial_id": trial_id,
            "params": dict(result.config or {}),
            "metric": metrics.get(spec.metric),
            "epochs": metrics.get("epoch"),
            "error": repr(result.error) if result.error else None,
            "asha": stops.get(trial_id),
        })
    if study_storage is None:
        return trials, None
    import optuna

    return trials, len(optuna.load_study(study_name=name, storage=study_storage).trials)


# -- Ray Data: a gallery's embedding pass ------------------------------------------------------
# The environment of the processes that run a model batch after batch (embedding actors, search
# replicas). They run it in a thread of their own, and glibc gives each thread an arena whose
# heaps it shrinks as soon as a forward pass frees its activations: the next batch faults them
# in again (measured: 77,000 page faults and 0.44 s per batch of 64 in a thread, none and 0.30 s
# in the main thread). One arena keeps every thread on the main heap, which
# pipelines.gallery.keep_freed_memory keeps from being trimmed. glibc reads it at start only.
INFERENCE_ENV = {"MALLOC_ARENA_MAX": "1"}


class _RayGalleryEmbedder(GalleryEmbedder):
    """The gallery embedder as a Ray Data actor: the weights come from the object store (one
    copy per node), and every row it embeds carries this actor's node id."""

    def __init__(self, config: dict[str, Any], state: Any, in_channels: int, threads: int) -> None:
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)
        if isinstance(state, ray.ObjectRef):
            state = ray.get(state)
        super().__init__(from_dict(config), state, in_channels, threads,
                         node=ray.get_runtime_context().get_node_id())


def embed_gallery(items: GalleryItems, cfg: Config, state: dict[str, torch.Tensor], *, batch_size: int,
                  concurrency: int | None = None, threads: int = 1) -> Iterator[dict[str, Any]]:
    """Embed ``items`` on the connected cluster with Ray Data; yields embedded batches in id order.

    A one-node cluster without GPUs embeds the gallery in this process
    (``pipelines.gallery.embed_items``, ``threads`` torch threads) unless ``concurrency`` asks
    for a pool: there the default pool is one actor, which only moves decoding beside the forward
    pass, and measured slower than this process at any size (bench_index.py embed: 18.7 s to
    start, then 0.90 of the single-process floor, against 0.94 of it decoding in line).
    Otherwise files are read, hashed and decoded in CPU tasks (``pipelines.gallery.decode_batch``), then
    embedded by a pool of actors holding the model: ``concurrency`` actors (default: one per
    GPU when the cluster has GPUs, else one per alive node), ``threads`` torch threads each, one
    GPU each where there are GPUs. Rows keep their order (``preserve_order``) so an exact index
    built from them breaks ties as the evaluation does.
    """
    import ray.data

    use_gpu = gpu_available()
    nodes = alive_nodes()
    if concurrency is None and not use_gpu and nodes == 1:
        yield from embed_items(items, cfg, state, batch_size=batch_size, threads=threads,
                               node=ray.get_runtime_context().get_node_id())
        return
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    # Dispatch only once every actor has loaded the model: otherwise the first one up (its
    # node's workers already warm) embeds a small gallery alone while the others still import
    # torch, and "every node embeds" becomes a race.
    ctx.wait_for_min_actors_s = 600
    actors = max(1, concurrency or (int(ray.cluster_resources().get("GPU", 0)) if use_gpu else nodes))
    rows = items.rows()
    # Decode blocks small enough that every actor gets work, large enough to amortise a task.
    blocks = max(1, min(len(rows) // max(1, min(batch_size, 64)), 2000))
    ds = ray.data.from_items(rows, override_num_blocks=blocks)
    # Half a CPU per decode task: its own resources keep Ray Data from fusing it into the actors,
    # so files decode in tasks beside the forward passes instead of inside them. On CPUs one
    # decode task per actor keeps up (about 1 ms an image against 5 ms for the forward pass) and
    # spares the start-up of more worker processes each importing torch (measured: first batch
    # after 24 s with unbounded decode tasks on 2 cores, 8 s with one); a GPU's forward pass
    # outruns one decoder, so there Ray Data scales decoding over every CPU.
    one_per_node = actors <= nodes
    with contextlib.ExitStack() as stack:
        # On CPUs each actor's decoder sits on the actor's node: Ray Data gives a block to an
        # actor on the node holding it while that actor has room, so where the blocks decode
        # decides where they embed (all on one node when the scheduler packed the decoders there).
        decoders = ({"compute": ray.data.TaskPoolStrategy(size=None)} if use_gpu else
                    {"compute": ray.data.TaskPoolStrategy(size=actors),
                     "scheduling_strategy": stack.enter_context(_slots(actors, {"CPU": 0.5}, one_per_node))})
        ds = ds.map_batches(decode_batch, fn_kwargs={"cfg": cfg}, batch_size=64, batch_format="numpy", num_cpus=0.5,
                            **decoders)
        bundle = {"CPU": threads, **({"GPU": 1} if use_gpu else {})}
        ds = ds.map_batches(
            _RayGalleryEmbedder,
            fn_constructor_kwargs={"config": cfg.to_dict(), "state": ray.put(state),
                                   "in_channels": image_channels(items), "threads": threads},
            batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=threads, num_gpus=1 if use_gpu else 0,
            scheduling_strategy=stack.enter_context(_slots(actors, bundle, one_per_node)),
            runtime_env={"env_vars": INFERENCE_ENV},
        )
        yield from ds.iter_batches(batch_size=None, batch_format="numpy")


@contextlib.contextmanager
def _slots(count: int, bundle: dict[str, float], one_per_node: bool, timeout_s: float = 600) -> Iterator[Any]:
    """A placement group of ``count`` slots of ``bundle``, one per node where ``one_per_node``
    (else spread as evenly as Ray can); yields the scheduling strategy that puts a task or an
    actor in a free slot. Removed on exit.

    A plain SPREAD is decided on the scheduler's view of free resources, which lags: an actor
    asked for just after another job left a node sees that node full and lands beside its
    sibling. A STRICT_SPREAD group waits until every node has the room instead.
    """
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([dict(bundle)] * count, strategy="STRICT_SPREAD" if one_per_node else "SPREAD")
    try:
        if not group.wait(timeout_s):
            where = "on distinct nodes " if one_per_node else ""
            raise ClusterError(f"the cluster has no room {where}for {count} embedding slot(s) of {bundle} "
                               f"after {timeout_s:.0f} s; free resources or pass a lower --concurrency or --threads")
        yield PlacementGroupSchedulingStrategy(group)
    finally:
        remove_placement_group(group)


# -- Ray Serve: search over HTTP ---------------------------------------------------------------
SERVE_APP = "proxydml-search"


class _SearchReplica:
    """One Ray Serve replica: the service ``make`` builds (services.serve.SearchService) behind
    Serve's HTTP proxy. The blocking work (embedding, faiss, registry reads) runs in a thread,
    off the event loop."""

    def __init__(self, make: Callable[[], Any], login: list[Any], threads: int) -> None:
        if login:
            use_credentials(ray.get(login[0]))  # a reader's login is enough: serving never writes
        torch.set_num_threads(threads)
        self.service = make()

    async def __call__(self, request: Any) -> Any:
        import asyncio

        from starlette.responses import Response

        body = await request.body()
        reply = await asyncio.to_thread(self.service.handle, request.method, request.url.path,
                                        dict(request.query_params), body)
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)


def serve_http(make: Callable[[], Any], *, tracking_uri: str, port: int, replicas: int = 1, threads: int = 1) -> str:
    """Deploy ``replicas`` replicas, each answering HTTP on 127.0.0.1:``port`` with the service
    ``make()`` builds (its ``handle(method, path, query, body)`` returns a reply with ``status``,
    ``content_type`` and ``body``); returns the URL. ``make`` must be picklable (a
    functools.partial of a module-level function)."""
    from ray import serve

    login = worker_credentials() if tracking_uri.startswith(("http://", "https://")) else {}
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment = serve.deployment(_SearchReplica, name="search", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": INFERENCE_ENV}})
    serve.run(deployment.bind(make, [ray.put(login)] if login else [], threads), name=SERVE_APP, route_prefix="/")
    return f"http://127.0.0.1:{port}/"


def stop_serving() -> None:
    from ray import serve

    with contextlib.suppress(Exception):  # nothing deployed, or Ray already down
        serve.shutdown()


# -- Ray Jobs ----------------------------------------------------------------------------------
def run_job(entrypoint: str, *, address: str | None = None, env: dict[str, str] | None = None,
            follow: bool = True, poll_s: float = 1.0, out: Any = None,
            working_dir: str | None = None) -> tuple[str, str, int | None]:
    """Submit ``entrypoint`` as a Ray Job and (``follow``) stream its logs until it ends.

    ``address``: the cluster's dashboard (``http://host:8265``) or GCS address; None = RAY_ADDRESS,
    else the local running cluster. ``working_dir``: a local folder uploaded with the job (Ray's
    runtime_env): the job and every worker it starts, on any node, run in a copy of it, so recipe
    files and code edits there reach the cluster; what its .gitignore lists (.venv, runs, data)
    stays behind. Returns (submission id, final status, driver exit code); with
    ``follow=False`` the status is the one right after submission.
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
    runtime_env: dict[str, Any] = {"env_vars": env} if env else {}
    if working_dir:
        runtime_env.update(working_dir=str(Path(working_dir).resolve()), excludes=[".git"])
    # Ray answers "No available agent to submit job, please try again later" until the head
    # node's job agent has registered (seconds after start, longer on a loaded machine).
    deadline = time.monotonic() + 90
    while True:
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env or None)
            break
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)
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
