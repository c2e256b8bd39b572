"""Reality-check study: the papers' losses, each tuned by our own sweep service, over 3 seeds.

Not collected by pytest (a script). The protocol of Musgrave et al., "A Metric Learning
Reality Check" (2020), on the emoji benchmark:

1. For each method, one ``proxydml tune`` sweep on a validation split of the seen classes
   (``data.val_classes``), never the test classes: the same number of trials for every
   method, ASHA, the method's own knobs plus the learning rate
   (``spaces/reality_*.yaml`` beside this script: the study's spaces are not product data).
2. The sweep's best config trained with ``--seeds`` seeds on all seen classes
   (``proxydml train``) and scored on the unseen half.
3. Mean +- std of R@1, MAP@R and cross-family R@1, and a verdict on each claim of the
   papers: holds beyond the seed spread (every seed of one beats every seed of the other),
   within the spread, or fails beyond it.

The plain peer set-up (``recipes/emoji_peer_proxy_anchor.yaml``: all layers at 64 px, flips) is trained
the same way, untuned, as the baseline row. The losses that trailed it on the 128 px
recipes are also tuned on the peer's own set-up (the ``*_full`` parts: only the loss
changes). Every sweep runs the recipe's own point as its first trial (``--include-base``).
The Proxy-Anchor family, still behind the peer with its loss knobs tuned, also gets a lever
beyond them (the ``*_sched`` parts): a 4-point grid of the lr schedule (constant or cosine)
and the peak lr, every point trained for all 12 epochs, the peer's own point among them.
More grids the same way: Proxy-ISA's V at the lr its schedule grid chose
(``proxy_isa_decay``: whether its sample-aware decay starts at all on 5 images a class) and
its h and k there (``proxy_isa_band``: the band of positives it weighs double); PS +
Proxy-Anchor's synthetic ratio mu with the lr (``ps_proxy_anchor_mu``), its Beta mixing alpha
(``ps_proxy_anchor_alpha``) and its head-only warm-up with the lr (``ps_proxy_anchor_warmup``);
Proxy-ISA's memory start with the lr (``proxy_isa_memory``) and its batch sampling with the lr
(``proxy_isa_sampler``); PS + Proxy-Anchor's mu below 0.25 (``ps_proxy_anchor_small_mu``) and,
at its choice, the same sampling grid (``ps_proxy_anchor_sampler``).
Every sweep (parent and trial runs) and every final run lands in one MLflow experiment
(``--experiment``); at the end ``proxydml report`` renders it and logs the page, with the
study's table, to the experiment's report run.

Resumable: each finished step (a sweep, one seed) is written to ``WORKDIR/state.json`` at
once, and the study runs in parts of under an hour (one method: its sweep and its seeds).
Run the same command again after an interruption: finished steps are skipped, an
interrupted sweep resumes by its name, an interrupted training run restarts from its last
checkpoint; ``--parts`` runs only some. The CPU budget is printed before anything starts.

Usage::

    .venv/bin/python tests/benchmarks/bench_reality.py                      # one part per method + peer
    .venv/bin/python tests/benchmarks/bench_reality.py --parts all          # every lever tried
    .venv/bin/python tests/benchmarks/bench_reality.py --parts proxy_nca_pp peer
    .venv/bin/python tests/benchmarks/bench_reality.py --report-only        # table + report
    .venv/bin/python tests/benchmarks/bench_reality.py --smoke              # minutes: the plumbing
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
STUDY = Path(__file__).resolve().parent  # its spaces and the peer recipe live beside it, not in the product
sys.path.insert(0, str(ROOT))

from pipelines.config import load_config  # noqa: E402
from pipelines.data.emoji_build import ensure_built  # noqa: E402
from services.search_space import default_grace, parse_space, resolve_space_file, trial_count  # noqa: E402

PROXYDML = [str(Path(sys.executable).with_name("proxydml"))]  # the console script next to this Python
METRICS = {"R@1": "recall_at_1", "MAP@R": "map_at_r", "cross-family R@1": "xgroup_recall_at_1"}


# Cost model for the budget printed up front, measured on 2 cores (docs/benchmarks.md, emoji benchmark):
# seconds per training image and epoch at 128 px with 4 stages frozen and with every layer
# trained at 64 px, per evaluation image at 160 px, and what every `proxydml` command pays to
# start Ray and its workers.
S_PER_TRAIN_IMAGE = 52.0 / 3965
S_PER_TRAIN_IMAGE_FULL64 = 21.0 / 3965
S_PER_EVAL_IMAGE = 40.0 / 3965
S_START = 30.0
SEEN_IMAGES = TEST_IMAGES = 793 * 5  # the emoji benchmark's seen and unseen halves


def space(name: str) -> str:
    """The path of one of the study's search spaces (``proxydml tune --space`` takes a path)."""
    return str(STUDY / "spaces" / f"{name}.yaml")


@dataclass(frozen=True)
class Method:
    key: str  # part name and table row
    label: str
    recipe: str
    space: str | None  # path of its search space (see space()); None: a fixed set-up, not tuned
    overrides: tuple[str, ...] = ()  # on top of the recipe, in the sweep (and so in its best config)
    s_per_train_image: float = S_PER_TRAIN_IMAGE  # the cost model's price of the recipe's epoch
    # The space is a grid, every point trained for the whole schedule (no ASHA, no sampling):
    # for levers such as the lr schedule, whose effect shows only at the end.
    grid: bool = False


# The losses that trailed the peer, on the peer's own set-up (every layer trained at 64 px,
# flips, GAP+GMP, constant lr, 12 epochs): the 128 px recipe with 4 frozen stages suits
# ProxyNCA++ but left Proxy-Anchor 0.04 R@1 behind the peer that trains every layer (docs/study.md).
PEER = str(STUDY / "recipes" / "emoji_peer_proxy_anchor.yaml")
NCA_ON_PEER = ("loss.name=proxy_nca", "loss.alpha=null", "loss.delta=null")
ISA_ON_PEER = ("loss.name=proxy_isa", "loss.memory_size=2048", "loss.memory_start_epoch=2")
PS_ON_PEER = ("synthesis.enabled=true", "synthesis.alpha=0.4", "synthesis.mu=1.0")
METHODS = (
    Method("proxy_nca_pp", "ProxyNCA++", "emoji_proxy_nca_pp", space("reality_proxy_nca_pp")),
    Method("proxy_nca", "ProxyNCA", "emoji_proxy_nca", space("reality_proxy_nca")),
    Method("proxy_anchor", "Proxy-Anchor", "emoji_proxy_anchor", space("reality_proxy_anchor")),
    Method("proxy_isa", "Proxy-ISA", "emoji_proxy_isa", space("reality_proxy_isa")),
    Method("ps_proxy_nca_pp", "PS + ProxyNCA++", "emoji_proxy_nca_pp_ps", space("reality_ps_proxy_nca_pp")),
    Method("ps_proxy_anchor", "PS + Proxy-Anchor", "emoji_proxy_anchor_ps", space("reality_ps_proxy_anchor")),
    Method("peer", "plain peer set-up (untuned)", PEER, None, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64),
    Method("proxy_nca_full", "ProxyNCA, all layers 64 px", PEER, space("reality_full_proxy_nca"), NCA_ON_PEER,
           s_per_train_image=S_PER_TRAIN_IMAGE_FULL64),
    Method("proxy_anchor_full", "Proxy-Anchor, all layers 64 px", PEER, space("reality_full_proxy_anchor"),
           s_per_train_image=S_PER_TRAIN_IMAGE_FULL64),
    Method("proxy_isa_full", "Proxy-ISA, all layers 64 px", PEER, space("reality_full_proxy_isa"), ISA_ON_PEER,
           s_per_train_image=S_PER_TRAIN_IMAGE_FULL64),
    Method("ps_proxy_anchor_full", "PS + Proxy-Anchor, all layers 64 px", PEER, space("reality_full_ps_proxy_anchor"),
           PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64),
    # The Proxy-Anchor family, still behind the peer with its loss knobs tuned, with the lr
    # schedule as the lever: constant (the peer) or cosine, each at two peak lrs.
    Method("proxy_anchor_sched", "Proxy-Anchor, all layers 64 px, lr schedule swept", PEER, space("reality_full_schedule"),
           s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    Method("proxy_isa_sched", "Proxy-ISA, all layers 64 px, lr schedule swept", PEER, space("reality_full_schedule"),
           ISA_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    Method("ps_proxy_anchor_sched", "PS + Proxy-Anchor, all layers 64 px, lr schedule swept", PEER,
           space("reality_full_schedule"), PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # Proxy-ISA, level with the peer at the lr its schedule grid chose, with the knob that
    # decides whether its sample-aware decay acts at all on 5 images a class: V.
    Method("proxy_isa_decay", "Proxy-ISA, all layers 64 px, lr 1.5e-4, V swept", PEER, space("reality_full_isa_decay"),
           (*ISA_ON_PEER, "optim.lr=1.5e-4"), s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # PS + Proxy-Anchor, behind the peer at mu 1 and collapsing at lr 1.5e-4: fewer synthetic
    # classes per batch, with the peak lr.
    Method("ps_proxy_anchor_mu", "PS + Proxy-Anchor, all layers 64 px, mu and lr swept", PEER, space("reality_full_ps_mu"),
           PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # Proxy-ISA at the lr and V its grids chose, with the knobs of its band of doubled-weight
    # positives, the one part of its weighting still active on 5 images a class: h and k.
    Method("proxy_isa_band", "Proxy-ISA, all layers 64 px, lr 1.5e-4, h and k swept", PEER, space("reality_full_isa_band"),
           (*ISA_ON_PEER, "optim.lr=1.5e-4"), s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # PS + Proxy-Anchor at the paper's mu 1 and the lr its schedule grid chose, with the Beta
    # mixing that decides how close a synthetic lies to a real sample: alpha.
    Method("ps_proxy_anchor_alpha", "PS + Proxy-Anchor, all layers 64 px, alpha swept", PEER, space("reality_full_ps_alpha"),
           PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # PS + Proxy-Anchor at the paper's alpha and mu, whose lr 1.5e-4 collapsed once the
    # backbone joined: a longer head-only warm-up, with the peak lr.
    Method("ps_proxy_anchor_warmup", "PS + Proxy-Anchor, all layers 64 px, warm-up and lr swept", PEER,
           space("reality_full_ps_warmup"), PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # Proxy-ISA at the authors' V, h and k (its grids' best), with the epoch its memory starts: before
    # it, S_learned is 1 and nearly every negative weighs 1 / E_c, in the backbone's first epoch.
    Method("proxy_isa_memory", "Proxy-ISA, all layers 64 px, memory start and lr swept", PEER,
           space("reality_full_isa_memory"), ISA_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # Proxy-ISA with the batch sampling of the authors' code (plain shuffling) or 32 x 2, where
    # the peer draws 16 classes x 4 images.
    Method("proxy_isa_sampler", "Proxy-ISA, all layers 64 px, batch sampling and lr swept", PEER,
           space("reality_full_sampler"), ISA_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # PS + Proxy-Anchor with 4 or 8 synthetic classes a batch, where the mu grid's trend points.
    Method("ps_proxy_anchor_small_mu", "PS + Proxy-Anchor, all layers 64 px, small mu and lr swept", PEER,
           space("reality_full_ps_small_mu"), PS_ON_PEER, s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
    # PS + Proxy-Anchor at the mu its small-mu grid chose, with the batch sampling and the lr.
    Method("ps_proxy_anchor_sampler", "PS + Proxy-Anchor, all layers 64 px, mu 1/16, batch sampling and lr swept",
           PEER, space("reality_full_sampler"), (*PS_ON_PEER, "synthesis.mu=0.0625"),
           s_per_train_image=S_PER_TRAIN_IMAGE_FULL64, grid=True),
)
BY_KEY = {m.key: m for m in METHODS}
# The study's answer, the default run: for each method the part its table row ends on (the
# recipe it beats the peer with), and the peer. ``--parts all`` adds every lever tried on the
# way (all of METHODS: about 12 h on 2 cores).
HEADLINE = ("proxy_nca_pp", "ps_proxy_nca_pp", "proxy_nca_full", "proxy_anchor_sched", "proxy_isa_sampler",
            "ps_proxy_anchor_sampler", "peer")


def selected(parts: Sequence[str]) -> list[Method]:
    """The methods ``--parts`` names, in the study's order; ``all`` is every one."""
    return list(METHODS) if "all" in parts else [m for m in METHODS if m.key in parts]
# (claim, a, b, strict): a > b (strict) or a >= b, judged on R@1 and MAP@R.
CLAIMS = (
    ("ProxyNCA++ > ProxyNCA", "proxy_nca_pp", "proxy_nca", True),
    ("PS + ProxyNCA++ > ProxyNCA++", "ps_proxy_nca_pp", "proxy_nca_pp", True),
    ("PS + Proxy-Anchor > Proxy-Anchor", "ps_proxy_anchor", "proxy_anchor", True),
    ("Proxy-ISA >= Proxy-Anchor", "proxy_isa", "proxy_anchor", False),
    ("PS + Proxy-Anchor > Proxy-Anchor, all layers 64 px", "ps_proxy_anchor_full", "proxy_anchor_full", True),
    ("Proxy-ISA >= Proxy-Anchor, all layers 64 px", "proxy_isa_full", "proxy_anchor_full", False),
    ("Proxy-Anchor, lr schedule swept > Proxy-Anchor, all layers 64 px", "proxy_anchor_sched", "proxy_anchor_full",
     True),
    ("Proxy-ISA, V swept >= Proxy-Anchor, lr schedule swept", "proxy_isa_decay", "proxy_anchor_sched", False),
    ("PS + Proxy-Anchor, mu and lr swept > Proxy-Anchor, lr schedule swept", "ps_proxy_anchor_mu",
     "proxy_anchor_sched", True),
    ("Proxy-ISA, h and k swept >= Proxy-Anchor, lr schedule swept", "proxy_isa_band", "proxy_anchor_sched", False),
    ("PS + Proxy-Anchor, alpha swept > Proxy-Anchor, lr schedule swept", "ps_proxy_anchor_alpha", "proxy_anchor_sched",
     True),
    ("PS + Proxy-Anchor, warm-up and lr swept > Proxy-Anchor, lr schedule swept", "ps_proxy_anchor_warmup",
     "proxy_anchor_sched", True),
    ("Proxy-ISA, memory start and lr swept >= Proxy-Anchor, lr schedule swept", "proxy_isa_memory",
     "proxy_anchor_sched", False),
    ("Proxy-ISA, batch sampling and lr swept >= Proxy-Anchor, lr schedule swept", "proxy_isa_sampler",
     "proxy_anchor_sched", False),
    ("PS + Proxy-Anchor, batch sampling and lr swept > Proxy-Anchor, lr schedule swept", "ps_proxy_anchor_sampler",
     "proxy_anchor_sched", True),
    ("PS + Proxy-Anchor, small mu and lr swept > Proxy-Anchor, lr schedule swept", "ps_proxy_anchor_small_mu",
     "proxy_anchor_sched", True),
    *((f"{m.label} > plain peer", m.key, "peer", True) for m in METHODS if m.space),
)


def asha_epochs(trials: int, max_epochs: int, grace: int = 1, rf: int = 2) -> float:
    """Epochs an ASHA sweep spends, about: every trial runs ``grace`` epochs, 1/rf of them
    go on to each next rung (grace * rf**i), the last rung ends at ``max_epochs``."""
    total, rung_start, rung, share = 0.0, 0, grace, 1.0
    while rung_start < max_epochs:
        end = min(rung, max_epochs)
        total += trials * share * (end - rung_start)
        rung_start, rung, share = end, rung * rf, share / rf
    return total


@functools.cache  # the budget line and the cost model both ask; parsing loads the recipe
def grid_points(m: Method) -> int:
    """Trials of a grid part's sweep: its space's cross product, as ``proxydml tune`` counts it."""
    space = parse_space(yaml.safe_load(resolve_space_file(m.space or "").read_text()),
                        load_config(m.recipe, list(m.overrides)))
    return trial_count(space, 1, "grid")


def estimate_s(trials: int, seeds: int, epochs: Mapping[str, int], train_images: int, val_images: int,
               test_images: int, methods: Sequence[Method], epoch_cap: int = 0,
               grace: Mapping[str, int] | None = None) -> dict[str, float]:
    """Wall seconds per part on 2 cores (each part uses both); ``epochs``: each method's
    ``train.epochs``; ``epoch_cap``: images per epoch at most (``train.max_steps_per_epoch`` x
    batch), 0 for full passes."""
    def images(n: int) -> int:
        return min(n, epoch_cap) if epoch_cap else n

    out = {}
    for m in methods:
        final = S_START + epochs[m.key] * images(train_images) * m.s_per_train_image + test_images * S_PER_EVAL_IMAGE
        s = seeds * final
        if m.space:
            if m.grid:  # every point runs every epoch
                n = grid_points(m)
                spent = n * epochs[m.key]
            else:
                n = trials
                spent = asha_epochs(trials, epochs[m.key], (grace or {}).get(m.key, 1))
            # Two trials at once on the 2 cores: each trial's start-up overlaps the other's work.
            s += spent * (images(train_images - val_images) * m.s_per_train_image + val_images * S_PER_EVAL_IMAGE)
            s += n * S_START / 2 + S_START
        out[m.key] = s
    return out


def verdict(a: Sequence[float], b: Sequence[float], strict: bool) -> str:
    """``a`` vs ``b`` over seeds: beyond the seed spread only when the ranges do not overlap."""
    if len(a) < 2 or len(b) < 2:  # one seed has no spread to judge against
        order = ">" if statistics.fmean(a) > statistics.fmean(b) else "<=" if strict else "<"
        return f"one seed only: {order} (no spread to judge)"
    if min(a) > max(b):
        return "holds beyond the seed spread"
    if max(a) < min(b):
        return "fails beyond the seed spread"
    if strict:
        return "within the seed spread (not shown)"
    return "holds within the seed spread"


# ------------------------------------------------------------------------------ state ----
class State:
    """``WORKDIR/state.json``: what each part has finished, written after every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"parts": {}}

    def part(self, key: str) -> dict[str, Any]:
        return self.data["parts"].setdefault(key, {"finals": {}})

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)  # never a half-written state


def proxydml(args: list[str], env: dict[str, str]) -> str:
    """Run one CLI command, echo its output, return its stdout; a failure stops the study."""
    print(f"$ proxydml {' '.join(args)}", flush=True)
    # stdout alone is returned: `tune best` prints a YAML that a library warning on stderr must not corrupt
    proc = subprocess.run([*PROXYDML, *args], cwd=ROOT, env=env, text=True, capture_output=True)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode:
        raise SystemExit(f"proxydml {args[0]} failed (exit {proc.returncode}); rerun to resume")
    return proc.stdout


def sweep_name(tune_output: str) -> str:
    """The sweep's name from ``proxydml tune``'s summary line ("sweep NAME[ (resumed)]: N trial(s)")."""
    for line in tune_output.splitlines():
        if line.startswith("sweep "):
            return line.split()[1].rstrip(":")
    raise SystemExit("proxydml tune printed no sweep summary line")


def run_sweep(m: Method, part: dict[str, Any], args: argparse.Namespace, common: list[str], env: dict[str, str],
              folder: Path) -> Path:
    """The method's sweep on the validation split; its best config as YAML in ``folder``."""
    best = folder / "best.yaml"
    if "best_yaml" not in part:
        how = (["--samples", "1", "--scheduler", "none", "--search", "grid"] if m.grid else
               ["--samples", str(args.trials),
                # ASHA's first rung: the first epoch after the warm-up (proxydml tune's default)
                "--scheduler", "asha", "--search", "optuna", "--reduction-factor", "2",
                # the recipe's own point is one of the trials: a sweep never ends below its recipe
                "--include-base"])
        out = proxydml(["tune", "--config", m.recipe, "--space", m.space or "", *how, *m.overrides, *common,
                        f"data.val_classes={args.val_classes}",
                        # one worker per trial: two trials at once share the 2 cores, which is
                        # what asynchronous ASHA needs to compare them early
                        "scaling.num_workers=1"], env)
        name = sweep_name(out)
        part["sweep"] = name
        part["best_yaml"] = proxydml(["tune", "best", name], env)
    best.write_text(part["best_yaml"])
    dims = parse_space(yaml.safe_load(resolve_space_file(m.space or "").read_text()), load_config(best))
    flat = load_config(best).flat()
    part["chosen"] = {d.key: flat[d.key] for d in dims}
    return best


def run_final(config: str | Path, seed: int, args: argparse.Namespace, common: list[str],
              env: dict[str, str]) -> dict[str, float]:
    """One seed on all seen classes, scored on the unseen half; metrics from its MLflow run."""
    from mlflow.tracking import MlflowClient

    from services.mlflow_tracking import find_run

    # 2 workers as `make demo` runs them; scored once, after the last epoch.
    overrides = [*common, "data.val_classes=0", f"train.seed={seed}", "train.eval_every=1000", "scaling.num_workers=2"]
    cfg = load_config(config, overrides)
    t0 = time.perf_counter()
    proxydml(["train", "--config", str(config), "--quiet", *overrides], env)
    seconds = time.perf_counter() - t0
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name(args.experiment)
    run = find_run(client, exp.experiment_id, cfg)
    if run is None:
        raise SystemExit(f"no MLflow run {cfg.run_name()!r} in experiment {args.experiment!r}")
    metrics = {name: run.data.metrics[key] for name, key in METRICS.items()}
    return {**metrics, "minutes": seconds / 60, "run_id": run.info.run_id}


# ----------------------------------------------------------------------------- report ----
def summary(state: State, methods: Sequence[Method]) -> tuple[str, dict[str, Any]]:
    """The study's table (markdown, as in docs/study.md) and the same as JSON."""
    rows, out = [], {"methods": {}, "claims": {}}
    head = "| method | seeds | " + " | ".join(METRICS) + " | minutes per run | chosen on the validation split |"
    rows += [head, "|---|---:|" + "---:|" * (len(METRICS) + 1) + "---|"]
    for m in methods:
        part = state.data["parts"].get(m.key, {})
        finals = list(part.get("finals", {}).values())
        if not finals:
            continue
        stats = {}
        for name in METRICS:
            vals = [f[name] for f in finals]
            stats[name] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                           "values": vals}
        minutes = statistics.fmean(f["minutes"] for f in finals)
        chosen = part.get("chosen", {})
        out["methods"][m.key] = {"label": m.label, "seeds": len(finals), "stats": stats, "minutes": minutes,
                                 "chosen": chosen, "sweep": part.get("sweep")}
        cells = " | ".join(f"{s['mean']:.3f} +- {s['std']:.3f}" for s in stats.values())
        shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in chosen.items())
        rows.append(f"| {m.label} | {len(finals)} | {cells} | {minutes:.1f} | {shown or 'fixed'} |")
    rows += ["", "| claim | R@1 | MAP@R |", "|---|---|---|"]
    for claim, a, b, strict in CLAIMS:
        ma, mb = out["methods"].get(a), out["methods"].get(b)
        if not (ma and mb):
            continue
        v = {name: verdict(ma["stats"][name]["values"], mb["stats"][name]["values"], strict)
             for name in ("R@1", "MAP@R")}
        out["claims"][claim] = v
        rows.append(f"| {claim} | {v['R@1']} | {v['MAP@R']} |")
    return "\n".join(rows) + "\n", out


def publish(table: str, data: dict[str, Any], args: argparse.Namespace, env: dict[str, str], folder: Path) -> None:
    """``proxydml report EXPERIMENT`` (logged to the experiment's report run), plus the table."""
    from mlflow.tracking import MlflowClient

    from services.report import report_run

    proxydml(["report", args.experiment, "--out", str(folder / "report.html"), "--max-runs", "1000"], env)
    (folder / "study.md").write_text(table)
    (folder / "study.json").write_text(json.dumps(data, indent=2) + "\n")
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run_id = report_run(client, client.get_experiment_by_name(args.experiment).experiment_id)
    for name in ("study.md", "study.json"):
        client.log_artifact(run_id, str(folder / name), "report")


# ------------------------------------------------------------------------------- main ----
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT / "data" / "emoji"), help="built emoji folder (built if missing)")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "reality"), help="state, best configs, report")
    ap.add_argument("--experiment", default="reality-emoji", help="the study's MLflow experiment")
    ap.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    ap.add_argument("--parts", nargs="+", default=list(HEADLINE), choices=[*BY_KEY, "all"],
                    help="parts to run (default: one per method and the peer; all: every part)")
    ap.add_argument("--trials", type=int, default=4, help="trials per sweep, the same for every method")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each method's final training")
    ap.add_argument("--val-classes", type=int, default=300, help="seen classes held out for the sweeps")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    ap.add_argument("--smoke", action="store_true",
                    help="2 trials, 1 seed, 2 epochs of 3 steps at 32 px: checks the plumbing in minutes")
    ap.add_argument("--report-only", action="store_true", help="only the table and the report")
    args = ap.parse_args(argv)
    if args.smoke:
        args.trials, args.seeds = 2, 1
        args.set = ["train.epochs=2", "train.max_steps_per_epoch=3", "data.image_size=32", "data.eval_resize=32",
                    "loss.memory_start_epoch=1", *args.set]
        if args.experiment == "reality-emoji":
            args.experiment = "reality-emoji-smoke"
        if args.workdir == str(ROOT / "runs" / "reality"):
            args.workdir = str(ROOT / "runs" / "reality-smoke")
    folder = Path(args.workdir)
    folder.mkdir(parents=True, exist_ok=True)
    from services.mlflow_tracking import resolve_tracking_uri

    env = {**os.environ, "MLFLOW_TRACKING_URI": resolve_tracking_uri(args.tracking_uri),
           "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    root = ensure_built(args.root)
    common = [f"data.root={root}", f"tracking.experiment={args.experiment}", "train.recall_ks=[1]", *args.set]
    methods = selected(args.parts)
    state = State(folder / "state.json")

    if not args.report_only:
        cfgs = {m.key: load_config(m.recipe, [*m.overrides, *common]) for m in methods}
        epochs = {k: c.train.epochs for k, c in cfgs.items()}
        grace = {k: default_grace(c) for k, c in cfgs.items()}  # as `proxydml tune` picks it
        cap = max(c.train.max_steps_per_epoch * c.data.batch_size for c in cfgs.values())
        est = estimate_s(args.trials, args.seeds, epochs, SEEN_IMAGES, 5 * args.val_classes, TEST_IMAGES, methods,
                         epoch_cap=cap, grace=grace)
        total = sum(est.values())
        print(f"reality check: {len(methods)} part(s), {args.trials} trials per sweep (ASHA), "
              f"{args.seeds} seeds per method; "
              f"budget about {2 * total / 3600:.1f} CPU-hours = {total / 3600:.1f} h of wall time on 2 cores", flush=True)
        for m in methods:
            tuned = ("untuned" if not m.space else
                     f"grid {Path(m.space).stem} ({grid_points(m)} points x {epochs[m.key]} epochs)" if m.grid else
                     f"sweep {Path(m.space).stem} (ASHA from epoch {grace[m.key]}, about "
                     f"{asha_epochs(args.trials, epochs[m.key], grace[m.key]):.1f} epochs)")
            print(f"  part {m.key:20s} ~{est[m.key] / 60:4.0f} min  ({' '.join([m.recipe, *m.overrides])}, "
                  f"{epochs[m.key]} epochs, {tuned})", flush=True)
        for m in methods:
            part = state.part(m.key)
            t0 = time.perf_counter()
            config: Path | str = m.recipe
            if m.space:
                (folder / m.key).mkdir(exist_ok=True)
                config = run_sweep(m, part, args, common, env, folder / m.key)
                state.save()
            for seed in range(args.seeds):
                if str(seed) not in part["finals"]:
                    part["finals"][str(seed)] = run_final(config, seed, args, common, env)
                    state.save()
            print(f"part {m.key}: done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)

    table, data = summary(state, METHODS)
    print(table)
    if data["methods"]:
        publish(table, data, args, env, folder)
        print(f"report: {folder / 'report.html'} (also in MLflow, experiment {args.experiment!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
