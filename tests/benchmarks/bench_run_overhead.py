"""The fixed cost of one `proxydml train` on a warm local Ray cluster, and of a fresh process's
imports: what most of the test suite's time is made of (its runs train 0.2-1 s each).

    .venv/bin/python tests/benchmarks/bench_run_overhead.py [--runs 4] [--workers 2]

Prints, per run, the wall time and the machine's busy CPU-seconds (/proc/stat: every process,
Ray's included, which a parent's rusage misses), then each Ray process kind's CPU-seconds for
the last run, and the CPU-seconds of `import services.training` in a new interpreter.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def busy_cpu_s() -> float:
    """Machine-wide busy CPU-seconds so far (user + nice + system + irq + softirq)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / 100


def process_cpu() -> dict[int, tuple[int, str]]:
    """pid -> (CPU seconds so far, process name) for every process."""
    out = subprocess.run(["ps", "-eo", "pid,times,comm"], capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines()[1:]:
        pid, seconds, name = line.split(None, 2)
        rows[int(pid)] = (int(seconds), name)
    return rows


def _poll(seen: dict[int, tuple[int, str]], stop: threading.Event) -> None:
    """Sample every process while a run goes on: its actors exit with it."""
    while not stop.is_set():
        seen.update(process_cpu())
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from pipelines.config import load_config
    from services import runtime, training

    work = Path(tempfile.mkdtemp(prefix="bench-run-overhead-"))
    runtime.ensure_ray()
    per_kind: Counter[str] = Counter()
    for i in range(args.runs):
        cfg = load_config("digits", ["train.epochs=1", "train.max_steps_per_epoch=3",
                                     f"scaling.num_workers={args.workers}", f"tracking.storage_path={work / f'runs{i}'}",
                                     f"tracking.tracking_uri=sqlite:///{work / f'mlflow{i}.db'}"])
        last = i == args.runs - 1
        seen: dict[int, tuple[int, str]] = {}
        before = process_cpu()
        stop = threading.Event()

        poller = threading.Thread(target=_poll, args=(seen, stop), daemon=True)
        if last:
            poller.start()
        t0, c0 = time.monotonic(), busy_cpu_s()
        training.train(cfg, log_model=False)
        wall, cpu = time.monotonic() - t0, busy_cpu_s() - c0
        print(f"run {i + 1}/{args.runs} ({args.workers} worker(s)): {wall:.1f} s wall, {cpu:.1f} busy CPU-s", flush=True)
        if last:
            stop.set()
            poller.join()
            for pid, (seconds, name) in seen.items():
                per_kind[name] += seconds - before.get(pid, (0, ""))[0]
    runtime.shutdown_ray()
    print("\nlast run, CPU-s by process name (1 s resolution):")
    for name, seconds in per_kind.most_common(10):
        if seconds:
            print(f"  {seconds:4d}  {name}")
    cmd = [sys.executable, "-c", "import resource, services.training; "
           "r = resource.getrusage(resource.RUSAGE_SELF); print(f'{r.ru_utime + r.ru_stime:.2f}')"]
    imports = [float(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout) for _ in range(3)]
    print("\nimport services.training in a new process: " + ", ".join(f"{s:.2f}" for s in imports) + " CPU-s")


if __name__ == "__main__":
    main()
