"""The one file of ``proxies/`` that touches ``torch.distributed``.

Collectives used by the losses. With no process group (or world size 1) every function is
the identity, so single-process code is the same code path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherReplicated(torch.autograd.Function):
    """All-gather rows whose consumer (the loss) is computed identically on every rank.

    Backward: every rank holds the full gradient of the same loss, so each keeps only the
    slice of its own samples, multiplied by W so that DDP's gradient *averaging* over W ranks
    yields the exact gradient of the loss of the global batch.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rank, world = _world()
        ctx.rank, ctx.world, ctx.n = rank, world, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        start = ctx.rank * ctx.n
        return grad[start : start + ctx.n] * ctx.world


def gather_replicated(x: torch.Tensor) -> torch.Tensor:
    """(B_local, ...) -> (B_local * W, ...) in rank order, differentiable. Same-size batches."""
    _, world = _world()
    if world == 1:
        return x
    if not x.requires_grad:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)
    return _GatherReplicated.apply(x)
