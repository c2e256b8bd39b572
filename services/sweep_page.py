"""The sweep section of ``proxydml report``: what a sweep searched, what mattered, what it cost.

Built from MLflow alone: the sweep's parent run (tags ``kind=sweep``, ``metric``; params
``space.KEY``) and its trial runs (the searched params, the metric's history, the
``asha.*`` tags written when ASHA stopped a trial, ``trial_cpus``/``trial_gpus``), so a
resumed sweep's page covers both sessions. The section holds:

- parallel coordinates of the searched keys against the metric (stopped trials dashed);
- each key's fANOVA importance, computed by Optuna on the trials the searcher saw;
- ASHA's rungs: how many trials reached each, how many it stopped there, at what cutoff;
- trials per hour, CPU/GPU-hours, and CPU-hours per point of the metric gained over the
  sweep's first trial;
- the seed spread of every config that ran more than once.
"""

from __future__ import annotations

import html
import math
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from services.mlflow_tracking import asha_stop
from services.search_space import Dimension
from services.sweep import LOST_TAG, write_sweep_plots

SEED_KEY = "train.seed"  # a config "repeats" when only this differs


def is_sweep_run(run: Run) -> bool:
    return run.data.tags.get("kind") == "sweep"


@dataclass
class Trial:
    """One trial of a sweep as its MLflow run shows it."""

    trial_id: str
    run_id: str
    params: dict[str, Any]  # searched key -> value, typed as the space's dimension
    value: float | None  # the metric's last value: what the searcher and ASHA saw
    epochs: int  # epochs it reported
    status: str
    start_ms: int
    end_ms: int | None
    cpus: float
    gpus: float
    asha: dict[str, float] = field(default_factory=dict)  # rung, epoch, value, cutoff, rung_trials

    @property
    def hours(self) -> float:
        return max(0, (self.end_ms or self.start_ms) - self.start_ms) / 3.6e6


@dataclass
class Sweep:
    name: str
    run: Run
    metric: str
    mode: str  # "max" or "min"
    dims: list[Dimension]
    epochs: int  # the sweep's train.epochs: a trial that reported fewer was stopped
    trials: list[Trial]


def collect_sweep(client: MlflowClient, parent: Run) -> Sweep:
    """The sweep of parent run ``parent`` and its trials (one metric-history call per trial)."""
    tags, params = parent.data.tags, parent.data.params
    metric = tags.get("metric", "map_at_r")
    dims = [Dimension.parse(k.removeprefix("space."), v) for k, v in sorted(params.items()) if k.startswith("space.")]
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=50_000)
    trials = []
    for child in children:
        t, p = child.data.tags, child.data.params
        if "trial_id" not in t or LOST_TAG in t:
            continue
        history = client.get_metric_history(child.info.run_id, metric) if metric in child.data.metrics else []
        last = max(history, key=lambda m: (m.step, m.timestamp)) if history else None
        workers = float(p.get("scaling.num_workers", 1))
        trials.append(Trial(
            trial_id=t["trial_id"], run_id=child.info.run_id,
            params={d.key: d.value_of(p[d.key]) for d in dims if d.key in p},
            value=float(last.value) if last is not None else None,
            epochs=max((m.step for m in history), default=0), status=child.info.status,
            start_ms=child.info.start_time, end_ms=child.info.end_time,
            cpus=float(t.get("trial_cpus", workers * float(p.get("scaling.cpus_per_worker", 1)))),
            gpus=float(t.get("trial_gpus", 0)),
            asha=asha_stop(t),
        ))
    epochs = max((int(c.data.params.get("train.epochs", 0)) for c in children), default=0)
    # No ``mode`` tag: maximised (every metric a sweep may score on is a retrieval metric).
    return Sweep(tags.get("sweep_name", parent.info.run_name or ""), parent, metric, tags.get("mode", "max"), dims,
                 epochs, trials)


def scored(sweep: Sweep) -> list[Trial]:
    return [t for t in sweep.trials if t.value is not None and math.isfinite(t.value) and t.params.keys() ==
            {d.key for d in sweep.dims}]


# ---------------------------------------------------------------- importance ----------------


def optuna_distribution(dim: Dimension) -> Any:
    """The Optuna distribution of a dimension, as Ray's OptunaSearch converts Tune's domains
    (``randint`` excludes its high end; a grid is a categorical)."""
    import optuna

    if dim.kind in ("loguniform", "uniform"):
        return optuna.distributions.FloatDistribution(*dim.values, log=dim.kind == "loguniform")
    if dim.kind == "randint":
        return optuna.distributions.IntDistribution(dim.values[0], dim.values[1] - 1)
    return optuna.distributions.CategoricalDistribution(list(dim.values))


def importances(sweep: Sweep, seed: int = 0) -> dict[str, float]:
    """Each searched key's fANOVA importance (Optuna's ``FanovaImportanceEvaluator``, summing to
    1) over the scored trials, each at the value the searcher was told (a stopped trial's last).
    Empty when fewer than two trials scored or the metric never varied."""
    import optuna

    trials = scored(sweep)
    if len(trials) < 2 or len({t.value for t in trials}) < 2 or not sweep.dims:
        return {}
    distributions = {d.key: optuna_distribution(d) for d in sweep.dims}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize" if sweep.mode == "max" else "minimize")
    study.add_trials([optuna.trial.create_trial(params=t.params, distributions=distributions, value=t.value)
                      for t in trials])
    return optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed))


# ---------------------------------------------------------------- rungs, cost, repeats -------


@dataclass
class Rung:
    epoch: int
    reached: int  # trials that reported this epoch
    stopped: int  # trials ASHA stopped here
    cutoffs: list[float]  # the cutoffs those trials fell below


def rungs(sweep: Sweep) -> list[Rung]:
    """ASHA's rungs as its stops recorded them (``asha.rung``), with every trial's reach."""
    stops: dict[int, list[float]] = defaultdict(list)
    for t in sweep.trials:
        if "rung" in t.asha:
            stops[int(t.asha["rung"])].append(t.asha["cutoff"])
    return [Rung(e, sum(t.epochs >= e for t in sweep.trials), len(stops[e]), sorted(stops[e]))
            for e in sorted(stops)]


@dataclass
class Cost:
    trials: int
    busy_hours: float  # hours with at least one trial running (a resumed sweep's gap excluded)
    cpu_hours: float
    gpu_hours: float
    first: float | None  # the first trial's metric
    best: float | None
    cpu_hours_per_point: float | None  # per 0.01 of the metric gained over the first trial

    @property
    def trials_per_hour(self) -> float | None:
        return self.trials / self.busy_hours if self.busy_hours > 0 else None


def cost(sweep: Sweep) -> Cost:
    spans = sorted((t.start_ms, t.end_ms or t.start_ms) for t in sweep.trials)
    busy, edge = 0, None
    for start, end in spans:  # the union of the trials' intervals
        if edge is None or start > edge:
            busy += end - start
            edge = end
        elif end > edge:
            busy += end - edge
            edge = end
    done = scored(sweep)
    first = done[0].value if done else None  # trials are ordered by start time
    best = max((t.value for t in done), default=None) if sweep.mode == "max" else min(
        (t.value for t in done), default=None)
    cpu = sum(t.hours * t.cpus for t in sweep.trials)
    gain = None if first is None or best is None else (best - first if sweep.mode == "max" else first - best)
    return Cost(len(sweep.trials), busy / 3.6e6, cpu, sum(t.hours * t.gpus for t in sweep.trials), first, best,
                cpu / (gain * 100) if gain else None)


@dataclass
class Repeat:
    params: dict[str, Any]  # the config's searched values, the seed left out
    values: list[float]  # the metric of each full-length run of it
    seeds: list[Any]


def repeats(sweep: Sweep) -> list[Repeat]:
    """Configs that ran to the last epoch more than once (differing at most in the seed)."""
    groups: dict[str, Repeat] = {}
    for t in scored(sweep):
        if t.epochs < sweep.epochs:
            continue  # a stopped trial's value is from an earlier epoch: not comparable
        same = {k: v for k, v in t.params.items() if k != SEED_KEY}
        rep = groups.setdefault(repr(sorted(same.items())), Repeat(same, [], []))
        rep.values.append(t.value)
        rep.seeds.append(t.params.get(SEED_KEY, "—"))
    return [r for r in groups.values() if len(r.values) > 1]


# ---------------------------------------------------------------- rendering -----------------


def _num(value: float | None, digits: int = 4) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_section(sweep: Sweep, table: Any, img: Any) -> str:
    """The HTML of the sweep section. ``table(header, rows, cls, numeric_from)`` and
    ``img(png, alt)`` are the report's own helpers, so the page keeps one style."""
    esc = html.escape
    m = esc(sweep.metric)
    keys = [d.key for d in sweep.dims]
    done = scored(sweep)
    out = [f'<h2 id="sweep">Sweep <code>{esc(sweep.name)}</code></h2>',
           f'<p class="meta">{len(sweep.trials)} trials &middot; {len(done)} scored on <code>{m}</code> '
           f"&middot; searched: {', '.join(f'<code>{esc(d.key)}</code> {esc(d.describe())}' for d in sweep.dims)}</p>"]

    c = cost(sweep)
    tph = c.trials_per_hour
    out.append(table(["trials", "trials per hour", "CPU-hours", "GPU-hours", f"first trial's {m}", f"best {m}",
                      "CPU-hours per point gained"],
                     [[str(c.trials), _num(tph, 1), _num(c.cpu_hours, 3), _num(c.gpu_hours, 3), _num(c.first),
                       _num(c.best), _num(c.cpu_hours_per_point, 3) if c.cpu_hours_per_point and
                       c.cpu_hours_per_point > 0 else "no gain"]], "sweep-cost", 0))
    out.append('<p class="meta">trials per hour: over the hours in which at least one trial ran; a point is '
               f"0.01 of <code>{m}</code>; CPU/GPU-hours: each trial's time times what it held.</p>")

    if len(done) >= 2:
        with tempfile.TemporaryDirectory(prefix="proxydml-sweep-") as tmp:
            pngs = write_sweep_plots(sweep.name, sweep.dims, sweep.metric, [
                {"params": t.params, "metric": t.value, "stopped": t.epochs < sweep.epochs} for t in done], Path(tmp))
            figures = [f"<figure>{img(p.read_bytes(), p.stem)}<figcaption>{esc(p.stem.replace('_', ' '))}"
                       "</figcaption></figure>" for p in pngs]
        out.append('<div class="plots">' + "".join(figures) + "</div>")

    out.append("<h3>Importance (fANOVA)</h3>")
    imp = importances(sweep)
    if imp:
        rows = [[f"<code>{esc(k)}</code>", f'<span class="bar" style="width:{max(1, round(200 * v))}px"></span>',
                 f"{v:.4f}"] for k, v in imp.items()]
        out.append(table(["key", "", "importance"], rows, "importance", 2))
        out.append(f'<p class="meta">Optuna\'s FanovaImportanceEvaluator (seed 0) over {len(done)} trials, '
                   "each at the last value it reported (what the searcher was told).</p>")
    else:
        out.append("<p>Not enough scored trials with differing values to tell.</p>")

    out.append("<h3>ASHA rungs</h3>")
    rs = rungs(sweep)
    if rs:
        out.append(table(["rung (epoch)", "trials reached", "stopped here", "cutoff (lowest – highest)"],
                         [[str(r.epoch), str(r.reached), str(r.stopped),
                           f"{_num(r.cutoffs[0])} – {_num(r.cutoffs[-1])}"] for r in rs], "rungs", 0))
    else:
        out.append("<p>No trial was stopped early by ASHA.</p>")

    rows = []
    ranked = sorted(sweep.trials, key=lambda t: (t.value is None, -(t.value or 0) if sweep.mode == "max"
                                                 else (t.value or 0)))
    for t in ranked:
        a = t.asha
        late = f" at epoch {int(a['epoch'])}" if a.get("epoch", a.get("rung")) != a.get("rung") else ""
        stop = (f"rung {int(a['rung'])}{late}: {_num(a['value'])} &lt; {_num(a['cutoff'])} "
                f"(of {int(a['rung_trials'])})") if "rung" in a else ""
        rows.append([f"<code>{esc(t.trial_id)}</code>", *[esc(_value(t.params.get(k, '—'))) for k in keys],
                     _num(t.value), str(t.epochs), esc(t.status), stop, f"{t.hours * 3600:.1f}"])
    body = table(["trial", *[f"<code>{esc(k)}</code>" for k in keys], m, "epochs", "status",
                  "stopped by ASHA at", "seconds"], rows, "trials", len(keys) + 1)
    out.append(f'<details{" open" if len(rows) <= 50 else ""}><summary>Trials, best first ({len(rows)})'
               f"</summary>{body}</details>")

    reps = repeats(sweep)
    out.append("<h3>Seed spread</h3>")
    if reps:
        rows = [[esc(", ".join(f"{k}={_value(v)}" for k, v in r.params.items())), str(len(r.values)),
                 esc(", ".join(map(str, r.seeds))), _num(statistics.fmean(r.values)),
                 _num(statistics.stdev(r.values)), _num(min(r.values)), _num(max(r.values))] for r in reps]
        out.append(table(["config", "runs", "seeds", "mean", "std", "min", "max"], rows, "seeds", 1))
    else:
        out.append("<p>No config ran to the last epoch more than once.</p>")
    return "\n".join(out)

