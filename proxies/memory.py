"""A ring buffer of detached embeddings and their labels (the Proxy-ISA memory)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import check_int

__all__ = ["MemoryQueue"]


class MemoryQueue(nn.Module):
    """Ring buffer of ``size`` rows of dimension ``dim``; everything lives in buffers.

    Buffers (all saved and restored by ``state_dict``): ``embeddings`` (size, dim),
    ``labels`` (size,) long (-1 where empty), ``ptr`` (next row to write, scalar long) and
    ``num_valid`` (rows written so far, capped at ``size``). Rows are written in order from
    row 0, so the valid rows are always ``[:num_valid]``.
    """

    embeddings: Tensor
    labels: Tensor
    ptr: Tensor
    num_valid: Tensor

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.size = check_int("size", size, 1)
        self.dim = check_int("dim", dim, 1)
        self.register_buffer("embeddings", torch.zeros(size, dim))
        self.register_buffer("labels", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_valid", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        return int(self.num_valid)

    @torch.no_grad()
    def enqueue(self, embeddings: Tensor, labels: Tensor) -> None:
        """Append rows (n, dim) with labels (n,), overwriting the oldest when full.

        Same result as appending the rows one by one: with n > size only the last ``size``
        rows survive, at the positions they would have had.
        """
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must be (n, {self.dim}), got {tuple(embeddings.shape)}")
        if labels.shape != (embeddings.shape[0],):
            raise ValueError(f"labels must be ({embeddings.shape[0]},), got {tuple(labels.shape)}")
        n_total = embeddings.shape[0]
        if n_total == 0:
            return
        n = min(n_total, self.size)
        start = int(self.ptr) + n_total - n
        idx = torch.arange(start, start + n, device=self.labels.device) % self.size
        self.embeddings[idx] = embeddings[n_total - n :].detach().to(self.embeddings)
        self.labels[idx] = labels[n_total - n :].to(self.labels)
        self.ptr.fill_((int(self.ptr) + n_total) % self.size)
        self.num_valid.fill_(min(self.size, int(self.num_valid) + n_total))

    def get(self) -> tuple[Tensor, Tensor]:
        """The valid rows: embeddings (n, dim) and labels (n,), in storage order (views)."""
        n = int(self.num_valid)
        return self.embeddings[:n], self.labels[:n]

    def reset(self) -> None:
        """Empty the queue."""
        self.embeddings.zero_()
        self.labels.fill_(-1)
        self.ptr.zero_()
        self.num_valid.zero_()

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}"
