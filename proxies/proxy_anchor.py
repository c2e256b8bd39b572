"""Proxy-Anchor (Kim et al. 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import ProxyLoss, check_real
from .functional import SyntheticProxies, anchor_terms
from .sharding import ShardContext

__all__ = ["ProxyAnchorLoss"]


class ProxyAnchorLoss(ProxyLoss):
    """``1/|C+| sum_{c in C+} log(1 + sum_{i in X_c+} e^{-alpha (S_ic - delta)})
    + 1/C sum_c log(1 + sum_{i in X_c-} e^{alpha (S_ic + delta)})``.

    Defaults alpha = 32, delta = 0.1. Equals PML ``ProxyAnchorLoss(margin, alpha)``.
    Rules: ``alpha > 0`` (the scale), ``delta >= 0`` (the margin; Kim et al. define it as a
    margin, 0 is the no-margin limit, a negative one would reward positives below the
    negatives' threshold).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        alpha: float = 32.0,
        delta: float = 0.1,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        self.alpha = check_real("alpha", alpha)
        self.delta = check_real("delta", delta, strict=False)
        super().__init__(num_classes, embedding_dim, generator, shard)

    def loss_from(
        self,
        embeddings: Tensor,
        proxies: Tensor,
        labels: Tensor,
        synthetic: SyntheticProxies | Tensor | None = None,
    ) -> Tensor:
        terms = anchor_terms(embeddings, proxies, labels, self.alpha, self.delta, None, synthetic)
        return self.shard.anchor_loss(terms, isa=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:g}, delta={self.delta:g}"
