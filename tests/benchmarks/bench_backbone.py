"""Backbone step time: one training step (forward + backward) of the embedding model.

Not collected by pytest (a script). Times ``EmbeddingModel`` steps for the memory layouts and
frozen-stage counts given, on random images; prints a table (median of ``--steps`` steps).

Usage::

    .venv/bin/python tests/benchmarks/bench_backbone.py                      # Lite0, 128 px, batch 64
    .venv/bin/python tests/benchmarks/bench_backbone.py --size 224 --frozen 0 2 4 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.config import ModelConfig  # noqa: E402
from pipelines.models import EmbeddingModel  # noqa: E402


def step_seconds(cfg: ModelConfig, batch: int, size: int, steps: int, seed: int = 0) -> float:
    """Median seconds of a forward + backward + SGD step at (batch, 3, size, size)."""
    g = torch.Generator().manual_seed(seed)
    model = EmbeddingModel(cfg).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.rand(batch, 3, size, size, generator=g)
    times = []
    for i in range(steps + 2):  # two warm-up steps (oneDNN picks its kernels)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="efficientnet_lite0")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--frozen", type=int, nargs="+", default=[0, 4], help="model.frozen_stages values")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"{args.backbone}, batch {args.batch}, {args.size} px, {torch.get_num_threads()} threads")
    print("| layout | frozen_stages | step s | vs NCHW, none frozen |")
    print("|---|---:|---:|---:|")
    base = None
    for channels_last in (False, True):
        for frozen in args.frozen:
            cfg = ModelConfig(backbone=args.backbone, embedding_dim=128, frozen_bn=True,
                              frozen_stages=frozen, channels_last=channels_last)
            s = step_seconds(cfg, args.batch, args.size, args.steps)
            base = base or s
            layout = "NHWC" if channels_last else "NCHW"
            print(f"| {layout} | {frozen} | {s:.3f} | {s / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
