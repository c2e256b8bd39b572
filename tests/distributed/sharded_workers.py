"""Worker code of the class-sharding tests, run in forked children (tests/distributed/launch.py).

A module of its own (not a test file): pytest's importlib mode gives test files names that
a child process cannot import. Every worker builds the W = 1 reference in-process (no
process group involved) and the sharded version on its rank, and compares the parts it
owns, so a mismatch raises in the child with a readable message and fails the launch.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import proxies.fused as pf
import proxies.sharding as sharding
from proxies import ShardContext, build_loss, effective_number

C, D, B, DIN = 11, 16, 24, 8  # classes, embedding dim, GLOBAL batch, model input dim
STEPS = 5
PS = {"enabled": True, "alpha": 0.4, "mu": 1.0}
BASE_SPECS: dict[str, dict[str, Any]] = {
    "norm_softmax": {"name": "norm_softmax"},
    "proxy_nca": {"name": "proxy_nca"},
    "proxy_nca_pp": {"name": "proxy_nca_pp"},
    "proxy_anchor": {"name": "proxy_anchor"},
    "proxy_isa": {"name": "proxy_isa", "memory_size": 40},
}
# Every loss of the registry, alone and wrapped in Proxy Synthesis (mu 1; once mu 0.5, and
# once mu 0.1: 2 synthetic proxies, so with W = 4 two ranks hold none and must still join
# the collectives of the proxy fetch's backward).
SPECS: dict[str, dict[str, Any]] = {
    **BASE_SPECS,
    **{f"{k}+ps": {**v, "synthesis": PS} for k, v in BASE_SPECS.items()},
    "proxy_anchor+ps_half": {"name": "proxy_anchor", "synthesis": {**PS, "mu": 0.5}},
    "norm_softmax+ps_two": {"name": "norm_softmax", "synthesis": {**PS, "mu": 0.1}},
}


# --------------------------------------------------------------------------------------
def init_process_group(rank: int, world: int, store_file: str, device: str = "cpu") -> None:
    """gloo over loopback, rendezvous through a FileStore (no port to pick)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)


def shutdown_process_group() -> None:
    """Free what still holds the gloo group (DDP reducers in reference cycles), then destroy it.

    A group whose last reference dies at interpreter exit takes gloo's threads down in C++
    static destruction, which can abort the process ("terminate called without an active
    exception", SIGABRT; seen once in a full suite run on 2 busy cores). Collecting first makes
    the group go while Python is fully alive.
    """
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def tiny_chunks() -> None:
    """Column chunks of 3: the chunk loops (and rows whose positive is elsewhere) run often."""
    pf._CHUNK_ELEMS = 1
    pf._MIN_CHUNK_COLS = 3


def build(spec: dict[str, Any], shard: ShardContext | None, dtype: torch.dtype, device: str) -> nn.Module:
    """The loss of ``spec``, proxies from the same seed (a shard gets the same rows)."""
    loss = build_loss(spec, C, D, generator=torch.Generator().manual_seed(7), shard=shard)
    return loss.to(device=device, dtype=dtype)


def isa_module(loss: nn.Module) -> nn.Module | None:
    for m in loss.modules():
        if hasattr(m, "effective_num"):
            return m
    return None


def prime_isa(loss: nn.Module, device: str) -> None:
    """Memory and filter on, a used state (global values, this shard's rows) and a
    half-full memory: outliers, weights and S_learned updates all happen."""
    m = isa_module(loss)
    if m is None:
        return
    m.set_epoch(3, memory_start_epoch=1)
    g = torch.Generator().manual_seed(5)
    count = torch.randint(0, 300, (C,), generator=g)
    count[C - 1] = 0
    sim = torch.rand(C, generator=g, dtype=torch.float64) * 0.5 + 0.1
    sim[C - 2] = 1.0
    mem = nn.functional.normalize(torch.randn(30, D, generator=g, dtype=torch.float64), dim=1)
    mem_labels = torch.randint(0, C, (30,), generator=g)
    s, e = m.shard.class_start, m.shard.class_end
    m.count.copy_(count[s:e])
    m.effective_num.copy_(effective_number(count, m.V)[s:e])
    m.learned_sim.copy_(sim[s:e])
    m.memory.enqueue(mem.to(device), mem_labels.to(device))


def global_batch(step: int, dim: int, dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    """(B, dim) inputs and (B,) labels; class C - 1 never appears (a class without positives)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, dim, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    y = torch.randint(0, C - 1, (B,), generator=g).to(device)
    return x, y


def close(name: str, got: Tensor, want: Tensor, tol: float) -> None:
    try:
        torch.testing.assert_close(got.detach().cpu().to(want.dtype), want.detach().cpu(), atol=tol, rtol=tol)
    except AssertionError as err:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise AssertionError(f"rank {rank}: {name}: {err}") from None


def compare_state(label: str, sharded: nn.Module, ref: nn.Module, tol: float) -> None:
    """Proxies (this shard's rows), owner-held ISA state and the replicated queue."""
    shard: ShardContext = sharded.shard
    s, e = shard.class_start, shard.class_end
    close(f"{label} proxies", sharded.proxies, ref.proxies[s:e], tol)
    m_sh, m_ref = isa_module(sharded), isa_module(ref)
    if m_sh is None:
        return
    for name in ("count", "effective_num", "learned_sim"):
        close(f"{label} {name}", getattr(m_sh, name), getattr(m_ref, name)[s:e], tol)
    for name in ("embeddings", "labels", "ptr", "num_valid"):
        close(f"{label} memory.{name}", getattr(m_sh.memory, name), getattr(m_ref.memory, name), tol)


# --------------------------------------------------------------------------------------
# One step: loss, embedding and proxy gradients, ISA state
# --------------------------------------------------------------------------------------
def check_step(spec_name: str, dtype: torch.dtype, tol: float, device: str) -> None:
    spec = SPECS[spec_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = ShardContext.from_process_group(C)
    ref, sharded = build(spec, None, dtype, device), build(spec, shard, dtype, device)
    # A shard starts with the same rows as the unsharded init (exactly).
    s, e = shard.class_start, shard.class_end
    assert torch.equal(sharded.proxies.detach(), ref.proxies.detach()[s:e]), f"{spec_name}: init differs"
    prime_isa(ref, device)
    prime_isa(sharded, device)

    x, y = global_batch(0, D, dtype, device)
    x_ref = x.clone().requires_grad_()
    loss_ref = ref(x_ref, y)
    loss_ref.backward()

    b = B // world
    rows = slice(rank * b, (rank + 1) * b)
    x_local = x[rows].clone().requires_grad_()
    gathered = shard.gather_embeddings(x_local, ddp_average=False)
    loss = sharded(gathered, shard.all_gather(y[rows]))
    loss.backward()

    close(f"{spec_name} loss", loss, loss_ref, tol)
    close(f"{spec_name} d/dx", x_local.grad, x_ref.grad[rows], tol)
    close(f"{spec_name} d/dproxies", sharded.proxies.grad, ref.proxies.grad[s:e], tol)
    compare_state(spec_name, sharded, ref, tol)


# --------------------------------------------------------------------------------------
# Training: a linear embedder (DDP when sharded) + the loss, Adam, N steps
# --------------------------------------------------------------------------------------
class Trainer:
    """The train loop of pipelines/train.py in miniature (same gather / DDP / optimiser
    groups), on a linear embedder so that W ranks and one process see the same numbers."""

    def __init__(
        self, spec: dict[str, Any], shard: ShardContext | None, dtype: torch.dtype, device: str,
        autocast_bf16: bool = False,
    ) -> None:
        self.shard = shard or ShardContext(C)
        self.dtype, self.device, self.autocast_bf16 = dtype, device, autocast_bf16
        g = torch.Generator().manual_seed(3)
        self.model = nn.Linear(DIN, D).to(dtype)
        with torch.no_grad():
            self.model.weight.copy_(torch.randn(D, DIN, generator=g, dtype=torch.float64) / DIN**0.5)
            self.model.bias.copy_(torch.randn(D, generator=g, dtype=torch.float64) * 0.1)
        self.model.to(device)
        self.loss = build(spec, shard, dtype, device)
        isa = isa_module(self.loss)
        if isa is not None:
            isa.set_epoch(3, memory_start_epoch=1)  # memory and filter from the first step
        self.optimizer = torch.optim.Adam([
            {"params": list(self.model.parameters()), "name": "head"},
            {"params": list(self.loss.parameters()), "name": "proxies", "lr": 0.05},
        ], lr=0.01)
        self.ddp: nn.Module = self.model
        self.step_index = 0

    def wrap(self) -> None:
        if self.shard.sharded:
            self.ddp = nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)

    def step(self) -> float:
        x, y = global_batch(10 + self.step_index, DIN, self.dtype, self.device)
        self.step_index += 1
        rank, world = self.shard.rank, self.shard.world_size
        rows = slice(rank * (B // world), (rank + 1) * (B // world))
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            local = self.ddp(x[rows])
        embeddings = self.shard.gather_embeddings(local.to(self.dtype))
        loss = self.loss(embeddings, self.shard.all_gather(y[rows]))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def run(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]


def compare_trainers(label: str, sharded: Trainer, ref: Trainer, tol: float) -> None:
    for (name, p), (_, q) in zip(sharded.model.named_parameters(), ref.model.named_parameters(), strict=True):
        close(f"{label} model.{name}", p, q, tol)
    compare_state(label, sharded.loss, ref.loss, tol)


def check_training(
    spec_name: str, dtype: torch.dtype, tol: float, device: str, autocast_bf16: bool = False, steps: int = STEPS
) -> None:
    spec = SPECS[spec_name]
    ref = Trainer(spec, None, dtype, device, autocast_bf16)
    ref_losses = ref.run(steps)
    sharded = Trainer(spec, ShardContext.from_process_group(C), dtype, device, autocast_bf16)
    sharded.wrap()
    losses = sharded.run(steps)
    close(f"{spec_name} losses over {steps} steps", torch.tensor(losses), torch.tensor(ref_losses), tol)
    compare_trainers(f"{spec_name} after {steps} steps", sharded, ref, tol)


def check_bf16_step(spec_name: str, device: str) -> None:
    """bf16-autocast embeddings (as the train loop makes them on a GPU), upcast, loss in
    float32: the sharded loss and the gradient that reaches the embeddings equal those of one
    worker. The same bf16 values feed both (a GEMM's rounding may depend on the batch size)."""
    ref = Trainer(SPECS[spec_name], None, torch.float32, device, autocast_bf16=True)
    x, y = global_batch(10, DIN, torch.float32, device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        emb16 = ref.model(x)
    assert emb16.dtype == torch.bfloat16
    shard = ShardContext.from_process_group(C)
    sharded = Trainer(SPECS[spec_name], shard, torch.float32, device, autocast_bf16=True)
    world, rank = shard.world_size, shard.rank
    rows = slice(rank * (B // world), (rank + 1) * (B // world))

    # The train loop's ``local.float()``: float32 leaves holding the bf16 values.
    ref_emb = emb16.float().requires_grad_()
    ref_loss = ref.loss(ref_emb, y)
    ref_loss.backward()
    local = emb16[rows].float().requires_grad_()
    loss = sharded.loss(shard.gather_embeddings(local, ddp_average=False), shard.all_gather(y[rows]))
    assert loss.dtype == torch.float32
    loss.backward()
    close(f"{spec_name} bf16-embedding loss", loss, ref_loss, 1e-5)
    close(f"{spec_name} bf16-embedding d/d embeddings", local.grad, ref_emb.grad[rows], 1e-5)


def equivalence_worker(rank: int, world: int, store_file: str, device: str = "cpu") -> None:
    """Every loss (alone and with Proxy Synthesis) at W = ``world`` against W = 1."""
    init_process_group(rank, world, store_file, device)
    tiny_chunks()
    try:
        for name in SPECS:
            check_step(name, torch.float64, 1e-9, device)
            check_training(name, torch.float64, 1e-9, device)
        # float32: 1e-5. A bf16-autocast embedder (the loss itself runs in float32): the loss
        # and its gradient w.r.t. the embeddings, 1e-5. (Parameters after optimiser steps are
        # not comparable under bf16: the embedder's own backward runs in bf16, and one bf16
        # rounding flip of a near-zero gradient flips the sign of Adam's first update.)
        for name in ("norm_softmax+ps", "proxy_isa+ps"):
            check_step(name, torch.float32, 1e-5, device)
            check_training(name, torch.float32, 1e-5, device)
            check_bf16_step(name, device)
        # The fallback collectives (list all-gather, all-reduce + slice: older gloo, CUDA on gloo).
        sharding._GLOO_HAS_SINGLE = not sharding._GLOO_HAS_SINGLE
        try:
            check_training("proxy_anchor+ps", torch.float64, 1e-9, device)
        finally:
            sharding._GLOO_HAS_SINGLE = not sharding._GLOO_HAS_SINGLE
        dist.barrier()
    finally:
        shutdown_process_group()


# --------------------------------------------------------------------------------------
# Resharded resume through pipelines/train.py's checkpoint functions
# --------------------------------------------------------------------------------------
RESUME_SPECS = ("proxy_isa+ps", "norm_softmax")
SAVE_AFTER = 2


def _save(trainer: Trainer, folder: Path) -> None:
    from pipelines.checkpoint import save_checkpoint
    from pipelines.config import load_config

    folder.mkdir(parents=True, exist_ok=True)
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    save_checkpoint(folder, load_config("digits"), trainer.model, trainer.loss, trainer.optimizer, sched,
                    torch.Generator().manual_seed(0), {"epoch": 1, "step": trainer.step_index})


def _load(trainer: Trainer, folder: Path) -> None:
    from pipelines.checkpoint import load_checkpoint

    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    state = load_checkpoint(folder, trainer.model, trainer.loss, trainer.optimizer, sched, torch.Generator())
    trainer.step_index = int(state["step"])


def reference_losses(spec_name: str) -> tuple[list[float], Trainer]:
    ref = Trainer(SPECS[spec_name], None, torch.float64, "cpu")
    return ref.run(STEPS), ref


def save_worker(rank: int, world: int, store_file: str, root: str) -> None:
    """Train ``SAVE_AFTER`` steps on W ranks, every rank writes its part of a checkpoint."""
    init_process_group(rank, world, store_file)
    try:
        for name in RESUME_SPECS:
            trainer = Trainer(SPECS[name], ShardContext.from_process_group(C), torch.float64, "cpu")
            trainer.wrap()
            trainer.run(SAVE_AFTER)
            _save(trainer, Path(root) / name)
        dist.barrier()
    finally:
        shutdown_process_group()


def resume(root: str, make_shard: Callable[[], ShardContext | None]) -> dict[str, list[float]]:
    """Load each checkpoint under ``root`` into this rank's shard and finish the run;
    compares with an uninterrupted W = 1 run. Returns the losses after the resume."""
    out = {}
    for name in RESUME_SPECS:
        ref_losses, ref = reference_losses(name)
        trainer = Trainer(SPECS[name], make_shard(), torch.float64, "cpu")
        _load(trainer, Path(root) / name)
        assert trainer.step_index == SAVE_AFTER
        trainer.wrap()
        losses = trainer.run(STEPS - SAVE_AFTER)
        close(f"{name} losses after resume", torch.tensor(losses), torch.tensor(ref_losses[SAVE_AFTER:]), 1e-9)
        compare_trainers(f"{name} resumed", trainer, ref, 1e-9)
        out[name] = losses
    return out


def resume_worker(rank: int, world: int, store_file: str, root: str) -> None:
    init_process_group(rank, world, store_file)
    try:
        losses = resume(root, lambda: ShardContext.from_process_group(C))
        if rank == 0:
            (Path(root) / f"resumed_w{world}.json").write_text(json.dumps(losses))
        dist.barrier()
    finally:
        shutdown_process_group()
