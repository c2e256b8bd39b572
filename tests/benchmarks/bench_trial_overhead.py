"""Per-trial fixed cost of a sweep: wall time against what the trials themselves computed.

Not collected by pytest (a script). Runs one sweep through ``services.sweep.run_sweep`` on a
fresh local Ray instance: ``--trials`` one-epoch trials of ``--config`` (random search over
``--space``, no scheduler), ``--concurrent`` at a time, MLflow in a scratch sqlite store. Each
trial's own time is its epoch's training plus evaluation (``epoch_time_s + eval_time_s``, read
back from its MLflow run). With ``c`` trials at once the fixed cost of one trial is

    (c x wall - sum of the trials' own times) / trials

which is everything else a trial costs: process and worker start-up, imports, data, the MLflow
run, checkpoint upload, Tune's bookkeeping. Ray's own start-up is outside ``wall``.

Usage (32 digits trials: ~2 min on 2 cores with one-worker trials)::

    .venv/bin/python tests/benchmarks/bench_trial_overhead.py
    .venv/bin/python tests/benchmarks/bench_trial_overhead.py --config emoji_proxy_anchor --space emoji_proxy_anchor \\
        --trials 8 --set data.image_size=32 --set train.max_steps_per_epoch=8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# MLflow's per-trial system-metrics sampler only takes CPU from the trials here.
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

from mlflow.tracking import MlflowClient  # noqa: E402

from pipelines.config import load_config  # noqa: E402
from services import runtime, sweep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="digits")
    parser.add_argument("--space", default="digits_quick")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="scaling.num_workers of each trial")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-trials-"))
    uri = f"sqlite:///{work / 'mlflow.db'}"
    base = load_config(args.config, ["train.epochs=1", f"scaling.num_workers={args.workers}",
                                     f"tracking.tracking_uri={uri}", f"tracking.storage_path={work / 'runs'}",
                                     *args.set])
    try:
        runtime.ensure_ray()  # outside the timed part: a sweep joins a running cluster
        started = time.monotonic()
        out = sweep.run_sweep(base, args.space, samples=args.trials, scheduler="none", search="random",
                              max_concurrent=args.concurrent)
        wall = time.monotonic() - started
        client = MlflowClient(uri)
        exp = client.get_run(out.parent_run_id).info.experiment_id
        children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{out.parent_run_id}'")
        own = [c.data.metrics.get("epoch_time_s", 0.0) + c.data.metrics.get("eval_time_s", 0.0) for c in children]
        failed = sum(t["error"] is not None for t in out.trials)
    finally:
        runtime.shutdown_ray()
        shutil.rmtree(work, ignore_errors=True)
    fixed = (args.concurrent * wall - sum(own)) / args.trials
    result = {"config": args.config, "overrides": args.set, "trials": args.trials, "finished_runs": len(children),
              "failed": failed, "concurrent": args.concurrent, "workers": args.workers, "wall_s": round(wall, 1),
              "trial_own_s_sum": round(sum(own), 1), "trial_own_s_mean": round(sum(own) / max(1, len(own)), 2),
              "fixed_cost_per_trial_s": round(fixed, 2)}
    print("| trials | workers each | at once | wall | sum of trials' own time | fixed cost per trial |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.trials} | {args.workers} | {args.concurrent} | {wall:.0f} s | {sum(own):.0f} s | {fixed:.1f} s |")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
