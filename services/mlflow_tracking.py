"""MLflow adapter: the driver opens (or re-opens) one run per training run; rank 0 logs to it.

A run is found again by its ``ray_run_name`` tag, so starting the same training run twice
(a resume) appends to the same MLflow run instead of creating a second one.

On a server with authentication (``services/auth.py``) the login comes from the environment
or ``~/.mlflow/credentials``, never from the config; a 401/403 becomes one
:class:`services.auth.AuthError` naming the user and the missing permission, and is never
retried as an outage.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

# MLflow 3 reports telemetry by default; training clusters must not talk to the outside.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402
import requests  # noqa: E402
from mlflow.entities import Metric, Param, Run, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from pipelines.config import Config, ConfigError  # noqa: E402
from services import auth  # noqa: E402
from services.uris import redact  # noqa: E402

T = TypeVar("T")
# MLflow caps a param value at 6000 characters and a batch at 100 params.
_PARAM_BATCH = 100


def local_store(root: Path | None = None) -> tuple[str, str]:
    """(tracking URI, artifact root) of the embedded default: sqlite + files under ./mlruns."""
    root = (root or Path.cwd() / "mlruns").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


def resolve_tracking_uri(explicit: str | None = None) -> str:
    """The MLflow tracking URI: ``explicit`` (a --tracking-uri flag, ``tracking.tracking_uri``),
    else $MLFLOW_TRACKING_URI, else the local sqlite store (:func:`local_store`).

    A URI carrying a password (``http://user:pw@host``) is refused: the URI is a run param, a
    Ray train-loop setting and a report line, so the password would be logged with them.
    """
    uri = explicit or os.environ.get("MLFLOW_TRACKING_URI") or local_store()[0]
    if uri.startswith(("http://", "https://")) and "@" in uri.split("/", 3)[2]:
        raise ConfigError(f"tracking URI {redact(uri)} carries a login; it would be logged with the run: "
                          f"give the URI without it and the login apart ({auth.CREDENTIALS_HINT})")
    return uri


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


def experiment_needs(name: str) -> tuple[auth.Need, auth.Need, auth.Need]:
    """(read, create, log) permissions of experiment ``name``, for :func:`services.auth.guard`."""
    quoted = f"experiment {name!r}"
    return (auth.Need("READ", quoted, "find its runs", "--role reader"),
            auth.Need("workspace USE (role trainer or maintainer)", "the MLflow workspace",
                      f"create the missing {quoted}", "--role trainer"),
            auth.Need("EDIT", quoted, "create and update runs in it", f"--role trainer --experiment {name}"))


def check_can_log(cfg: Config, uri: str) -> str:
    """The id of ``cfg``'s experiment (created when missing), once this login may create runs
    in it; else :class:`services.auth.AuthError`. Cheap: call it before a Ray cluster starts."""
    client = MlflowClient(uri)
    read, create, log = experiment_needs(cfg.experiment_name())
    with auth.guard(uri, read):
        exists = client.get_experiment_by_name(cfg.experiment_name()) is not None
    with auth.guard(uri, read if exists else create):
        exp_id = ensure_experiment(client, cfg.experiment_name(), uri)
    auth.require_permission(uri, "experiment", exp_id, "EDIT", log)
    return exp_id


def find_run(client: MlflowClient, exp_id: str, cfg: Config) -> Run | None:
    """The MLflow run of ``cfg`` in experiment ``exp_id``, found by its ``ray_run_name`` tag
    (the run name Ray resumes by), or None."""
    found = client.search_runs([exp_id], filter_string=f"tags.ray_run_name = '{cfg.run_name()}'", max_results=1)
    return found[0] if found else None


def _lookup(client: MlflowClient, cfg: Config) -> Run | None:
    exp = call_with_retries(lambda: client.get_experiment_by_name(cfg.experiment_name()))
    return find_run(client, exp.experiment_id, cfg) if exp is not None else None


def run_of(cfg: Config, uri: str) -> Run | None:
    """The MLflow run of ``cfg`` (looked up by :func:`find_run` in its experiment), or None
    when neither exists yet. Needs READ on the experiment only."""
    with auth.guard(uri, experiment_needs(cfg.experiment_name())[0]):
        return _lookup(MlflowClient(uri), cfg)


def finished_training(cfg: Config, uri: str) -> tuple[Run, dict[str, float]] | None:
    """``cfg``'s run when it FINISHED with at least ``cfg.train.epochs`` epochs trained: (the run,
    its last epoch's metrics from the final checkpoint's trainer_state.json, the record the run
    logged as ``checkpoint/``). None when there is more to train or no such record."""
    client = MlflowClient(uri)
    with auth.guard(uri, experiment_needs(cfg.experiment_name())[0]), \
            tempfile.TemporaryDirectory(prefix="proxydml-state-") as tmp:
        run = _lookup(client, cfg)
        if run is None or run.info.status != "FINISHED" or "ray_checkpoint_path" not in run.data.tags:
            return None
        try:
            state = json.loads(Path(client.download_artifacts(
                run.info.run_id, "checkpoint/trainer_state.json", tmp)).read_text())
        except (mlflow.exceptions.MlflowException, OSError):
            return None  # no final checkpoint recorded with the run
    if state.get("epoch", 0) < cfg.train.epochs or not state.get("history"):
        return None
    return run, state["history"][-1]


def ended_trial(cfg: Config, uri: str) -> dict[str, float] | None:
    """Where sweep trial ``cfg`` ended, if its run says it did: the run's last metrics and
    ``epoch`` (the last one when the run FINISHED, the one ASHA stopped it at: tag
    ``asha.epoch``). None when the trial has no run yet or is still to go on."""
    run = run_of(cfg, uri)
    epoch = trial_end_epoch(run, cfg.train.epochs) if run is not None else None
    return None if epoch is None else {**run.data.metrics, "epoch": epoch}


def trial_end_epoch(run: Run, epochs: int) -> int | None:
    """The epoch sweep trial ``run`` ended at: the one ASHA stopped it at (``asha.epoch``), or
    ``epochs`` when it FINISHED. None while it has not ended."""
    stop = asha_stop(run.data.tags)
    if stop:
        return int(stop.get("epoch", stop["rung"]))
    return epochs if run.info.status == "FINISHED" else None


def asha_stop(tags: dict[str, str]) -> dict[str, float]:
    """The ``asha.*`` tags of a trial's run (see :func:`record_asha_stop`) as numbers; empty
    when ASHA did not stop it."""
    return {k.removeprefix("asha."): float(v) for k, v in tags.items() if k.startswith("asha.")}


def open_run(cfg: Config, uri: str | None = None, extra_tags: dict[str, str] | None = None) -> tuple[str, bool]:
    """Find the run tagged with this run name or create it. Returns (run_id, resumed).

    Raises :class:`services.auth.AuthError` when the login may not read, create or log into the
    experiment -- checked before the first write, so a refused login leaves no half-made run.
    """
    uri = uri or resolve_tracking_uri(cfg.tracking.tracking_uri)
    client = MlflowClient(uri)
    exp_id = check_can_log(cfg, uri)
    read, _, log = experiment_needs(cfg.experiment_name())
    with auth.guard(uri, read):
        found = find_run(client, exp_id, cfg)
    with auth.guard(uri, log):
        if found:
            run_id = found.info.run_id
            client.update_run(run_id, status="RUNNING")
            client.set_tag(run_id, "world_size", str(cfg.scaling.num_workers))
            return run_id, True
        run = call_with_retries(lambda: client.create_run(exp_id, run_name=cfg.run_name(),
                                                          tags={**run_tags(cfg), **(extra_tags or {})}))
        params = [Param(k, _param_value(v)) for k, v in cfg.flat().items()]
        for i in range(0, len(params), _PARAM_BATCH):
            # Re-logging an identical param is accepted, so a retry after a lost reply is harmless.
            call_with_retries(lambda i=i: client.log_batch(run.info.run_id, params=params[i : i + _PARAM_BATCH]))
    return run.info.run_id, False


def _param_value(value: Any) -> str:
    return "" if value is None else str(value)


# A busy store that the server reports as a client error (400) although retrying succeeds:
# SQLAlchemy's pool ran dry, sqlite's one writer lock, a database restarting or full of
# connections. Anything else answered 4xx is the request's own fault and is not retried.
BUSY_STORE_MESSAGES = ("QueuePool limit", "database is locked", "could not connect to server",
                       "connection to server", "server closed the connection", "too many clients",
                       "the database system is starting up", "the database system is shutting down")
_RETRYABLE_STATUS = (408, 429)


def retryable(exc: BaseException) -> bool:
    """Whether a failed tracking call may succeed if repeated: the server unreachable, 408,
    429, 5xx, or a busy store (:data:`BUSY_STORE_MESSAGES`) even when labelled 400. Never a
    refused login (401/403)."""
    if auth.auth_status(exc) is not None:
        return False
    if isinstance(exc, mlflow.exceptions.MlflowException):
        status = exc.get_http_status_code()
        if status in _RETRYABLE_STATUS or status >= 500:
            return True
        text = str(exc)
        return any(m in text for m in BUSY_STORE_MESSAGES)
    return isinstance(exc, (OSError, requests.exceptions.RequestException))


def call_with_retries(fn: Callable[[], T], *, attempts: int = 12, max_backoff_s: float = 10.0) -> T:
    """``fn()``, repeated with exponential backoff and jitter while it fails with a
    :func:`retryable` error; the last error is raised, never swallowed (a write is reported
    done only once the server confirmed it)."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if i == attempts - 1 or not retryable(exc):
                raise
            # Jitter: many writers refused together must not come back together.
            time.sleep(min(0.25 * 2.0**i, max_backoff_s) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def end_run(run_id: str, uri: str, status: str, attempts: int = 30) -> None:
    """Close the run; retried so that a blinking server never leaves it RUNNING (a 401/403 is
    not an outage: it raises :class:`services.auth.AuthError` at once)."""
    with auth.guard(uri, auth.Need("EDIT", f"run {run_id}", "close it")):
        call_with_retries(lambda: MlflowClient(uri).set_terminated(run_id, status=status), attempts=attempts)


def record_exploit(run_id: str, uri: str, record: dict[str, Any]) -> int:
    """Add one population-based-training exploit to a trial's run: tag ``pbt.exploit.N`` (JSON:
    the trial cloned, the epoch, the new and the cloned values), ``pbt.exploits`` = N and
    ``pbt.cloned_from``. Returns N."""
    client = MlflowClient(uri)
    with auth.guard(uri, auth.Need("EDIT", f"run {run_id}", "record a PBT exploit")):
        tags = call_with_retries(lambda: client.get_run(run_id)).data.tags
        n = int(tags.get("pbt.exploits", "0")) + 1
        call_with_retries(lambda: client.log_batch(run_id, tags=[
            RunTag(f"pbt.exploit.{n}", json.dumps(record, sort_keys=True, default=str)),
            RunTag("pbt.exploits", str(n)), RunTag("pbt.cloned_from", str(record["from_trial"]))]))
    return n


ASHA_TAGS = ("rung", "epoch", "value", "cutoff", "rung_trials")


def record_asha_stop(uri: str, parent_run_id: str, trial_id: str, judged: dict[str, float]) -> None:
    """Tag the run of sweep trial ``trial_id`` with why ASHA stopped it: ``asha.rung`` (the
    rung's epoch), ``asha.epoch`` (the epoch of the result judged: the rung's, or later for a
    trial restored by a resumed sweep), ``asha.value`` (its metric then), ``asha.cutoff`` (the
    rung's cutoff it fell below) and ``asha.rung_trials`` (the values that cutoff was taken over)."""
    client = MlflowClient(uri)
    with auth.guard(uri, auth.Need("EDIT", f"trial {trial_id}", "record an ASHA stop")):
        exp_id = call_with_retries(lambda: client.get_run(parent_run_id)).info.experiment_id
        found = call_with_retries(lambda: client.search_runs(
            [exp_id], f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.trial_id = '{trial_id}'", max_results=1))
        if not found:
            raise LookupError(f"no run of trial {trial_id} under sweep run {parent_run_id}")
        if "asha.rung" in found[0].data.tags:
            return  # judged again after a resume, on a replay of where it ended: the first stop stands
        call_with_retries(lambda: client.log_batch(found[0].info.run_id, tags=[
            # Counts as integers, values as repr: the float read back is the one ASHA compared.
            RunTag(f"asha.{k}", str(int(judged[k])) if k in ("rung", "epoch", "rung_trials") else repr(judged[k]))
            for k in ASHA_TAGS]))


def log_pytorch_model(run_id: str, uri: str, checkpoint: Path) -> None:
    """Log the trained embedder with ``mlflow.pytorch`` and a signature, ready to register."""
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from pipelines.train import load_model

    _, model, split = load_model(checkpoint)
    example = torch.stack([split.test[i][0] for i in range(min(2, len(split.test)))])
    with torch.no_grad():
        output = model(example)
    signature = infer_signature(example.numpy(), output.numpy())
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run_id):
        # Explicit requirements: inferring them imports the whole environment (slow, noisy).
        mlflow.pytorch.log_model(
            model, name="model", signature=signature, input_example=example.numpy(),
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "proxydml"],
        )


class MlflowTracker:
    """The pipeline's Tracker protocol on an existing MLflow run, tolerant of outages.

    Every record goes through an ordered queue drained by one background thread. When the
    tracking server (or the artifact store behind it) is unreachable the thread keeps the
    record, warns once, and retries with exponential backoff, so training never waits on
    MLflow and nothing is lost. Re-sending a metric is harmless: the store ignores a metric
    identical in (key, value, timestamp, step), so a retry after a lost reply adds no
    duplicate. ``flush()`` waits until everything is delivered.

    A 401 or 403 is not an outage: waiting does not give a login its permission back. The
    tracker warns once, drops that record and every later one without sending it, and
    ``flush()`` raises the :class:`services.auth.AuthError` (``failure``).
    """

    def __init__(self, run_id: str, uri: str, *, max_backoff_s: float = 10.0,
                 spool_dir: Path | None = None) -> None:
        self.run_id = run_id
        self.client = MlflowClient(uri)
        self.max_backoff_s = max_backoff_s
        self._spool = Path(spool_dir or tempfile.mkdtemp(prefix="proxydml-mlflow-spool-"))
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._outage_since: float | None = None
        self._logged: set[tuple[str, int]] | None = None  # (key, step) already in the run
        self.uri = uri
        self.failure: auth.AuthError | None = None  # set by the first 401/403; then records are dropped
        self.refused: list[str] = []  # records the server rejected for good (not retryable)
        self.delivered = 0
        self._thread = threading.Thread(target=self._drain, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # -- Tracker protocol ---------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)  # fixed now, so a re-send is an identical record
        self._queue.put(("metrics", [Metric(k, float(v), ts, step) for k, v in metrics.items()]))

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        # Copy first: the caller's folder is usually a temporary one that vanishes.
        dest = self._spool / f"{time.monotonic_ns()}"
        shutil.copytree(local_dir, dest)
        self._queue.put(("artifacts", (dest, artifact_path)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._queue.put(("tags", [RunTag(k, str(v)) for k, v in tags.items()]))

    # -- delivery -------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued record is delivered (True) or ``timeout`` passes (False).

        Raises :attr:`failure` when the server refused the login (the records were dropped).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        if self.failure is not None:
            raise self.failure
        if self.refused:
            raise RuntimeError(f"{len(self.refused)} MLflow record(s) were refused by the server and not logged; "
                               f"first: {self.refused[0]}")
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (False when not everything was delivered, refusals included) and stop."""
        try:
            done = self.flush(timeout)
        except (auth.AuthError, RuntimeError):
            done = False
        self._queue.put(None)
        if done:
            shutil.rmtree(self._spool, ignore_errors=True)
        return done

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def _already_logged(self) -> set[tuple[str, int]]:
        """(key, step) pairs the run holds: a worker restarted from an older checkpoint
        recomputes epochs it had already logged, and those must not appear twice."""
        if self._logged is None:
            logged: set[tuple[str, int]] = set()
            for key in self.client.get_run(self.run_id).data.metrics:
                logged.update((key, m.step) for m in self.client.get_metric_history(self.run_id, key))
            self._logged = logged
        return self._logged

    def _send(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            logged = self._already_logged()
            fresh = [m for m in payload if (m.key, m.step) not in logged]
            if fresh:
                self.client.log_batch(self.run_id, metrics=fresh)
            logged.update((m.key, m.step) for m in fresh)
        elif kind == "tags":
            self.client.log_batch(self.run_id, tags=payload)
        else:
            folder, artifact_path = payload
            self.client.log_artifacts(self.run_id, str(folder), artifact_path)
            shutil.rmtree(folder, ignore_errors=True)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            backoff = 0.5
            delivered = False
            while self.failure is None:
                try:
                    self._send(*item)
                    delivered = True
                    break
                except Exception as exc:  # network errors come in many types; retry them...
                    status = auth.auth_status(exc)
                    if status is not None:  # ...but a refused login: no retry, drop (see class doc)
                        self.failure = auth.refusal(status, self.uri, auth.Need(
                            "EDIT", f"the experiment of run {self.run_id}", "log metrics, tags and artifacts to it"))
                        warnings.warn(f"{self.failure}; this and later MLflow records are dropped, not retried",
                                      stacklevel=1)
                        break
                    if not retryable(exc):  # ...and a request the server rejects for good
                        self.refused.append(f"{item[0]}: {type(exc).__name__}: {str(exc)[:300]}")
                        warnings.warn(f"MLflow refused a {item[0]} record ({str(exc)[:200]}); it is not logged",
                                      stacklevel=1)
                        break
                    if self._outage_since is None:
                        self._outage_since = time.monotonic()
                        warnings.warn(
                            f"MLflow unreachable ({type(exc).__name__}: {str(exc)[:200]}); training "
                            f"continues and {self.pending()} record(s) are buffered and retried",
                            stacklevel=1,
                        )
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
            if not delivered:  # dropped: nothing was delivered
                if item[0] == "artifacts":
                    shutil.rmtree(item[1][0], ignore_errors=True)  # its spooled copy
                self._queue.task_done()
                continue
            if self._outage_since is not None:
                down = time.monotonic() - self._outage_since
                self._outage_since = None
                warnings.warn(f"MLflow reachable again after {down:.0f}s; buffered records delivered",
                              stacklevel=1)
            self.delivered += 1
            self._queue.task_done()
