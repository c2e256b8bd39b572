"""Benchmark: the stack's MLflow server under a team's logging load, PostgreSQL against sqlite.

Run from the repo root: ``python tests/benchmarks/bench_tracking_load.py`` (defaults: 64
clients, each logging 100 batches of 10 metrics as fast as it can, on a PostgreSQL stack and
then on a ``--single-user`` sqlite stack). Clients are threads spread over a few processes, so
the client side's own CPU does not cap the load on 2 cores. Each write goes through
``services.mlflow_tracking.call_with_retries`` (what ProxyDML's writers use). During the load
a one-line ``search_runs`` is issued every 0.5 s. Afterwards every run's metric history is
read back: a write counts as lost when its step is missing.

``run_load`` is also what ``tests/services/test_tracking_load.py`` runs at the suite's scale.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a plain script

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@dataclass
class LoadResult:
    """What one load run measured (latencies in seconds)."""

    clients: int
    batches: int
    metrics_per_batch: int
    wall_s: float
    failed_writes: int
    lost_points: int
    write_latencies: list[float] = field(repr=False)
    search_latencies: list[float] = field(repr=False)
    errors: list[str] = field(default_factory=list)

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, float]:
        w, s = self.write_latencies, self.search_latencies
        return {
            "clients": self.clients, "batches_per_s": len(w) / self.wall_s, "failed_writes": self.failed_writes,
            "lost_points": self.lost_points, "write_p50_ms": 1e3 * self.percentile(w, 0.5),
            "write_p99_ms": 1e3 * self.percentile(w, 0.99), "search_p50_ms": 1e3 * self.percentile(s, 0.5),
            "search_p99_ms": 1e3 * self.percentile(s, 0.99), "search_max_ms": 1e3 * max(s, default=float("nan")),
            "searches": len(s), "wall_s": self.wall_s,
        }


def _one_client(uri: str, exp_id: str, index: int, batches: int, n_metrics: int) -> tuple[str, list[float], list[str]]:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from services.mlflow_tracking import call_with_retries

    client = MlflowClient(uri)
    run_id = call_with_retries(lambda: client.create_run(exp_id, run_name=f"load-{index}").info.run_id)
    latencies, errors = [], []
    for step in range(batches):
        ts = int(time.time() * 1000)
        metrics = [Metric(f"m{k}", float(step * n_metrics + k), ts, step) for k in range(n_metrics)]
        start = time.perf_counter()
        try:
            call_with_retries(lambda metrics=metrics: client.log_batch(run_id, metrics=metrics))
        except Exception as exc:  # counted, and shown: a lost write is the benchmark's finding
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        latencies.append(time.perf_counter() - start)
    return run_id, latencies, errors


def _client_process(args: tuple[str, str, list[int], int, int]) -> list[tuple[str, list[float], list[str]]]:
    uri, exp_id, indices, batches, n_metrics = args
    with ThreadPoolExecutor(len(indices)) as pool:
        return list(pool.map(lambda i: _one_client(uri, exp_id, i, batches, n_metrics), indices))


def run_load(uri: str, *, clients: int = 64, batches: int = 100, metrics_per_batch: int = 10,
             processes: int = 4, experiment: str | None = None) -> LoadResult:
    """``clients`` concurrent writers against the server at ``uri``; see the module doc."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    name = experiment or f"load-{os.getpid()}-{time.monotonic_ns()}"
    exp_id = client.create_experiment(name)
    stop = threading.Event()
    searches: list[float] = []

    def search() -> None:
        probe = MlflowClient(uri)
        while not stop.is_set():
            start = time.perf_counter()
            probe.search_runs([exp_id], max_results=1)
            searches.append(time.perf_counter() - start)
            stop.wait(0.5)

    searcher = threading.Thread(target=search, daemon=True)
    groups = [list(range(clients))[p::processes] for p in range(processes)]
    started = time.perf_counter()
    searcher.start()
    ctx = mp.get_context("spawn")  # no fork of a process holding MLflow's HTTP pools
    with ctx.Pool(processes) as pool:
        results = [r for group in pool.map(_client_process, [(uri, exp_id, g, batches, metrics_per_batch)
                                                               for g in groups if g]) for r in group]
    wall = time.perf_counter() - started
    stop.set()
    searcher.join()
    lost = 0
    for run_id, _, _ in results:
        for k in range(metrics_per_batch):
            steps = {m.step for m in client.get_metric_history(run_id, f"m{k}")}
            lost += batches - len(steps & set(range(batches)))
    errors = [e for _, _, errs in results for e in errs]
    return LoadResult(clients, batches, metrics_per_batch, wall, len(errors), lost,
                      [x for _, lat, _ in results for x in lat], searches, errors[:5])


def main() -> None:
    from services.stack import Stack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--metrics", type=int, default=10, help="metrics per batch")
    parser.add_argument("--processes", type=int, default=4, help="client processes (clients are threads in them)")
    parser.add_argument("--stores", nargs="+", default=["postgresql", "sqlite"], choices=["postgresql", "sqlite"])
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    rows = {}
    for store in args.stores:
        base = Path(tempfile.mkdtemp(prefix="proxydml-load-"))
        base.chmod(0o755)  # PostgreSQL's account must reach its folder when we run as root
        stack = Stack(base / "stack", s3_port=0, mlflow_port=0, store=store)
        try:
            stack.up()
            result = run_load(stack.tracking_uri, clients=args.clients, batches=args.batches,
                              metrics_per_batch=args.metrics, processes=args.processes)
        finally:
            stack.down()
        rows[store] = result.summary()
        print(f"{store}: {json.dumps(rows[store])}", flush=True)
        for err in result.errors:
            print(f"  error: {err}")
    keys = list(next(iter(rows.values())))
    print("\n| figure | " + " | ".join(rows) + " |\n|---|" + "---:|" * len(rows))
    for key in keys:
        cells = [f"{row[key]:.1f}" if isinstance(row[key], float) else str(row[key]) for row in rows.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
