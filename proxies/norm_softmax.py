"""Norm-Softmax (Zhai & Wu 2019): cross-entropy over cosine logits scaled by 1/T."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import ProxyLoss, check_positive, default_generator
from .functional import SyntheticProxies, norm_softmax_loss

__all__ = ["NormSoftmaxLoss"]


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
    ) -> None:
        self.temperature = check_positive("temperature", temperature)
        super().__init__(num_classes, embedding_dim, generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The Proxy Synthesis authors' init (nn.Linear's): Kaiming uniform, a = sqrt(5)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.proxies, a=math.sqrt(5), generator=default_generator(generator))

    def loss_from(
        self, embeddings: Tensor, proxies: Tensor, labels: Tensor, synthetic: SyntheticProxies | None = None
    ) -> Tensor:
        return norm_softmax_loss(embeddings, proxies, labels, self.temperature, synthetic)

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return norm_softmax_loss(embeddings, proxies, labels, self.temperature)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={self.temperature:g}"
