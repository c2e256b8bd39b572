"""Hyper-parameter sweeps: search-space files, validation, the MLflow parent run, the report.

A space file maps dotted config keys (the same names as CLI overrides and MLflow params) to
one of a tiny vocabulary::

    loss.temperature: {loguniform: [0.02, 0.5]}
    synthesis.alpha:  {uniform: [0.1, 1.0]}
    loss.name:        {choice: [norm_softmax, proxy_nca_pp]}
    train.seed:       {randint: [0, 10]}
    optim.lr:         {grid: [1.0e-4, 1.0e-3]}

Everything is checked against the config schema before a single trial starts. Ray itself is
driven from ``services/runtime.py``; this module never imports Ray.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines.config import CONFIG_DIR, Config, ConfigError, find_yaml, from_dict, merge
from pipelines.evaluate import is_retrieval_metric

DOMAINS = ("loguniform", "uniform", "choice", "randint", "grid")
SEARCH_DIR = CONFIG_DIR / "search"


@dataclass(frozen=True)
class Dimension:
    key: str
    kind: str
    values: tuple[Any, ...]


@dataclass
class SweepSpec:
    """A validated sweep: base config, dimensions, and how to search them."""

    base: Config
    space: list[Dimension]
    samples: int
    scheduler: str
    search: str
    max_concurrent: int
    metric: str = "map_at_r"
    mode: str = "max"
    # ASHA's first rung (epochs) and the fraction 1/reduction_factor promoted at each rung.
    grace_period: int = 1
    reduction_factor: int = 2
    # Configs (dotted key -> value) run first, before any sampling: two sweeps given the same
    # points compare schedulers on identical trials (tests/benchmarks/bench_tune.py).
    points: tuple[dict[str, Any], ...] = ()

    def name(self) -> str:
        """Deterministic sweep name: re-running the same command resumes the same sweep."""
        fields: dict[str, Any] = {
            "base": self.base.experiment_hash(), "epochs": self.base.train.epochs,
            "space": [(d.key, d.kind, d.values) for d in self.space], "samples": self.samples,
            "scheduler": self.scheduler, "search": self.search, "metric": self.metric,
        }
        # Only when set: the names (and so the resumability) of existing sweeps stay as they were.
        if (self.grace_period, self.reduction_factor) != (1, 2):
            fields["asha"] = [self.grace_period, self.reduction_factor]
        if self.points:
            fields["points"] = [sorted(p.items()) for p in self.points]
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return f"sweep-{self.base.data.name}-{self.base.loss.name}-{hashlib.sha256(blob).hexdigest()[:8]}"


def resolve_space_file(space: str | Path) -> Path:
    return find_yaml(space, SEARCH_DIR, "search space", "shipped spaces")


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return nested


def apply(base: Config, flat: dict[str, Any]) -> Config:
    """``base`` with dotted ``flat`` values applied, validated."""
    return from_dict(merge(base.to_dict(), _nest(flat)))


def parse_space(raw: Any, base: Config, source: str = "space") -> list[Dimension]:
    """Validate a space mapping against the config schema; errors name the key."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a non-empty mapping of dotted config keys")
    known = set(base.flat())
    dims: list[Dimension] = []
    for key, spec in raw.items():
        if key not in known:
            raise ConfigError(f"{source}: {key!r} is not a config field")
        if not isinstance(spec, dict) or len(spec) != 1:
            raise ConfigError(f"{source}: {key} must be one of {{{', '.join(DOMAINS)}: [...]}}")
        ((kind, values),) = spec.items()
        if kind not in DOMAINS:
            raise ConfigError(f"{source}: {key}: unknown domain {kind!r}; use one of {', '.join(DOMAINS)}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{source}: {key}: {kind} needs a non-empty list")
        if kind in ("loguniform", "uniform", "randint"):
            if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values):
                raise ConfigError(f"{source}: {key}: {kind} needs [low, high]")
            low, high = values
            if not low < high:
                raise ConfigError(f"{source}: {key}: {kind} needs low < high, got {values}")
            if kind == "loguniform" and low <= 0:
                raise ConfigError(f"{source}: {key}: loguniform needs low > 0, got {low}")
            # Both ends must be valid values (randint's high is exclusive).
            probes = [low, high if kind != "randint" else high - 1]
        else:
            probes = list(values)
        for value in probes:
            try:
                apply(base, {key: value})
            except ConfigError as exc:
                raise ConfigError(f"{source}: {key}={value!r} is outside the valid domain: {exc}") from exc
        dims.append(Dimension(key, kind, tuple(values)))
    return dims


def load_sweep(
    base: Config, space: str | Path, *, samples: int, scheduler: str, search: str,
    max_concurrent: int | None, cluster_cpus: float, metric: str = "map_at_r",
    grace_period: int = 1, reduction_factor: int = 2, points: list[dict[str, Any]] | None = None,
) -> SweepSpec:
    """Build and check a sweep before anything starts."""
    path = resolve_space_file(space)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    dims = parse_space(raw, base, source=str(path.name))
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    if scheduler not in ("asha", "none"):
        raise ConfigError(f"--scheduler must be asha or none, got {scheduler!r}")
    if search not in ("optuna", "random", "grid"):
        raise ConfigError(f"--search must be optuna, random or grid, got {search!r}")
    has_grid = any(d.kind == "grid" for d in dims)
    if search == "optuna" and has_grid:
        raise ConfigError("grid dimensions need --search grid or random (Optuna samples, it does not grid)")
    if search == "grid" and not all(d.kind in ("grid", "choice") for d in dims):
        raise ConfigError("--search grid needs every dimension to be a grid or a choice")
    per_trial = base.scaling.num_workers * base.scaling.cpus_per_worker
    fits = int(cluster_cpus // per_trial) if math.isfinite(cluster_cpus) else samples
    if fits < 1:
        raise ConfigError(
            f"one trial needs {per_trial:g} CPUs ({base.scaling.num_workers} workers x "
            f"{base.scaling.cpus_per_worker:g}) but the cluster has {cluster_cpus:g}"
        )
    if max_concurrent is None:
        max_concurrent = max(1, min(fits, samples))
    elif max_concurrent < 1:
        raise ConfigError(f"--max-concurrent must be >= 1, got {max_concurrent}")
    elif max_concurrent > fits:
        raise ConfigError(
            f"--max-concurrent {max_concurrent} trials need {max_concurrent * per_trial:g} CPUs; "
            f"the cluster holds {fits} trial(s) of {per_trial:g} CPUs ({cluster_cpus:g} CPUs)"
        )
    if not is_retrieval_metric(metric):
        raise ConfigError(f"--metric {metric!r} is not a reported retrieval metric")
    if base.train.eval_every != 1:
        raise ConfigError(f"train.eval_every must be 1 in a sweep (got {base.train.eval_every}): the scheduler "
                          f"compares trials on every epoch's {metric}")
    if grace_period < 1 or grace_period > base.train.epochs:
        raise ConfigError(f"ASHA grace period must be in [1, train.epochs={base.train.epochs}], got {grace_period}")
    if reduction_factor < 2:
        raise ConfigError(f"ASHA reduction factor must be >= 2, got {reduction_factor}")
    points = list(points or [])
    if points and search == "grid":
        raise ConfigError("preset points need --search random or optuna (a grid fixes every trial itself)")
    if len(points) > samples:
        raise ConfigError(f"{len(points)} preset points but only {samples} trial(s)")
    keys = {d.key for d in dims}
    for i, point in enumerate(points):
        unknown = sorted(set(point) - keys)
        if unknown:
            raise ConfigError(f"preset point {i}: {', '.join(unknown)} not in the search space")
        try:
            apply(base, point)
        except ConfigError as exc:
            raise ConfigError(f"preset point {i}: {exc}") from exc
    return SweepSpec(base, dims, samples, scheduler, search, max_concurrent, metric,
                     grace_period=grace_period, reduction_factor=reduction_factor,
                     points=tuple(dict(p) for p in points))


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
        "git_sha": git_sha(), "kind": "sweep", "metric": spec.metric,
    })
    params = [Param("sweep.samples", str(spec.samples)), Param("sweep.scheduler", spec.scheduler),
              Param("sweep.search", spec.search), Param("sweep.max_concurrent", str(spec.max_concurrent))]
    params += [Param(f"space.{d.key}", f"{d.kind}{list(d.values)}") for d in spec.space]
    client.log_batch(run.info.run_id, params=params)
    client.log_artifact(run.info.run_id, str(space_file), "sweep")
    return run.info.run_id, False


def close_trial_runs(spec: SweepSpec, uri: str, parent_id: str, trials: list[dict[str, Any]]) -> None:
    """Set each child run's final status from Tune's view of the trial.

    Tune tears a trial down as soon as it stops it (ASHA, or max_t reached), usually before
    the trial's own code can close its run: FINISHED = all epochs, KILLED = stopped early.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    by_trial = {t["trial_id"]: t for t in trials}
    exp_id = client.get_run(parent_id).info.experiment_id
    for child in client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'"):
        trial = by_trial.get(child.data.tags.get("trial_id", ""))
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


def finish_parent_run(spec: SweepSpec, uri: str, parent_id: str, trials: list[dict[str, Any]]) -> Config | None:
    """Log the best config and the sweep report on the parent; returns the best config."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
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
            write_sweep_plots(spec, scored, folder)
        (folder / "trials.json").write_text(json.dumps(trials, indent=2, default=str))
        client.log_artifacts(parent_id, str(folder), "sweep")
    return best_cfg


def write_sweep_plots(spec: SweepSpec, trials: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Parallel coordinates of every trial, and the metric against each parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = [d.key for d in spec.space]
    metric = np.array([t["metric"] for t in trials], dtype=float)

    def column(key: str) -> np.ndarray:
        values = [t["params"].get(key) for t in trials]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return np.array(values, dtype=float)
        cats = sorted({str(v) for v in values})
        return np.array([cats.index(str(v)) for v in values], dtype=float)

    cols = [column(k) for k in keys] + [metric]
    names = keys + [spec.metric]
    scaled = [(c - c.min()) / (c.max() - c.min()) if c.max() > c.min() else np.full_like(c, 0.5) for c in cols]
    fig, ax = plt.subplots(figsize=(2.2 * len(names) + 2, 4.5))
    cmap = plt.get_cmap("viridis")
    order = (metric - metric.min()) / (metric.max() - metric.min() + 1e-12)
    for i in range(len(trials)):
        ax.plot(range(len(names)), [s[i] for s in scaled], color=cmap(order[i]), alpha=0.85, lw=2)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_yticks([])
    ax.set_title(f"{spec.name()}: {len(trials)} trials, colour = {spec.metric}")
    for x in range(len(names)):
        ax.axvline(x, color="grey", lw=0.5)
    fig.tight_layout()
    out = [folder / "parallel_coordinates.png"]
    fig.savefig(out[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, key, col in zip(axes[0], keys, cols[:-1]):
        ax.scatter(col, metric, c=metric, cmap="viridis", s=40)
        if abs(col.std()) > 0 and abs(metric.std()) > 0:
            r = float(np.corrcoef(col, metric)[0, 1])
            ax.set_title(f"{key} (r={r:+.2f})")
        else:
            ax.set_title(key)
        if any(d.key == key and d.kind == "loguniform" for d in spec.space):
            ax.set_xscale("log")
        ax.set_ylabel(spec.metric)
    fig.tight_layout()
    out.append(folder / "parameter_scatter.png")
    fig.savefig(out[1], dpi=110)
    plt.close(fig)
    return out


def best_config(name: str, uri: str) -> str:
    """The best trial's config of sweep ``name`` as YAML (from its parent run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp_ids = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(exp_ids, filter_string=f"tags.sweep_name = '{name}' and tags.kind = 'sweep'", max_results=1)
    if not found:
        raise FileNotFoundError(f"no sweep named {name!r} in {uri}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(found[0].info.run_id, "sweep/best_config.yaml", tmp)
        except Exception as exc:
            raise FileNotFoundError(f"sweep {name!r} has no best config yet (no finished trial)") from exc
        return Path(path).read_text()


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
    grace_period: int = 1, reduction_factor: int = 2, points: list[dict[str, Any]] | None = None,
) -> SweepOutcome:
    """Validate, open (or reopen) the parent run, run the Tuner, log the report."""

    from services import mlflow_tracking as mt
    from services import runtime
    from services.training import preflight, resolve_paths

    base = resolve_paths(base)
    preflight(base)
    space_file = resolve_space_file(space)
    # Schema and domain errors first, before a cluster is even started.
    load_sweep(base, space_file, samples=samples, scheduler=scheduler, search=search,
               max_concurrent=None, cluster_cpus=math.inf, metric=metric, grace_period=grace_period,
               reduction_factor=reduction_factor, points=points)
    runtime.ensure_ray(address)
    spec = load_sweep(base, space_file, samples=samples, scheduler=scheduler, search=search,
                      max_concurrent=max_concurrent, cluster_cpus=runtime.cluster_cpus(), metric=metric,
                      grace_period=grace_period, reduction_factor=reduction_factor, points=points)
    uri = mt.resolve_tracking_uri(base.tracking.tracking_uri)
    parent_id, resumed = open_parent_run(spec, uri, space_file)
    status = "FAILED"
    try:
        trials = runtime.tune_sweep(spec, parent_run_id=parent_id, mlflow_uri=uri,
                                    storage_root=base.tracking.storage_path or "runs")
        close_trial_runs(spec, uri, parent_id, trials)
        best = finish_parent_run(spec, uri, parent_id, trials)
        status = "FINISHED"
        return SweepOutcome(spec.name(), parent_id, trials, best, resumed)
    finally:
        mt.end_run(parent_id, uri, status)
