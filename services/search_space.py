"""Sweep search spaces: the space files, their validation, and the validated sweep spec.

A space file maps dotted config keys (the same names as CLI overrides and MLflow params) to
one of a tiny vocabulary::

    loss.temperature: {loguniform: [0.02, 0.5]}
    synthesis.alpha:  {uniform: [0.1, 1.0]}
    loss.name:        {choice: [norm_softmax, proxy_nca_pp]}
    train.seed:       {randint: [0, 10]}
    optim.lr:         {grid: [1.0e-4, 1.0e-3]}

Everything is checked against the config schema before a single trial starts. :func:`apply`
turns one trial's values into its config (the Tune trial driver in ``services/runtime.py``
uses it). No Ray and no MLflow here: ``services/sweep.py`` runs a sweep, ``runtime`` drives
Ray Tune, and both import this module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines.config import CONFIG_DIR, Config, ConfigError, find_yaml, from_dict, merge
from pipelines.evaluate import is_retrieval_metric
from proxies.registry import loss_parameters

DOMAINS = ("loguniform", "uniform", "choice", "randint", "grid")
SEARCH_DIR = CONFIG_DIR / "search"


@dataclass(frozen=True)
class Dimension:
    key: str
    kind: str
    values: tuple[Any, ...]

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this dimension (an earlier sweep's value may not be)."""
        if self.kind in ("choice", "grid"):
            return value in self.values
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        low, high = self.values
        return low <= value < high if self.kind == "randint" else low <= value <= high

    def describe(self) -> str:
        """``kind[values]``: the sweep parent run's ``space.KEY`` param (read by :meth:`parse`)."""
        return f"{self.kind}{list(self.values)}"

    @classmethod
    def parse(cls, key: str, text: str) -> Dimension:
        """The dimension a ``space.KEY`` param describes (``loguniform[0.0003, 0.003]``)."""
        kind, _, values = text.partition("[")
        if kind not in DOMAINS or not values.endswith("]"):
            raise ValueError(f"space.{key}: {text!r} is not kind[values] with kind one of {', '.join(DOMAINS)}")
        return cls(key, kind, tuple(ast.literal_eval("[" + values)))

    def value_of(self, text: str) -> Any:
        """A trial's value of this key from its MLflow param (a string) back to its type."""
        if self.kind in ("loguniform", "uniform"):
            return float(text)
        if self.kind == "randint":
            return int(text)
        by_text = {str(v): v for v in self.values}
        if text not in by_text:
            raise ValueError(f"{self.key}={text!r} is none of {list(self.values)}")
        return by_text[text]


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
    # A warm start: earlier trials (point, score) the searcher learns from without running
    # them, and the sweep they came from.
    evaluated: tuple[tuple[dict[str, Any], float], ...] = ()
    warm_start: str = ""

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
        if self.warm_start:
            fields["warm_start"] = self.warm_start
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return f"sweep-{self.base.data.name}-{self.base.loss.name}-{hashlib.sha256(blob).hexdigest()[:8]}"


def num_samples(samples: int, search: str) -> int:
    """Tune's ``num_samples``: a grid search runs the grid's cross product once; otherwise
    every sample repeats it (one trial per sample when the space has no grid)."""
    return 1 if search == "grid" else samples


def trial_count(dims: list[Dimension], samples: int, search: str) -> int:
    """Trials a sweep runs: Tune's ``num_samples`` times the grid dimensions' cross product."""
    return num_samples(samples, search) * math.prod(len(d.values) for d in dims if d.kind == "grid")


def default_grace(base: Config) -> int:
    """ASHA's first rung when none is given: the first epoch after the warm-up."""
    return min(base.optim.warmup_epochs + 1, base.train.epochs)


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


SCHEDULERS = ("asha", "pbt", "none")


def in_process_trials(base: Config) -> bool:
    """One-worker trials train in the Tune trial's own (reused) process: no Train controller,
    no worker group and no second import of torch per trial, which were most of a short
    trial's time. Multi-worker and elastic trials keep Ray Train (DDP, the sharded proxies)."""
    return not base.scaling.elastic and base.scaling.num_workers == 1


def pbt_keys(base: Config) -> list[str]:
    """What population-based training may change in the middle of a run: the learning rates
    and the loss's real-valued hyper-parameters (temperature, margin, scale, ...). The rest
    (model, data, the loss itself, a memory's size) shapes the checkpoint another trial clones."""
    loss = [f"loss.{k}" for k, v in loss_parameters(base.loss.name).items() if isinstance(v, float)]
    return ["optim.lr", "optim.proxy_lr_multiplier", *loss]


def _check_pbt(base: Config, dims: list[Dimension], search: str) -> None:
    if search != "random":
        raise ConfigError("--scheduler pbt needs --search random: PBT explores by perturbing its population, "
                          "not through a searcher")
    if not in_process_trials(base):
        raise ConfigError("--scheduler pbt needs one-worker trials (scaling.num_workers=1, not elastic): an "
                          "exploit clones another trial's Tune checkpoint, which a Ray Train trial does not read")
    allowed = pbt_keys(base)
    fixed = [d.key for d in dims if d.key not in allowed or d.kind == "grid"]
    if fixed:
        raise ConfigError(f"--scheduler pbt: {', '.join(fixed)} cannot change in the middle of a run; PBT "
                          f"perturbs {', '.join(allowed)} (as loguniform, uniform or choice)")


def load_sweep(
    base: Config, space: str | Path, *, samples: int, scheduler: str, search: str,
    max_concurrent: int | None, cluster_cpus: float, metric: str = "map_at_r",
    grace_period: int | None = None, reduction_factor: int = 2, points: list[dict[str, Any]] | None = None,
    include_base: bool = False, evaluated: list[tuple[dict[str, Any], float]] | None = None,
    warm_start: str = "",
) -> SweepSpec:
    """Build and check a sweep before anything starts. ``include_base``: the base config's own
    values of the searched keys (the recipe's, e.g. the paper's defaults) are the first trial.
    ``evaluated``: sweep ``warm_start``'s scored trials, told to the searcher (those outside
    this space are left out: the searcher cannot place them).
    ``grace_period`` None: the first epoch after the warm-up (``optim.warmup_epochs``)."""
    path = resolve_space_file(space)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    dims = parse_space(raw, base, source=str(path.name))
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler must be {', '.join(SCHEDULERS[:-1])} or {SCHEDULERS[-1]}, got {scheduler!r}")
    if scheduler == "pbt":
        _check_pbt(base, dims, search)
    if search not in ("optuna", "random", "grid"):
        raise ConfigError(f"--search must be optuna, random or grid, got {search!r}")
    has_grid = any(d.kind == "grid" for d in dims)
    if search == "optuna" and has_grid:
        raise ConfigError("grid dimensions need --search grid or random (Optuna samples, it does not grid)")
    if search == "grid" and not all(d.kind in ("grid", "choice") for d in dims):
        raise ConfigError("--search grid needs every dimension to be a grid or a choice")
    # An elastic trial (MIN-MAX workers) runs on as few as MIN.
    worker_cpus = base.scaling.resolved(1, sweep=True).cpus_per_worker
    per_trial = base.scaling.min_workers * worker_cpus
    trials = trial_count(dims, samples, search)
    fits = int(cluster_cpus // per_trial) if math.isfinite(cluster_cpus) else trials
    if fits < 1:
        raise ConfigError(
            f"one trial needs {per_trial:g} CPUs ({base.scaling.min_workers} workers x "
            f"{worker_cpus:g}) but the cluster has {cluster_cpus:g}"
        )
    if max_concurrent is None:
        max_concurrent = max(1, min(fits, trials))  # a 4-point grid at --samples 1 runs 4 trials
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
    warmup = base.optim.warmup_epochs
    if grace_period is None:
        grace_period = default_grace(base)
    if grace_period < 1 or grace_period > base.train.epochs:
        raise ConfigError(f"ASHA grace period must be in [1, train.epochs={base.train.epochs}], got {grace_period}")
    # In the warm-up only the head and proxies train: a rung there ranks trials before the
    # backbone's learning rate has acted (measured: such rung scores sat within 0.004 MAP@R
    # and cut the recipe's own point, README reality check).
    if scheduler == "asha" and grace_period <= warmup < base.train.epochs:
        raise ConfigError(f"ASHA grace period {grace_period} ends inside the warm-up (optim.warmup_epochs={warmup}): "
                          f"its rung would rank trials on epochs where only the head and proxies train; use "
                          f"--grace {warmup + 1} or more (the default is {warmup + 1})")
    if reduction_factor < 2:
        raise ConfigError(f"ASHA reduction factor must be >= 2, got {reduction_factor}")
    points = list(points or [])
    if include_base:
        # Optuna's first 10 trials are random samples: with a handful of trials the recipe's
        # own point might never be tried, and the sweep could "tune" below its starting recipe.
        # An unset loss key (None) means the loss's own default: that is the value it trains with.
        flat = base.flat()
        flat |= {f"loss.{k}": v for k, v in loss_parameters(base.loss.name).items() if flat.get(f"loss.{k}") is None}
        points.insert(0, {d.key: flat[d.key] for d in dims})
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
    told: list[tuple[dict[str, Any], float]] = []
    if evaluated is not None:
        if search != "optuna":
            raise ConfigError(f"--warm-start needs --search optuna (a {search} search does not learn from "
                              "earlier scores)")
        told = [(dict(p), float(v)) for p, v in evaluated
                if set(p) == keys and all(d.contains(p[d.key]) for d in dims) and math.isfinite(v)]
        if not told:
            raise ConfigError(f"--warm-start {warm_start}: none of its {len(evaluated)} scored trial(s) is a point "
                              f"of this search space ({', '.join(sorted(keys))})")
    return SweepSpec(base, dims, samples, scheduler, search, max_concurrent, metric,
                     grace_period=grace_period, reduction_factor=reduction_factor,
                     points=tuple(dict(p) for p in points), evaluated=tuple(told),
                     warm_start=warm_start if evaluated is not None else "")
