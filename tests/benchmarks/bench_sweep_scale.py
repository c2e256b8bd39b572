"""Hundreds of ASHA trials on a two-node cluster, the sweep driver killed with SIGKILL midway and
the same command run again.

Not collected by pytest (a script: minutes of CPU). It starts a throw-away stack (MLflow server
and S3 on 127.0.0.1) and a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
two raylets with their own object stores, ``--cpus-per-node`` each), then runs ``proxydml tune``
as a user would, output piped: ASHA + Optuna over ``--trials`` one-worker digits trials of
``--epochs`` short epochs, checkpoints on S3. Once ``--kill-after`` trial runs exist, the driver
gets SIGKILL; the same command then resumes the sweep. It checks, and exits 1 if any fails:

- every trial has one child run under the sweep's parent run: FINISHED with every epoch, or
  KILLED at the rung ASHA stopped it (``asha.*`` tags), with its metric history up to there;
- no trial that had ended before the kill ran again: a finished or stopped trial's history
  (steps and timestamps) is the same after the resume, and a stopped trial stays stopped;
- each command's console stays under 60 lines.

A trial started after Tune last saved the sweep's state (every second) is unknown to the resumed
sweep. If it had ended, its run is adopted as one of the sweep's trials; if it was training, its
run is tagged ``sweep_lost``, closed, and counted apart (``lost``). Tune saves its trials and
its searcher as separate files, so the restored searcher may already have counted such a trial
toward ``--trials`` (checked: sweep trials + lost >= ``--trials``).

It prints the wall times, trials per hour, the driver's peak RSS and CPU time, and writes the
result as JSON (``--out``). Usage (~10 min on 2 cores)::

    .venv/bin/python tests/benchmarks/bench_sweep_scale.py --out /tmp/sweep-scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlflow.tracking import MlflowClient  # noqa: E402

from services.s3 import Credentials  # noqa: E402
from services.stack import Stack  # noqa: E402
from services.sweep import LOST_TAG  # noqa: E402

CONSOLE_LIMIT = 60


class Driver:
    """``proxydml tune`` in a subprocess, its output collected and its RSS and CPU time sampled."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.peak_rss_mb = 0.0
        self.cpu_s = 0.0
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while self.proc.poll() is None:
            try:
                status = Path(f"/proc/{self.proc.pid}/status").read_text()
                rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
                fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, StopIteration):
                break
            self.peak_rss_mb = max(self.peak_rss_mb, rss / 1024)
            self.cpu_s = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            time.sleep(0.5)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.wall_s = time.monotonic() - self.started
        time.sleep(0.5)  # the reader drains the pipe
        return rc


def children(client: MlflowClient) -> tuple[str | None, list[Any]]:
    parents = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                 filter_string="tags.kind = 'sweep'")
    if not parents:
        return None, []
    parent = parents[0]
    return parent.info.run_id, client.search_runs([parent.info.experiment_id], max_results=10_000,
                                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")


def history(client: MlflowClient, run_id: str) -> list[tuple[int, int]]:
    return [(m.step, m.timestamp) for m in client.get_metric_history(run_id, "map_at_r")]


def ended(run: Any) -> bool:
    """A trial that had finished (its own FINISHED) or that ASHA had stopped (its tags)."""
    return run.info.status == "FINISHED" or "asha.rung" in run.data.tags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="train.max_steps_per_epoch")
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=80, help="SIGKILL the driver once this many trial runs exist")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()

    from ray.cluster_utils import Cluster

    root = Path(tempfile.mkdtemp(prefix="pdml-scale-", dir="/tmp"))  # short: Ray's socket paths
    stack = Stack(root / "stack", s3_port=0, mlflow_port=0, s3_server="moto", store="sqlite",
                  credentials=Credentials("proxydml-scale-key", "proxydml-scale-secret"))
    cluster = None
    result: dict[str, Any] = {"trials": args.trials, "epochs": args.epochs, "concurrent": args.concurrent}
    failures: list[str] = []
    try:
        stack.up()
        # The raylets started below pass this environment on to every trial: the stack's S3 and
        # MLflow, a private Ray temp folder, and no per-trial system-metrics sampler.
        os.environ.update({**stack.client_env(with_credentials=True), "RAY_TMPDIR": str(root),
                           "PYTHONPATH": str(ROOT), "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"})
        env = dict(os.environ)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus_per_node,
                                                                "dashboard_host": "127.0.0.1"})
        cluster.add_node(num_cpus=args.cpus_per_node, temp_dir=str(root / "tmp-node1"))
        cluster.wait_for_nodes()
        command = [sys.executable, "-m", "services.cli", "tune", "--space", "digits_quick",
                   "--samples", str(args.trials), "--max-concurrent", str(args.concurrent), "--scheduler", "asha",
                   "--grace", "1", "--address", cluster.address,
                   f"train.epochs={args.epochs}", f"train.max_steps_per_epoch={args.steps}",
                   "scaling.num_workers=1", "scaling.cpus_per_worker=1",
                   f"tracking.tracking_uri={stack.tracking_uri}", "tracking.storage_path=s3://proxydml/sweeps"]
        client = MlflowClient(stack.tracking_uri)

        first = Driver(command, env, root)
        while first.proc.poll() is None and len(children(client)[1]) < args.kill_after:
            time.sleep(2)
        if first.proc.poll() is not None:
            failures.append(f"the first command ended before {args.kill_after} trials: {first.lines[-20:]}")
        first.proc.send_signal(signal.SIGKILL)
        first.wait(60)
        time.sleep(5)  # trials Ray tears down after their driver may still write a last record
        _, before = children(client)
        done_before = {r.data.tags["trial_id"]: history(client, r.info.run_id) for r in before if ended(r)}
        result["first"] = {"wall_s": round(first.wall_s, 1), "runs": len(before), "ended": len(done_before),
                           "console_lines": len(first.lines), "peak_rss_mb": round(first.peak_rss_mb),
                           "cpu_s": round(first.cpu_s, 1)}
        print(f"killed after {first.wall_s:.0f} s: {len(before)} trial runs, {len(done_before)} ended", flush=True)

        second = Driver(command, env, root)
        rc = second.wait(3600)
        result["second"] = {"wall_s": round(second.wall_s, 1), "rc": rc, "console_lines": len(second.lines),
                            "peak_rss_mb": round(second.peak_rss_mb), "cpu_s": round(second.cpu_s, 1)}
        if rc != 0:
            failures.append(f"the resumed command exited {rc}: {second.lines[-20:]}")
        for name, driver in (("first", first), ("second", second)):
            if len(driver.lines) >= CONSOLE_LIMIT:
                failures.append(f"{name} command printed {len(driver.lines)} lines")
        print("\n".join(second.lines[-12:]), flush=True)

        parent_id, after = children(client)
        # Runs of trials started after Tune last saved the sweep's state: closed and tagged.
        lost = [r for r in after if LOST_TAG in r.data.tags]
        if any(r.info.status == "RUNNING" for r in lost):
            failures.append("a lost trial's run was left open")
        after = [r for r in after if LOST_TAG not in r.data.tags]
        ids = [r.data.tags.get("trial_id") for r in after]
        # The restored searcher may count a lost trial it suggested toward --trials: then the sweep
        # holds fewer, and the lost runs make up the difference.
        if len(set(ids)) != len(after) or len(after) + len(lost) < args.trials:
            failures.append(f"{len(after)} trial runs ({len(set(ids))} distinct) and {len(lost)} lost, "
                            f"for {args.trials} trials")
        counts = {"FINISHED": 0, "KILLED": 0}
        stopped_at: dict[int, int] = {}
        beyond = 0
        for run in after:
            steps = [s for s, _ in history(client, run.info.run_id)]
            status, tags = run.info.status, run.data.tags
            counts[status] = counts.get(status, 0) + 1
            if status == "FINISHED":
                ok = set(steps) == set(range(1, args.epochs + 1))
            elif status == "KILLED":
                rung, epoch = int(tags.get("asha.rung", 0)), int(tags.get("asha.epoch", 0))
                stopped_at[rung] = stopped_at.get(rung, 0) + 1
                # Epochs past the stop: trained before the kill after the last saved state, then
                # retrained from the checkpoint that state registered (both records are kept).
                beyond += max(steps, default=0) > epoch
                ok = 1 <= rung <= epoch and set(range(1, epoch + 1)) <= set(steps) and tags.get("stopped_early") == "true"
            else:
                ok = False
            if not ok:
                failures.append(f"trial {tags.get('trial_id')}: {status}, steps {steps}, "
                                f"asha {({k: v for k, v in tags.items() if k.startswith('asha.')})}")
        every = {r.data.tags.get("trial_id"): r for r in [*after, *lost]}
        for trial_id, hist in done_before.items():
            if history(client, every[trial_id].info.run_id) != hist:
                failures.append(f"trial {trial_id} ended before the kill and ran again")
        result.update(runs=len(after), lost=len(lost), history_past_stop=beyond, statuses=counts, stopped_at_rung=dict(sorted(stopped_at.items())),
                      parent_run_id=parent_id, failures=failures[:20], failed_checks=len(failures))
        total = first.wall_s + second.wall_s
        result["trials_per_hour"] = round(args.trials / (total / 3600))
    finally:
        if cluster is not None:
            cluster.shutdown()
        stack.down()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
