"""Norm-Softmax (Zhai & Wu 2019): cross-entropy over cosine logits scaled by 1/T."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import ProxyLoss, check_positive
from .functional import SyntheticProxies, norm_softmax_loss, softmax_terms
from .sharding import ShardContext

__all__ = ["NormSoftmaxLoss", "kaiming_uniform_linear_"]


def kaiming_uniform_linear_(t: Tensor, generator: torch.Generator) -> Tensor:
    """nn.Linear's weight init, Kaiming uniform with a = sqrt(5) on a (rows, d) matrix:
    U(-1/sqrt(d), 1/sqrt(d)). The bound depends on d only, so a shard draws it the same."""
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)


class NormSoftmaxLoss(ProxyLoss):
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
        self.temperature = check_positive("temperature", temperature)
        super().__init__(num_classes, embedding_dim, generator, shard)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The Proxy Synthesis authors' init (nn.Linear's): Kaiming uniform, a = sqrt(5)."""
        self.init_proxies_(kaiming_uniform_linear_, generator)

    def loss_from(
        self,
        embeddings: Tensor,
        proxies: Tensor,
        labels: Tensor,
        synthetic: SyntheticProxies | Tensor | None = None,
    ) -> Tensor:
        terms = softmax_terms(embeddings, proxies, labels, 1.0 / self.temperature, False, synthetic)
        return self.shard.softmax_loss(terms, labels >= 0)

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return norm_softmax_loss(embeddings, proxies, labels, self.temperature)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={self.temperature:g}"
