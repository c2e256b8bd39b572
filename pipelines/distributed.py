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


def average_buffers(model: nn.Module) -> None:
    """Average every floating-point buffer (BatchNorm running statistics) over the ranks, in place.

    With ``model.sync_bn=false`` each rank's BatchNorm sees only its local batch; averaging
    after each epoch gives every rank one model state to evaluate and checkpoint (timm's
    ``distribute_bn`` does the same). The integer ``num_batches_tracked`` is equal everywhere.
    """
    if world_size() == 1:
        return
    for buf in model.buffers():
        if buf.is_floating_point():
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            buf.div_(world_size())


class _GlobalBatchNormStats(torch.autograd.Function):
    """Mean and biased variance per channel over the rows of every rank, with gradient.

    Two all-reduces (the sum, then the squared deviations from the global mean) rather than
    sum and sum of squares: no cancellation, so the statistics equal one process's
    ``var_mean`` to float rounding. The backward sums every rank's partial gradients of the
    two statistics (each rank's loss depends on them) and maps them back to its rows.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        # x: (M, C) rows of this rank -> (C,) mean, (C,) biased variance, () global row count
        count = torch.tensor([float(x.shape[0])], dtype=x.dtype, device=x.device)
        total = torch.cat([x.sum(0), count])
        dist.all_reduce(total)
        n = total[-1]
        mean = total[:-1] / n
        centred = x - mean
        sq = (centred * centred).sum(0)
        dist.all_reduce(sq)
        var = sq / n
        ctx.save_for_backward(centred, n)
        ctx.mark_non_differentiable(n)
        return mean, var, n

    @staticmethod
    def backward(ctx, g_mean: torch.Tensor, g_var: torch.Tensor, _: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        centred, n = ctx.saved_tensors
        grads = torch.cat([g_mean, g_var])
        dist.all_reduce(grads)
        g_mean, g_var = grads.chunk(2)
        # d mean / d x_i = 1/n; d var / d x_i = 2 (x_i - mean) / n (the mean's own term sums to 0).
        return (g_mean + 2.0 * g_var * centred) / n


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics cover the global batch of every rank (gloo or nccl).

    torch's ``nn.SyncBatchNorm`` refuses CPU tensors, so CPU workers (gloo) use this one; on
    GPUs :func:`sync_batch_norm` picks torch's fused version. Same parameters and buffers as
    the BatchNorm it replaces, so checkpoints load into the plain model. In eval mode, or with
    one rank, it is plain BatchNorm.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and world_size() > 1):
            return super().forward(x)
        self._check_input_dim(x)
        c = x.shape[1]
        rows = x.transpose(0, 1).reshape(c, -1).t()  # (N*H*W, C), whatever the memory format
        mean, var, count = _GlobalBatchNormStats.apply(rows)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                n = float(count)
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / max(n - 1, 1)), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def trainable_batch_norms(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers that learn in training mode: frozen ones (``model.frozen_bn``,
    frozen stages) have parameters without gradient and stay in eval mode."""
    return [
        name for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and all(p.requires_grad for p in m.parameters())
    ]


def sync_batch_norm(model: nn.Module, dev: torch.device) -> nn.Module:
    """Replace every trainable BatchNorm of ``model`` by a synchronised one, in place.

    Frozen BatchNorm layers (``model.frozen_bn``, frozen stages: no gradient, eval mode) keep
    their class: their statistics never change. torch's ``nn.SyncBatchNorm`` on CUDA (fused
    kernels), :class:`SyncBatchNorm` elsewhere.
    """
    names = set(trainable_batch_norms(model))
    cls = nn.SyncBatchNorm if dev.type == "cuda" else SyncBatchNorm

    def swap(parent: nn.Module, prefix: str) -> None:
        for child_name, child in parent.named_children():
            full = f"{prefix}{child_name}"
            if full in names and not isinstance(child, cls):
                new = cls(child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
                new.load_state_dict(child.state_dict())
                new.train(child.training)
                setattr(parent, child_name, new)
            else:
                swap(child, f"{full}.")

    swap(model, "")
    return model
