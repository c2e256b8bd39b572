"""GPU checks of the class-sharded losses; run by tests/gpu/check_gpu.sh (one CUDA GPU, < 5 min).

1. W = 1 on the GPU against float64 on the CPU, every loss (and Proxy Synthesis): float32
   (loss and gradients to 1e-4) and bf16-autocast embeddings upcast to float32, the way the
   train loop feeds the loss (loss to 1e-5 of the CPU loss of the same bf16 values).
2. W = 2 ranks sharing the GPU (gloo with CUDA tensors: nccl refuses two ranks on one GPU):
   the equivalence worker of tests/distributed (every loss, W = 2 against W = 1, 5 steps).
3. The train loop on the GPU (digits, 1 epoch, bf16 autocast, the loss in float32).
4. Throughput: step time (all-gather + loss forward/backward + Adam on the proxies) at
   C = 1M, d = 512, B = 1024 on one GPU, loss called plainly and inside a bf16 autocast region
   (where it still computes in float32: the same loss), with peak GPU memory.
Prints PASS/FAIL per part and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxies import build_loss  # noqa: E402
from tests.distributed import sharded_workers as workers  # noqa: E402


def part1() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, spec in workers.SPECS.items():
        x, y = workers.global_batch(0, workers.D, torch.float64, "cpu")
        cpu = workers.build(spec, None, torch.float64, "cpu")
        gpu = workers.build(spec, None, torch.float32, "cuda")
        workers.prime_isa(cpu, "cpu")
        workers.prime_isa(gpu, "cuda")
        xc = x.clone().requires_grad_()
        lc = cpu(xc, y)
        lc.backward()
        xg = x.float().cuda().requires_grad_()
        lg = gpu(xg, y.cuda())
        lg.backward()
        for what, a, b in (("loss", lg, lc), ("d/dx", xg.grad, xc.grad), ("d/dp", gpu.proxies.grad, cpu.proxies.grad)):
            torch.testing.assert_close(a.detach().double().cpu(), b.detach(), atol=1e-4, rtol=1e-4, msg=f"{name} {what}")
        # bf16 embeddings (upcast), loss in float32 on the GPU vs float64 on the CPU
        x16 = x.to(torch.bfloat16)
        cpu2 = workers.build(spec, None, torch.float64, "cpu")
        gpu2 = workers.build(spec, None, torch.float32, "cuda")
        ref = cpu2(x16.double(), y)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = x16.cuda() * 1.0  # a bf16 tensor, as an autocast embedder returns
        got = gpu2(emb.float(), y.cuda())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double().cpu(), ref, atol=1e-5, rtol=1e-5, msg=f"{name} bf16 loss")
        print(f"  {name}: ok", flush=True)


def part2() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(workers.equivalence_worker, args=(2, str(Path(tmp) / "store"), "cuda"),
                                    nprocs=2, join=True)


def part3() -> None:
    from pipelines.config import load_config
    from pipelines.tracking import LocalReporter
    from pipelines.train import run

    with tempfile.TemporaryDirectory() as tmp:
        metrics = run(load_config("digits", ["train.epochs=1", "train.max_steps_per_epoch=10"]), LocalReporter(Path(tmp)))
    print(f"  digits on the GPU: loss {metrics['loss']:.4f} R@1 {metrics['recall_at_1']:.3f}")


def part4(classes: int, dim: int, batch: int, steps: int) -> None:
    print("| loss | called | step ms (median) | peak GPU GiB |")
    print("|---|---|---|---|")
    for name in ("proxy_anchor", "norm_softmax", "proxy_isa"):
        for bf16 in (False, True):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            loss = build_loss({"name": name}, classes, dim, generator=torch.Generator().manual_seed(0)).cuda()
            opt = torch.optim.Adam(loss.parameters(), lr=1e-3)
            g = torch.Generator(device="cuda").manual_seed(1)
            times = []
            for step in range(steps + 2):
                x = torch.randn(batch, dim, device="cuda", generator=g).requires_grad_()
                y = torch.randint(0, classes, (batch,), device="cuda", generator=g)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                    value = loss(x, y)
                opt.zero_grad(set_to_none=False)
                value.backward()
                opt.step()
                torch.cuda.synchronize()
                if step >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            peak = torch.cuda.max_memory_allocated() / 2**30
            where = "inside bf16 autocast" if bf16 else "plain"
            print(f"| {name} | {where} | {times[len(times) // 2]:.1f} | {peak:.1f} |", flush=True)
            del loss, opt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--classes", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    parts = [
        ("1 W=1 GPU vs CPU float64, fp32 and bf16 embeddings", part1),
        ("2 W=2 on one GPU (gloo + CUDA tensors) vs W=1", part2),
        ("3 train loop on the GPU (bf16 autocast)", part3),
        ("4 throughput", lambda: part4(a.classes, a.dim, a.batch, a.steps)),
    ]
    failed = 0
    for title, fn in parts:
        t0 = time.perf_counter()
        print(f"== {title}", flush=True)
        try:
            fn()
            print(f"PASS {title} ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception:  # noqa: BLE001 - report every part
            traceback.print_exc()
            print(f"FAIL {title} ({time.perf_counter() - t0:.0f} s)", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
