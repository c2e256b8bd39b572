"""Ray Tune benchmark: the same trials with ASHA and without, on the emoji recipe.

Not collected by pytest (a script). Samples ``--trials`` configs once from the search space
(seeded Latin hypercube: every dimension's range is covered evenly, so the learning rate runs
from too small to too large) and runs them as two sweeps through ``services.sweep.run_sweep``
on one local Ray cluster: ``asha`` (grace period ``--grace``, reduction factor ``--rf``) and
``none`` (every trial trains all ``--epochs``). MLflow goes to a sqlite store and Ray storage
to a scratch folder (removed at the end unless ``--workdir`` is given). Prints markdown tables:
per trial, its epochs and last MAP@R under each scheduler; per sweep, the epochs spent (sum
over trials of the epochs each trained), the best MAP@R (the best trial's last epoch: what the
sweep picks), failed trials and the wall time; then epochs(ASHA)/epochs(none).
Target (the issue): ASHA reaches the same best MAP@R (within ``--tol``) with at most a third of
the epochs.

Cost: every epoch ends with an evaluation of all ~4k unseen-class images (Lite0 forward,
~4 ms an image at 32 px, ~8 ms at 64 px on one core), ~20 s at 32 px, which is why the
defaults train few steps per epoch at 32 px (each trial also pays ~25 s of Ray start-up).

Usage (full defaults, 9 trials x 9 epochs, 8 steps, 32 px: ~30 min on 2 CPU cores; the smoke
run below ~7 min)::

    .venv/bin/python tests/benchmarks/bench_tune.py --out bench_tune.json
    .venv/bin/python tests/benchmarks/bench_tune.py --trials 3 --epochs 2 --max-steps 3
    .venv/bin/python tests/benchmarks/bench_tune.py --image-size 64 --max-steps 20   # the recipe's size, ~1 h
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# MLflow's per-trial system-metrics sampler only takes CPU from the trials here.
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

from pipelines.config import ConfigError, load_config  # noqa: E402
from pipelines.data.emoji_build import ensure_built  # noqa: E402
from services import sweep  # noqa: E402

METRIC = "map_at_r"


def sample_points(dims: list[sweep.Dimension], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` configs, Latin-hypercube sampled: each dimension's range cut into ``n`` strata, one
    value per stratum, strata shuffled per dimension. With only ~9 trials plain random draws
    can miss a whole end of the learning-rate range; this cannot. The list order (random) is
    the order the trials start in, which matters to asynchronous ASHA."""
    rng = random.Random(seed)
    columns: dict[str, list[Any]] = {}
    for d in dims:
        strata = list(range(n))
        rng.shuffle(strata)
        if d.kind in ("loguniform", "uniform"):
            low, high = float(d.values[0]), float(d.values[1])
            log = d.kind == "loguniform"
            lo, hi = (math.log(low), math.log(high)) if log else (low, high)
            values = []
            for s in strata:
                x = lo + (s + rng.random()) / n * (hi - lo)
                # 3 significant digits keep the printed tables and MLflow params readable.
                values.append(min(max(float(f"{math.exp(x) if log else x:.3g}"), low), high))
            columns[d.key] = values
        elif d.kind == "randint":
            low, high = int(d.values[0]), int(d.values[1])
            columns[d.key] = [low + (s * (high - low)) // n for s in strata]
        elif d.kind == "choice":
            columns[d.key] = [d.values[s % len(d.values)] for s in strata]
        else:  # a grid fixes the trials itself: nothing to share between the two sweeps
            raise ConfigError(f"{d.key}: grid dimensions cannot be sampled; use loguniform/uniform/randint/choice")
    return [{key: col[i] for key, col in columns.items()} for i in range(n)]


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def summarize(trials: list[dict[str, Any]], points: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One sweep's numbers; trials matched to the shared points by their params."""
    index = {_key(p): i for i, p in enumerate(points)}
    rows = []
    for t in trials:
        rows.append({
            "point": index.get(_key(t["params"]), -1),
            "trial_id": t["trial_id"],
            "params": t["params"],
            # An errored trial that never reported counts no epochs (its partial epoch is in the wall time).
            "epochs": int(t["epochs"] or 0),
            METRIC: t["metric"],
            "error": t["error"],
        })
    rows.sort(key=lambda r: r["point"])
    scored = [r for r in rows if r[METRIC] is not None and math.isfinite(r[METRIC])]
    best = max(scored, key=lambda r: r[METRIC]) if scored else None
    return {
        "epochs": sum(r["epochs"] for r in rows),
        "wall_s": wall_s,
        "best_" + METRIC: best[METRIC] if best else None,
        "best_point": best["point"] if best else None,
        "best_params": best["params"] if best else None,
        "errors": sum(1 for r in rows if r["error"]),
        "trials": rows,
    }


def verdict(results: dict[str, dict[str, Any]], max_epochs: int, tol: float) -> dict[str, Any]:
    """ASHA against none: epochs ratio, best-metric gap, and whether the issue's target holds."""
    if "asha" not in results or "none" not in results:
        return {}
    asha, none = results["asha"], results["none"]
    ratio = asha["epochs"] / none["epochs"] if none["epochs"] else math.nan
    a, b = asha["best_" + METRIC], none["best_" + METRIC]
    gap = a - b if a is not None and b is not None else math.nan
    # Did ASHA train the no-scheduler winner to the end? (same seed: then its score is the same)
    winner = next((r for r in asha["trials"] if r["point"] == none["best_point"]), None)
    kept = winner is not None and winner["epochs"] >= max_epochs
    return {
        "epochs_ratio": ratio,
        "best_gap": gap,
        "asha_kept_winner": kept,
        "target_met": bool(ratio <= 1 / 3 + 1e-9 and gap >= -tol),
        "wall_ratio": asha["wall_s"] / none["wall_s"] if none["wall_s"] else math.nan,
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def print_tables(points: list[dict[str, Any]], results: dict[str, dict[str, Any]], max_epochs: int,
                 v: dict[str, Any], tol: float) -> None:
    keys = list(points[0]) if points else []
    scheds = list(results)
    head = ["#", *keys] + [f"{s} {c}" for s in scheds for c in ("epochs", "MAP@R")]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    by_point = {s: {r["point"]: r for r in results[s]["trials"]} for s in scheds}
    for i, p in enumerate(points):
        cells = [str(i), *(_fmt(p[k]) for k in keys)]
        for s in scheds:
            r = by_point[s].get(i)
            if r is None:
                cells += ["", ""]
                continue
            metric = "error" if r["error"] and r[METRIC] is None else (f"{r[METRIC]:.4f}" if r[METRIC] is not None else "n/a")
            cells += [str(r["epochs"]), metric]
        print("| " + " | ".join(cells) + " |")
    print()
    print("| scheduler | trials | epochs spent | of max | best MAP@R | best # | failed | wall min |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in scheds:
        r = results[s]
        best = r["best_" + METRIC]
        print(f"| {s} | {len(r['trials'])} | {r['epochs']} | {len(r['trials']) * max_epochs} | "
              f"{f'{best:.4f}' if best is not None else 'n/a'} | {_fmt(r['best_point'])} | {r['errors']} | "
              f"{r['wall_s'] / 60:.1f} |")
    if v:
        print()
        print(f"epochs ASHA / none = {v['epochs_ratio']:.3f} (target <= 0.333); "
              f"wall ASHA / none = {v['wall_ratio']:.2f}")
        print(f"best MAP@R ASHA - none = {v['best_gap']:+.4f} (tolerance {tol}); "
              f"ASHA trained the no-scheduler winner to the end: {'yes' if v['asha_kept_winner'] else 'no'}")
        print(f"target met: {'yes' if v['target_met'] else 'no'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="emoji_proxy_anchor", help="base recipe (default emoji_proxy_anchor)")
    ap.add_argument("--space", default="emoji_proxy_anchor", help="search space (name under configs/search or YAML)")
    ap.add_argument("--root", default=str(ROOT / "data" / "emoji"), help="built emoji folder (built if missing)")
    ap.add_argument("--trials", type=int, default=9, help="trials per sweep, the same configs in both (default 9)")
    ap.add_argument("--epochs", type=int, default=9, help="max epochs per trial, train.epochs (default 9)")
    ap.add_argument("--max-steps", type=int, default=8,
                    help="train.max_steps_per_epoch (default 8; 0 = full epochs, ~62 steps)")
    ap.add_argument("--image-size", type=int, default=32,
                    help="data.image_size and data.eval_resize (default 32; the recipe's is 64)")
    ap.add_argument("--workers", type=int, default=1, help="Ray Train workers per trial (default 1)")
    ap.add_argument("--max-concurrent", type=int, default=2, help="trials at once (default 2)")
    ap.add_argument("--grace", type=int, default=None,
                    help="ASHA grace period in epochs (default: the first after optim.warmup_epochs)")
    ap.add_argument("--rf", type=int, default=3, help="ASHA reduction factor (default 3)")
    ap.add_argument("--schedulers", nargs="+", default=["asha", "none"], choices=["asha", "none"])
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled configs and of train.seed")
    ap.add_argument("--tol", type=float, default=0.01, help="MAP@R gap still counted as the same best (default 0.01)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra dotted config overrides")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: a local one)")
    ap.add_argument("--workdir", default="", help="keep Ray storage and the MLflow store here (default: a temp dir)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)

    root = ensure_built(args.root)
    # A fresh folder per run: a sweep's name is its config hash, and an existing one would be resumed.
    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="bench-tune-"))
    work.mkdir(parents=True, exist_ok=True)
    from services.mlflow_tracking import local_store

    uri, _ = local_store(work / "mlruns")
    size = args.image_size
    overrides = [
        f"data.root={root.resolve()}", f"train.epochs={args.epochs}", f"train.max_steps_per_epoch={args.max_steps}",
        f"data.image_size={size}", f"data.eval_resize={size}", f"scaling.num_workers={args.workers}",
        f"train.seed={args.seed}", f"tracking.tracking_uri={uri}", f"tracking.storage_path={work / 'runs'}",
        *args.set,
    ]
    base = load_config(args.recipe, overrides)
    spec = sweep.load_sweep(base, args.space, samples=args.trials, scheduler="none", search="random",
                            max_concurrent=None, cluster_cpus=math.inf, metric=METRIC,
                            grace_period=args.grace, reduction_factor=args.rf)
    points = sample_points(spec.space, args.trials, args.seed)
    print(f"bench_tune: {args.trials} trials x {args.epochs} epochs ({args.max_steps or 'all'} steps, {size} px, "
          f"{args.workers} worker(s)), {args.max_concurrent} at once; ASHA grace {spec.grace_period} rf {args.rf}; "
          f"work dir {work}", flush=True)

    from services import runtime

    # Start Ray before the clocks: its start-up is not part of either sweep.
    runtime.ensure_ray(args.address)
    results: dict[str, dict[str, Any]] = {}
    payload: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                               "points": points, "sweeps": results}
    try:
        for sched in args.schedulers:
            print(f"\n== sweep with scheduler {sched} ==", flush=True)
            t0 = time.perf_counter()
            out = sweep.run_sweep(base, args.space, samples=args.trials, scheduler=sched, search="random",
                                  max_concurrent=args.max_concurrent, metric=METRIC, address=args.address,
                                  grace_period=args.grace, reduction_factor=args.rf, points=points)
            results[sched] = {"sweep": out.name, **summarize(out.trials, points, time.perf_counter() - t0)}
            if args.out:  # after each sweep: a crash in the second keeps the first
                Path(args.out).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    finally:
        runtime.shutdown_ray()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    v = verdict(results, args.epochs, args.tol)
    payload["verdict"] = v
    print()
    print_tables(points, results, args.epochs, v, args.tol)
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
