"""The one module of ``pipelines/`` that touches ``torch.distributed``.

Ray Train (or torchrun) creates the process group; this module only reads it. With no
process group everything degrades to a single process, so tests and notebooks run the same
code without Ray.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def print0(*args: object) -> None:
    """Print from rank 0 only (Ray prefixes worker output with the worker's name)."""
    if rank() == 0:
        print(*args, flush=True)


def device() -> torch.device:
    """CUDA when the worker was given a GPU, else CPU (no ``.cuda()`` anywhere else)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def wrap_ddp(model: nn.Module, dev: torch.device) -> nn.Module:
    """DDP on the backbone+head; proxies are not DDP parameters (each rank owns its shard).

    ``broadcast_buffers=False``: BN statistics stay per rank (as with frozen BN) and the
    forward does not hide a collective that the evaluation path would have to match.
    """
    if world_size() == 1:
        return model
    ids = [dev.index] if dev.type == "cuda" else None
    with warnings.catch_warnings():
        # torch 2.14 deprecates broadcast_buffers; its replacement still syncs buffers at init,
        # which is harmless here but not yet equivalent, so keep the documented flag.
        warnings.simplefilter("ignore", FutureWarning)
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (rows may differ per rank). No gradient."""
    if world_size() == 1:
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.zeros_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_agree(flag: bool) -> bool:
    """True only if every rank says True (e.g. 'my data loaded fine')."""
    if not is_distributed():
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
