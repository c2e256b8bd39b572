"""The softmax proxy losses' shared base: Norm-Softmax, ProxyNCA and ProxyNCA++ differ only in
the logit scale, whether the positive is in the denominator, the default temperature and the
proxy init."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from .base import ProxyLoss, check_real
from .functional import SyntheticProxies, softmax_terms
from .sharding import ShardContext

__all__ = ["SoftmaxProxyLoss", "kaiming_uniform_linear_"]


def kaiming_uniform_linear_(t: Tensor, generator: torch.Generator) -> Tensor:
    """nn.Linear's weight init, Kaiming uniform with a = sqrt(5) on a (rows, d) matrix:
    U(-1/sqrt(d), 1/sqrt(d)). The bound depends on d only, so a shard draws it the same."""
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)


class SoftmaxProxyLoss(ProxyLoss):
    """``l_i = -log(e^{s S_iy} / sum_{c in D_i} e^{s S_ic})``, mean over the batch, with
    ``s = logit_scale / T`` (T = ``temperature`` > 0, a divisor) and ``D_i`` every class, or
    every class but ``y_i`` when ``exclude_positive`` (then C >= 2: the sum must not be empty).

    Subclasses set the class attributes: ``logit_scale`` (1: Norm-Softmax, logits S / T;
    2: ProxyNCA, where ``D = |x̂ - p̂|^2 / T = (2 - 2 S) / T`` and the constant cancels) and
    ``exclude_positive`` (classic ProxyNCA), and give ``temperature`` its default in their
    constructor signature. Proxies start as nn.Linear's weight (the Proxy Synthesis authors'
    init) unless a subclass overrides :meth:`reset_parameters`.
    """

    logit_scale: ClassVar[float] = 1.0
    exclude_positive: bool = False

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        self.temperature = check_real("temperature", temperature)
        if self.exclude_positive and isinstance(num_classes, int) and num_classes < 2:
            # The denominator would be an empty sum.
            raise ValueError(f"{type(self).__name__} (positive excluded) needs num_classes >= 2")
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
        scale = self.logit_scale / self.temperature
        terms = softmax_terms(embeddings, proxies, labels, scale, self.exclude_positive, synthetic)
        return self.shard.softmax_loss(terms, labels >= 0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={self.temperature:g}"
