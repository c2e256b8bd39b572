"""Forward + backward time of every loss next to its GEMM floor and pytorch-metric-learning.

Run: ``.venv/bin/python tests/benchmarks/bench_losses.py [--threads 2] [--sizes small,large]``.
Not collected by pytest (no test functions). Prints a markdown table:
loss | size | ours ms | floor ms | ratio | in-step | PML ms | speed-up.

The floor of one step is the three GEMMs every proxy loss needs: ``S = x̂ p̂ᵀ`` (forward),
``dS p̂`` and ``dSᵀ x̂`` (backward), on already-normalised operands. Times are the best of
``--rounds`` interleaved rounds after one warm-up (each round times every step once, so a
loss and its floor see the same load; best-of is the least noisy statistic on a shared machine).
PML (``pip install pytorch-metric-learning``, a benchmark-only dependency) is measured in
the same run for Proxy-Anchor, Norm-Softmax and ProxyNCA++ when it is installed.

``in-step`` is a load-robust estimate of the same ratio: in profiled steps of our loss,
(time of all ops) / (time of its GEMMs). On a busy shared machine the wall-clock ratio is
noise (and with 2 threads every multi-threaded op waits for a descheduled partner thread);
compare ``--threads 1`` runs and the in-step column there.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxies import LOSSES, ProxySynthesis  # noqa: E402

SIZES = {"small": (128, 11318, 512), "large": (256, 100000, 512)}


class _Timer:
    """Best-of timing of several steps measured in interleaved rounds.

    On a shared machine the load changes by the second: every round times each step once,
    so a loss and its floor see the same conditions; the best of the rounds is kept.
    """

    def __init__(self) -> None:
        self.best: dict[str, float] = {}

    def run(self, key: str, fn: Callable[[], None]) -> None:
        gc.collect()
        t0 = time.perf_counter()
        fn()
        self.best[key] = min(self.best.get(key, float("inf")), (time.perf_counter() - t0) * 1e3)


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul")


def profiled_ratio(step: Callable[[], None], rounds: int) -> float:
    """Median over ``rounds`` profiled steps of (all op time) / (GEMM op time) in that step.

    Both parts are measured within the same step, so machine load largely cancels; the
    profiler's per-op overhead counts as non-GEMM time (the estimate is pessimistic).
    """
    from torch.profiler import ProfilerActivity, profile

    ratios = []
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        total = gemm = 0.0
        for ev in prof.key_averages():
            total += ev.self_cpu_time_total
            if ev.key in _GEMM_OPS:
                gemm += ev.self_cpu_time_total
        ratios.append(total / max(gemm, 1e-9))
    ratios.sort()
    return ratios[len(ratios) // 2]


def floor_step(b: int, c: int, d: int) -> Callable[[], None]:
    """The three GEMMs of one step, on normalised operands."""
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=1)
    p = torch.nn.functional.normalize(torch.randn(c, d, generator=g), dim=1)
    ds = torch.randn(b, c, generator=g)

    def step() -> None:
        s = x @ p.t()
        dx = ds @ p
        dp = ds.t() @ x
        del s, dx, dp

    return step


def _inputs(b: int, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, d, generator=g).requires_grad_()
    # class-balanced-like labels, 8 samples per class
    y = torch.randint(0, c, (b // 8,), generator=g).repeat_interleave(8)
    return x, y


def loss_step(loss: torch.nn.Module, b: int, c: int, d: int) -> Callable[[], None]:
    x, y = _inputs(b, c, d)
    params = list(loss.parameters())

    def step() -> None:
        x.grad = None
        for q in params:
            q.grad = None
        loss(x, y).backward()

    return step


def pml_factories(c: int, d: int) -> dict[str, Callable[[], torch.nn.Module]] | None:
    try:
        from pytorch_metric_learning import losses as pml
    except ImportError:
        return None
    return {
        "proxy_anchor": lambda: pml.ProxyAnchorLoss(c, d, margin=0.1, alpha=32),
        "norm_softmax": lambda: pml.NormalizedSoftmaxLoss(c, d, temperature=1 / 23),
        "proxy_nca_pp": lambda: pml.ProxyNCALoss(c, d, softmax_scale=9),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="small,large", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--losses", default=",".join(LOSSES), help="comma list of registry names")
    ap.add_argument("--ps", default="norm_softmax", help="loss to also time wrapped in Proxy Synthesis ('' = none)")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (0: 7 small, 3 large)")
    ap.add_argument("--no-pml", action="store_true", help="skip pytorch-metric-learning")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled (load-robust) ratio")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n for n in args.losses.split(",") if n]

    use_pml = not args.no_pml
    if use_pml and pml_factories(1, 1) is None:
        use_pml = False
        print("pytorch-metric-learning is not installed: the PML columns stay empty "
              "(pip install pytorch-metric-learning)", file=sys.stderr)

    rows = []
    for size in args.sizes.split(","):
        b, c, d = SIZES[size]
        rounds = args.rounds or (7 if size == "small" else 3)
        # (row name, floor key, step); one floor per distinct GEMM shape
        steps: dict[str, Callable[[], None]] = {"floor": floor_step(b, c, d)}
        entries: list[tuple[str, str, str | None]] = []
        for name in names:
            kw = {"memory_size": 55000} if name == "proxy_isa" else {}
            loss = LOSSES[name](c, d, **kw)
            if name == "proxy_isa":
                loss.set_epoch(3)  # memory and filter on: the most expensive phase
            steps[name] = loss_step(loss, b, c, d)
            pml_key = None
            factories = pml_factories(c, d) if use_pml else None
            if factories is not None and name in factories:
                pml_key = f"pml:{name}"
                steps[pml_key] = loss_step(factories[name](), b, c, d)
            entries.append((name, "floor", pml_key))
        if args.ps:
            # mu = 1: B synthetic samples and proxies; the floor is the GEMMs at that size
            steps["floor_ps"] = floor_step(2 * b, c + b, d)
            key = f"ps({args.ps})"
            steps[key] = loss_step(ProxySynthesis(LOSSES[args.ps](c, d), mu=1.0), b, c, d)
            entries.append((key, "floor_ps", None))
        timer = _Timer()
        for fn in steps.values():
            fn()  # warm-up
        for r in range(rounds):
            for key, fn in steps.items():
                timer.run(key, fn)
            print(f"  {size}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        for name, floor_key, pml_key in entries:
            prof = None if args.no_profile else profiled_ratio(steps[name], 3)
            rows.append((name, f"B={b} C={c} d={d}", timer.best[name], timer.best[floor_key],
                         timer.best.get(pml_key) if pml_key else None, prof))
        del steps
        gc.collect()

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, best of interleaved rounds; "
          "ratio = ours / floor; in-step = (all op time) / (GEMM time) inside our own step "
          "(profiled, load-robust)\n")
    print("| loss | size | ours ms | floor ms | ratio | in-step | PML ms | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, size, ours, fl, pml_ms, prof in rows:
        pml_s = f"{pml_ms:.1f}" if pml_ms is not None else "-"
        sp = f"{pml_ms / ours:.2f}x" if pml_ms is not None else "-"
        pr = f"{prof:.2f}" if prof is not None else "-"
        print(f"| {name} | {size} | {ours:.1f} | {fl:.1f} | {ours / fl:.2f} | {pr} | {pml_s} | {sp} |")


if __name__ == "__main__":
    main()
