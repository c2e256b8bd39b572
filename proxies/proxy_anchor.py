"""Proxy-Anchor (Kim et al. 2020)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import ProxyLoss, check_positive
from .functional import SyntheticProxies, anchor_terms, proxy_anchor_loss
from .sharding import ShardContext

__all__ = ["ProxyAnchorLoss"]


def check_delta(delta: float) -> float:
    """The margin: a finite float (negative margins are allowed, if unusual)."""
    try:
        d = float(delta)
    except (TypeError, ValueError) as err:
        raise ValueError(f"delta must be a number, got {delta!r}") from err
    if not math.isfinite(d):
        raise ValueError(f"delta must be finite, got {delta!r}")
    return d


class ProxyAnchorLoss(ProxyLoss):
    """``1/|C+| sum_{c in C+} log(1 + sum_{i in X_c+} e^{-alpha (S_ic - delta)})
    + 1/C sum_c log(1 + sum_{i in X_c-} e^{alpha (S_ic + delta)})``.

    Defaults alpha = 32, delta = 0.1. Equals PML ``ProxyAnchorLoss(margin, alpha)``.
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
        self.alpha = check_positive("alpha", alpha)
        self.delta = check_delta(delta)
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

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return proxy_anchor_loss(embeddings, proxies, labels, self.alpha, self.delta)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:g}, delta={self.delta:g}"
