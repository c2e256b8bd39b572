"""Hyper-parameter sweeps: the MLflow parent run, the trial runs' status, the report.

The search space and its validation live in ``services/search_space.py``; Ray Tune itself is
driven from ``services/runtime.py``. This module never imports Ray.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config import Config, ConfigError
from services.console import SweepProgress
from services.search_space import SEARCH_DIR, Dimension, SweepSpec, apply, load_sweep, resolve_space_file

# SEARCH_DIR and load_sweep stay importable from here for callers of ``services.sweep``.
__all__ = ["SEARCH_DIR", "SweepOutcome", "best_config", "close_trial_runs", "finish_parent_run", "load_sweep",
           "open_parent_run", "run_sweep", "write_sweep_plots"]


# A trial run that the sweep lost: its driver was killed while the trial trained, before Tune's
# saved state recorded the trial, so the resumed sweep ran another in its place. Tagged, closed
# KILLED, and left out of the sweep's trials (its page, its count).
LOST_TAG = "sweep_lost"


# -- MLflow ------------------------------------------------------------------------------------
def open_parent_run(spec: SweepSpec, uri: str, space_file: Path) -> tuple[str, bool]:
    """The sweep's parent run (found again by its name on resume). Returns (run_id, resumed)."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from services.mlflow_tracking import ensure_experiment, git_sha

    client = MlflowClient(uri)
    exp_id = ensure_experiment(client, spec.base.experiment_name(), uri)
    name = spec.name()
    found = client.search_runs([exp_id], filter_string=f"tags.sweep_name = '{name}' and tags.kind = 'sweep'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id, True
    run = client.create_run(exp_id, run_name=name, tags={
        "sweep_name": name, "dataset": spec.base.data.name, "loss": spec.base.loss.name,
        "git_sha": git_sha(), "kind": "sweep", "metric": spec.metric, "mode": spec.mode,
    })
    params = [Param("sweep.samples", str(spec.samples)), Param("sweep.scheduler", spec.scheduler),
              Param("sweep.search", spec.search), Param("sweep.max_concurrent", str(spec.max_concurrent))]
    params += [Param(f"space.{d.key}", d.describe()) for d in spec.space]
    if spec.warm_start:
        params += [Param("sweep.warm_start", spec.warm_start), Param("sweep.warm_start_points", str(len(spec.evaluated)))]
    client.log_batch(run.info.run_id, params=params)
    client.log_artifact(run.info.run_id, str(space_file), "sweep")
    return run.info.run_id, False


def close_trial_runs(spec: SweepSpec, uri: str, parent_id: str, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set each child run's final status from Tune's view of the trial.

    Tune tears a trial down as soon as it stops it (ASHA, or max_t reached), usually before
    the trial's own code can close its run: FINISHED = all epochs, KILLED = stopped early.

    A run of this sweep that Tune does not know (its driver was killed before the saved state
    held the trial) is adopted when the trial had ended (it finished, or ASHA stopped it): it
    is returned as one more trial. One that was still training is lost (:data:`LOST_TAG`).
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    by_trial = {t["trial_id"]: t for t in trials}
    adopted = []
    exp_id = client.get_run(parent_id).info.experiment_id
    for child in client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                    max_results=50_000):
        tags = child.data.tags
        trial = by_trial.get(tags.get("trial_id", ""))
        if trial is None and tags.get("sweep_name") == spec.name() and LOST_TAG not in tags:
            trial = _ended_orphan(spec, child)
            if trial is None:
                client.set_tag(child.info.run_id, LOST_TAG, "true")
                if child.info.status == "RUNNING":
                    client.set_terminated(child.info.run_id, status="KILLED")
                continue
            adopted.append(trial)
        if trial is None:
            continue
        if trial["error"]:
            status = "FAILED"
        elif trial["epochs"] is not None and trial["epochs"] >= spec.base.train.epochs:
            status = "FINISHED"
        else:
            status = "KILLED"
            client.set_tag(child.info.run_id, "stopped_early", "true")
        client.set_tag(child.info.run_id, "tune_epochs", str(trial["epochs"]))
        client.set_terminated(child.info.run_id, status=status)
    return adopted


def _ended_orphan(spec: SweepSpec, run: Any) -> dict[str, Any] | None:
    """The trial record of a run Tune lost that had ended (FINISHED, or stopped by ASHA: its
    ``asha.*`` tags), as :func:`runtime.tune_sweep` reports trials; None if it had not."""
    from services.mlflow_tracking import asha_stop, trial_end_epoch

    epochs = trial_end_epoch(run, spec.base.train.epochs)
    if epochs is None:
        return None
    tags, params = run.data.tags, run.data.params
    return {"trial_id": tags["trial_id"], "params": {d.key: d.value_of(params[d.key]) for d in spec.space},
            "metric": run.data.metrics.get(spec.metric), "epochs": epochs, "error": None,
            "asha": asha_stop(tags) or None}


def finish_parent_run(spec: SweepSpec, uri: str, parent_id: str, trials: list[dict[str, Any]],
                      searcher_trials: int | None = None) -> Config | None:
    """Log the best config and the sweep report on the parent; returns the best config.
    ``searcher_trials``: the trials the searcher knew at the end (tag ``searcher_trials``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if searcher_trials is not None:
        client.set_tag(parent_id, "searcher_trials", str(searcher_trials))
    scored = [t for t in trials if t.get("metric") is not None and math.isfinite(t["metric"])]
    best_cfg = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if scored:
            best = max(scored, key=lambda t: t["metric"]) if spec.mode == "max" else min(scored, key=lambda t: t["metric"])
            best_cfg = apply(spec.base, best["params"])
            best_cfg.tracking.run_name = ""
            (folder / "best_config.yaml").write_text(best_cfg.to_yaml())
            client.set_tag(parent_id, "best_trial", best["trial_id"])
            client.log_metric(parent_id, f"best_{spec.metric}", best["metric"])
            write_sweep_plots(spec.name(), spec.space, spec.metric, scored, folder)
        (folder / "trials.json").write_text(json.dumps(trials, indent=2, default=str))
        client.log_artifacts(parent_id, str(folder), "sweep")
    return best_cfg


def write_sweep_plots(title: str, dims: Sequence[Dimension], metric_name: str, trials: list[dict[str, Any]],
                      folder: Path) -> list[Path]:
    """Parallel coordinates of every trial, and the metric against each parameter.

    ``trials``: dicts with ``params`` (key -> value) and ``metric``; ``stopped`` true draws the
    trial dashed (stopped early: its metric is from an earlier epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = [d.key for d in dims]
    metric = np.array([t["metric"] for t in trials], dtype=float)

    def column(dim: Dimension) -> np.ndarray:
        values = [t["params"].get(dim.key) for t in trials]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return np.array(values, dtype=float)
        cats = sorted({str(v) for v in values})
        return np.array([cats.index(str(v)) for v in values], dtype=float)

    cols = [column(d) for d in dims] + [metric]
    # A log-uniform key spreads its trials over its decades, so its axis does too.
    axes_cols = [np.log10(c) if d.kind == "loguniform" else c for d, c in zip(dims, cols)] + [metric]
    names = keys + [metric_name]
    scaled = [(c - c.min()) / (c.max() - c.min()) if c.max() > c.min() else np.full_like(c, 0.5) for c in axes_cols]
    fig, ax = plt.subplots(figsize=(2.2 * len(names) + 2, 4.5))
    cmap = plt.get_cmap("viridis")
    order = (metric - metric.min()) / (metric.max() - metric.min() + 1e-12)
    for i, trial in enumerate(trials):
        ax.plot(range(len(names)), [s[i] for s in scaled], color=cmap(order[i]), alpha=0.85,
                lw=1 if trial.get("stopped") else 2, ls="--" if trial.get("stopped") else "-")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_yticks([])
    stopped = sum(bool(t.get("stopped")) for t in trials)
    ax.set_title(f"{title}: {len(trials)} trials, colour = {metric_name}"
                 + (f", dashed = stopped early ({stopped})" if stopped else ""))
    for x in range(len(names)):
        ax.axvline(x, color="grey", lw=0.5)
    fig.tight_layout()
    out = [folder / "parallel_coordinates.png"]
    fig.savefig(out[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, dim, col in zip(axes[0], dims, cols[:-1]):
        ax.scatter(col, metric, c=metric, cmap="viridis", s=40)
        if abs(col.std()) > 0 and abs(metric.std()) > 0:
            r = float(np.corrcoef(col, metric)[0, 1])
            ax.set_title(f"{dim.key} (r={r:+.2f})")
        else:
            ax.set_title(dim.key)
        if dim.kind == "loguniform":
            ax.set_xscale("log")
        ax.set_ylabel(metric_name)
    fig.tight_layout()
    out.append(folder / "parameter_scatter.png")
    fig.savefig(out[1], dpi=110)
    plt.close(fig)
    return out


def _sweep_file(name: str, uri: str, path: str, missing: str) -> tuple[str, dict[str, str]]:
    """A file of sweep ``name``'s report (``sweep/...`` on its parent run) and the parent's tags."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise FileNotFoundError(f"no sweep named {name!r} in {uri}")  # (and no empty store made by asking)
    client = MlflowClient(uri)
    exp_ids = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(exp_ids, filter_string=f"tags.sweep_name = '{name}' and tags.kind = 'sweep'", max_results=1)
    if not found:
        raise FileNotFoundError(f"no sweep named {name!r} in {uri}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(found[0].info.run_id, path, tmp)
        except Exception as exc:
            raise FileNotFoundError(f"sweep {name!r} {missing}") from exc
        return Path(local).read_text(), found[0].data.tags


def best_config(name: str, uri: str) -> str:
    """The best trial's config of sweep ``name`` as YAML (from its parent run)."""
    return _sweep_file(name, uri, "sweep/best_config.yaml", "has no best config yet (no finished trial)")[0]


def scored_trials(name: str, uri: str, metric: str) -> list[tuple[dict[str, Any], float]]:
    """Sweep ``name``'s scored trials as (point, score), best first; a :class:`ConfigError` when
    it was scored on another metric than ``metric``."""
    text, tags = _sweep_file(name, uri, "sweep/trials.json", "has no trials report yet (it never finished)")
    if tags.get("metric", metric) != metric:
        raise ConfigError(f"sweep {name!r} was scored on {tags['metric']}, this sweep on {metric} (--metric)")
    trials = [(t["params"], float(t["metric"])) for t in json.loads(text)
              if t.get("metric") is not None and math.isfinite(float(t["metric"]))]
    return sorted(trials, key=lambda pv: -pv[1])  # retrieval metrics: higher is better (SweepSpec.mode)


@dataclass
class SweepOutcome:
    name: str
    parent_run_id: str
    trials: list[dict[str, Any]]
    best: Config | None
    resumed: bool


def run_sweep(
    base: Config, space: str | Path, *, samples: int = 8, scheduler: str = "asha", search: str = "optuna",
    max_concurrent: int | None = None, metric: str = "map_at_r", address: str | None = None,
    grace_period: int | None = None, reduction_factor: int = 2, points: list[dict[str, Any]] | None = None,
    include_base: bool = False, on_progress: Callable[[SweepProgress, bool], None] | None = None,
    warm_start: str | None = None, start_from_best: bool = False,
) -> SweepOutcome:
    """Validate, open (or reopen) the parent run, run the Tuner, log the report. ``on_progress``:
    called with the sweep's :class:`~services.console.SweepProgress` as it goes (True: the end).

    ``warm_start``: an earlier sweep (same tracking server) whose scored trials the searcher is
    told before it suggests anything; ``start_from_best``: its best point is the first trial."""
    # Imported here for start-up time: Ray (runtime) takes seconds to import, and
    # ``tune best`` and ``retrain --from-sweep`` only read MLflow through this module.
    from services import mlflow_tracking as mt
    from services import runtime
    from services.cluster import require_shared_state
    from services.training import preflight, resolve_for_workers

    base = resolve_for_workers(base, sweep=True)
    if start_from_best and not warm_start:
        raise ConfigError("--start-from-best needs --warm-start SWEEP (the sweep whose best point starts)")
    evaluated = None
    if warm_start:
        try:
            evaluated = scored_trials(warm_start, mt.resolve_tracking_uri(base.tracking.tracking_uri), metric)
        except FileNotFoundError as exc:
            raise ConfigError(f"--warm-start: {exc}") from exc
        if start_from_best and evaluated:
            points = [evaluated[0][0], *(points or [])]
    preflight(base)
    space_file = resolve_space_file(space)
    # Schema and domain errors first, before a cluster is even started.
    load_sweep(base, space_file, samples=samples, scheduler=scheduler, search=search,
               max_concurrent=None, cluster_cpus=math.inf, metric=metric, grace_period=grace_period,
               reduction_factor=reduction_factor, points=points, include_base=include_base,
               evaluated=evaluated, warm_start=warm_start or "")
    mt.check_can_log(base, mt.resolve_tracking_uri(base.tracking.tracking_uri))  # before Ray: a refused login
    runtime.ensure_ray(address)
    uri = mt.resolve_tracking_uri(base.tracking.tracking_uri)
    # Before the parent run exists: a node-local setting on a multi-node cluster leaves nothing.
    require_shared_state(base, uri, runtime.alive_nodes())
    spec = load_sweep(base, space_file, samples=samples, scheduler=scheduler, search=search,
                      max_concurrent=max_concurrent, cluster_cpus=runtime.cluster_cpus(), metric=metric,
                      grace_period=grace_period, reduction_factor=reduction_factor, points=points,
                      include_base=include_base, evaluated=evaluated, warm_start=warm_start or "")
    parent_id, resumed = open_parent_run(spec, uri, space_file)
    status = "FAILED"
    try:
        trials, searcher_trials = runtime.tune_sweep(spec, parent_run_id=parent_id, mlflow_uri=uri,
                                                     storage_root=base.tracking.storage_path or "runs",
                                                     on_progress=on_progress)
        trials += close_trial_runs(spec, uri, parent_id, trials)
        best = finish_parent_run(spec, uri, parent_id, trials, searcher_trials)
        status = "FINISHED"
        return SweepOutcome(spec.name(), parent_id, trials, best, resumed)
    finally:
        mt.end_run(parent_id, uri, status)
