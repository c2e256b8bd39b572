"""ProxyNCA (Movshovitz-Attias 2017) and ProxyNCA++ (Teh 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import HyperParameterError
from .sharding import ShardContext
from .softmax import SoftmaxProxyLoss

__all__ = ["ClassicProxyNCALoss", "ProxyNCALoss", "ProxyNCAPlusPlusLoss"]


class ProxyNCALoss(SoftmaxProxyLoss):
    """``D_ic = |x̂_i - p̂_c|^2 / T``; ``l_i = -log(exp(-D_iy) / sum_c exp(-D_ic))``.

    ``assignment_probability=True`` is ProxyNCA++ (the positive is in the denominator,
    equals ``CE(2 S / T, y)`` and PML ``ProxyNCALoss(softmax_scale=1/T)``); ``False`` is
    classic ProxyNCA (positive excluded from the denominator). Default T = 1/9.
    """

    # D = (2 - 2 S) / T: the constant cancels, a softmax over 2 S / T (see proxy_nca_loss).
    logit_scale = 2.0

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 1.0 / 9.0,
        assignment_probability: bool = True,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        if not isinstance(assignment_probability, bool):
            raise HyperParameterError("assignment_probability", f"must be a bool, got {assignment_probability!r}")
        self.exclude_positive = not assignment_probability
        super().__init__(num_classes, embedding_dim, temperature, generator, shard)

    @property
    def assignment_probability(self) -> bool:
        """True for ProxyNCA++ (the positive is in the denominator), False for classic ProxyNCA."""
        return not self.exclude_positive

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, assignment_probability={self.assignment_probability}"


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
