"""ProxyNCA (Movshovitz-Attias 2017) and ProxyNCA++ (Teh 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import ProxyLoss, check_positive
from .functional import SyntheticProxies, proxy_nca_loss, softmax_terms
from .norm_softmax import kaiming_uniform_linear_
from .sharding import ShardContext

__all__ = ["ClassicProxyNCALoss", "ProxyNCALoss", "ProxyNCAPlusPlusLoss"]


class ProxyNCALoss(ProxyLoss):
    """``D_ic = |x̂_i - p̂_c|^2 / T``; ``l_i = -log(exp(-D_iy) / sum_c exp(-D_ic))``.

    ``assignment_probability=True`` is ProxyNCA++ (the positive is in the denominator,
    equals ``CE(2 S / T, y)`` and PML ``ProxyNCALoss(softmax_scale=1/T)``); ``False`` is
    classic ProxyNCA (positive excluded from the denominator). Default T = 1/9.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 9.0,
        assignment_probability: bool = True,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        self.temperature = check_positive("temperature", temperature)
        if not isinstance(assignment_probability, bool):
            raise ValueError(f"assignment_probability must be a bool, got {assignment_probability!r}")
        if not assignment_probability and num_classes < 2:
            # The denominator would be an empty sum.
            raise ValueError("classic ProxyNCA (assignment_probability=False) needs num_classes >= 2")
        self.assignment_probability = assignment_probability
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
        # D = (2 - 2 S) / T: the constant cancels, a softmax over 2 S / T (see proxy_nca_loss).
        scale = 2.0 / self.temperature
        terms = softmax_terms(embeddings, proxies, labels, scale, not self.assignment_probability, synthetic)
        return self.shard.softmax_loss(terms, labels >= 0)

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return proxy_nca_loss(embeddings, proxies, labels, self.temperature, self.assignment_probability)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, temperature={self.temperature:g}, "
            f"assignment_probability={self.assignment_probability}"
        )


class ProxyNCAPlusPlusLoss(ProxyNCALoss):
    """ProxyNCA++: :class:`ProxyNCALoss` with ``assignment_probability=True`` (registry name)."""

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 9.0,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_dim, temperature, True, generator, shard)


class ClassicProxyNCALoss(ProxyNCALoss):
    """Classic ProxyNCA: :class:`ProxyNCALoss` with ``assignment_probability=False``."""

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 9.0,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_dim, temperature, False, generator, shard)
