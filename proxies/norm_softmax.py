"""Norm-Softmax (Zhai & Wu 2019): cross-entropy over cosine logits scaled by 1/T."""

from __future__ import annotations

import torch

from .sharding import ShardContext
from .softmax import SoftmaxProxyLoss

__all__ = ["NormSoftmaxLoss"]


class NormSoftmaxLoss(SoftmaxProxyLoss):
    """``L = CE(S / T, y)``, S the cosine matrix. Default T = 1/23 (scale 23).

    Equals PML ``NormalizedSoftmaxLoss(temperature=T)`` with ``W = proxiesᵀ``.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 23.0,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_dim, temperature, generator, shard)
