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


def randn_over_8_(t: Tensor, generator: torch.Generator) -> Tensor:
    """The ProxyNCA++ authors' proxy init on a (rows, d) matrix, in place: ``randn / 8``.

    Exactly ``torch.randn(rows, d, generator=generator) / 8`` (division by 8 is exact), so
    a shard drawn block by block by :func:`~proxies.base.fill_rows_` gets the same bits.
    """
    return t.normal_(0.0, 1.0, generator=generator).div_(8.0)


class ProxyNCAPlusPlusLoss(ProxyNCALoss):
    """ProxyNCA++: :class:`ProxyNCALoss` with ``assignment_probability=True`` (registry name).

    Proxies start as in the authors' code (euwern/proxynca_pp ``loss.py``):
    ``randn(C, d) / 8``, from the given generator (never the global RNG); see
    :meth:`reset_parameters` for why the scale matters.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 9.0,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_dim, temperature, True, generator, shard)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The authors' init: ``randn(C, d) / 8`` (every entry N(0, 1/64)), C = all classes.

        Why this scale: the loss only sees p̂, but the optimiser moves the raw p, so the
        init norm, about sqrt(d) / 8 (5.7 at d = 2048, 1.4 at d = 128), sets how fast a
        proxy turns. The gradient w.r.t. p is the one w.r.t. p̂ divided by |p|; with the
        authors' Adam eps = 1 (far above sqrt(v) for these gradients, so the step is about
        lr * grad, not lr * sign) and the x100 proxy learning rate, the angle turned per step
        is then about lr |grad_p̂| / |p|^2. Kaiming-uniform (norm about 0.58 at any d) would
        turn the proxies (3 d / 64)-fold faster (96x at d = 2048) than the tuned recipe.

        Sharded, this shard's rows of that (C, d) draw (:meth:`ProxyLoss.init_proxies_`).
        """
        self.init_proxies_(randn_over_8_, generator)


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
