"""Class-sharded proxies: per-rank proxy memory and step time, W = 1 vs W = 2 (gloo, CPU).

Run: ``.venv/bin/python tests/benchmarks/bench_sharding.py [--classes 200000] [--dim 512]
[--batch 256] [--steps 8] [--loss proxy_anchor,norm_softmax]``. Not collected by pytest.

One step = what a rank does per training step besides its backbone: all-gather the
embeddings (with gradient), the loss of its proxy shard on the global batch (forward and
backward, the combining all-reduces included) and Adam on its proxies. The embeddings are a
leaf tensor per rank (the global batch split over the ranks). Per-worker resources are
equal: W = 1 is one process with one thread, W = 2 two processes with one thread each
(gloo over loopback, FileStore rendezvous); W = 1 with two threads (the whole 2-core
machine in one process) is printed as well. Memory is the bytes of the rank's proxy tensors
(parameter, gradient, Adam's two moments), plus the process' peak RSS.
Times: median and best of ``--steps`` steps after two warm-up steps; wall clock, and the
CPU time of the step (the slowest rank's): on a shared machine, where other jobs take CPU
from the ranks, the CPU time is what the step costs on dedicated cores (the collectives
only wait, they add little CPU time; their wall time is in the wall column).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxies import ShardContext, build_loss  # noqa: E402


def _proxy_bytes(loss: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for p in loss.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def worker(rank: int, world: int, store: str, args: dict, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for name in args["losses"]:
        shard = ShardContext.from_process_group(args["classes"])
        loss = build_loss({"name": name}, args["classes"], args["dim"], generator=torch.Generator().manual_seed(0),
                          shard=shard)
        optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        b = args["batch"] // world
        times, cpu_times = [], []
        for step in range(args["steps"] + 2):
            x_all = torch.randn(args["batch"], args["dim"], generator=g)
            y_all = torch.randint(0, args["classes"], (args["batch"],), generator=g)
            x = x_all[rank * b : (rank + 1) * b].clone().requires_grad_()
            y = y_all[rank * b : (rank + 1) * b]
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            value = loss(shard.gather_embeddings(x, ddp_average=False), shard.all_gather(y))
            optimizer.zero_grad(set_to_none=False)
            value.backward()
            optimizer.step()
            cpu = torch.tensor([(time.process_time() - c0) * 1e3], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(cpu, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
            if step >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
                cpu_times.append(float(cpu))
        results[name] = {
            "median_ms": statistics.median(times), "best_ms": min(times),
            "cpu_median_ms": statistics.median(cpu_times), "cpu_best_ms": min(cpu_times),
            "proxy_bytes": _proxy_bytes(loss, optimizer), "rows": shard.num_local,
        }
        del loss, optimizer
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, threads: int, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        torch.multiprocessing.spawn(worker, args=(world, str(Path(tmp) / "store"), args, threads, out),
                                    nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="global batch (split over the ranks)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss", default="proxy_anchor,norm_softmax")
    a = ap.parse_args()
    args = {"classes": a.classes, "dim": a.dim, "batch": a.batch, "steps": a.steps, "losses": a.loss.split(",")}
    runs = {
        "W=1 (1 thread)": measure(1, 1, args),
        "W=2 (2 x 1 thread)": measure(2, 1, args),
        "W=1 (2 threads)": measure(1, 2, args),
    }
    print(f"C={a.classes} d={a.dim} global batch={a.batch}, {a.steps} steps; per-rank numbers (rank 0)\n")
    print("| loss | run | proxy rows | proxy MB (param+grad+Adam) | wall ms median / best | vs W=1 | "
          "CPU ms median / best | vs W=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args["losses"]:
        base = runs["W=1 (1 thread)"][name]
        for run, res in runs.items():
            r = res[name]
            print(f"| {name} | {run} | {r['rows']} | {r['proxy_bytes'] / 2**20:.0f} | "
                  f"{r['median_ms']:.0f} / {r['best_ms']:.0f} | {r['median_ms'] / base['median_ms']:.2f}x | "
                  f"{r['cpu_median_ms']:.0f} / {r['cpu_best_ms']:.0f} | "
                  f"{r['cpu_median_ms'] / base['cpu_median_ms']:.2f}x |")
    print("\npeak RSS MB (rank 0): " + ", ".join(f"{k}: {v['peak_rss_mb']:.0f}" for k, v in runs.items()))
    print(json.dumps({k: v for k, v in runs.items()}))


if __name__ == "__main__":
    main()
