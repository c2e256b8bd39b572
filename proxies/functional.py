"""The math of the proxy losses as pure functions of tensors (see ``docs/losses.md``).

Notation (shapes): ``B`` embeddings ``x`` (B, d) of any norm, integer labels ``y`` (B,) in
``[0, C)``, proxies ``p`` (C, d). Every function normalises both sides itself and works on the
cosine matrix ``S = x̂ p̂ᵀ`` (B, C), computed by the fused engine of ``proxies/fused.py`` (why
it is fused, chunked and always float32 is written there). Losses return per-class or
per-sample terms first (:func:`softmax_terms`, :func:`anchor_terms`), combined into the
scalar afterwards, so class-sharded proxies only combine vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .fused import (
    AnchorKernel,
    ISAClassParams,
    SoftmaxKernel,
    SyntheticProxies,
    check_shapes,
    cosine_similarity,
    loss_dtype,
    normalize_rows,
    run_fused,
)

__all__ = [
    "AnchorTerms",
    "ISAClassParams",
    "SoftmaxTerms",
    "SyntheticProxies",
    "anchor_terms",
    "combine_anchor_terms",
    "cosine_similarity",
    "isa_class_params",
    "loss_dtype",
    "norm_softmax_loss",
    "normalize_rows",
    "proxy_anchor_loss",
    "proxy_isa_loss",
    "proxy_nca_loss",
    "softmax_loss_from_terms",
    "softmax_terms",
]


# --------------------------------------------------------------------------------------
# Terms (per class / per sample) and losses
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoftmaxTerms:
    """Per-sample terms of a softmax loss: loss_i = lse_i - pos_i.

    ``lse`` (B,): log-sum-exp of the logits over this shard's classes; shards combine with
    ``torch.logsumexp(torch.stack(lses), 0)``. ``pos`` (B,): the positive logit (from the
    shard that owns the label).
    """

    lse: Tensor
    pos: Tensor


@dataclass(frozen=True)
class AnchorTerms:
    """Per-class terms of Proxy-Anchor / Proxy-ISA, all (C,).

    ``q_pos``, ``q_neg``: log(1 + sum exp) of the positives / negatives of each class.
    ``w_pos``, ``w_neg``: mean weight over those samples (1 for Proxy-Anchor; 0 where none).
    ``n_pos``, ``n_neg``: how many positives / negatives each class has in the batch.
    Shards combine by summing the vectors' sums (see :func:`combine_anchor_terms`).
    """

    q_pos: Tensor
    q_neg: Tensor
    w_pos: Tensor
    w_neg: Tensor
    n_pos: Tensor
    n_neg: Tensor


def softmax_terms(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    scale: float,
    exclude_positive: bool = False,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> SoftmaxTerms:
    """Per-sample log-sum-exp of ``scale * S`` and the positive logit.

    embeddings (B, d), proxies (C, d), labels (B,) in [0, C + n_synthetic) or -1. With
    ``exclude_positive`` the positive column is left out of the log-sum-exp.

    ``synthetic``: extra columns after the C proxies, either described by indices
    (:class:`SyntheticProxies`) or given as a raw (n, d) tensor (differentiable).
    Label -1 means "the positive is not among these columns" (a class-sharded shard that
    does not own the label): the row contributes to ``lse`` only and its ``pos`` is 0.
    """
    check_shapes(embeddings, proxies, labels, synthetic)
    lse, pos = run_fused(SoftmaxKernel(scale, exclude_positive), embeddings, proxies, labels, synthetic)
    return SoftmaxTerms(lse, pos)


def anchor_terms(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    alpha: float,
    delta: float,
    isa: ISAClassParams | None = None,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> AnchorTerms:
    """Per-class Proxy-Anchor terms, or Proxy-ISA terms when ``isa`` (C',) is given.

    embeddings (B, d), proxies (C, d), labels (B,) in [0, C'), C' = C + n_synthetic, or -1
    (positive on another shard: the row is a negative of every column here). ``synthetic``
    as in :func:`softmax_terms`.
    """
    c = check_shapes(embeddings, proxies, labels, synthetic)
    if isa is not None:
        if isa.sigma.shape != (c,):
            raise ValueError(f"ISA class parameters must have shape ({c},), got {tuple(isa.sigma.shape)}")
        isa = isa.to(loss_dtype(embeddings, proxies))
    outs = run_fused(AnchorKernel(alpha, delta, isa), embeddings, proxies, labels, synthetic)
    return AnchorTerms(*outs)


def softmax_loss_from_terms(terms: SoftmaxTerms) -> Tensor:
    """Mean over the batch of ``lse_i - pos_i`` -> scalar."""
    return (terms.lse - terms.pos).mean()


def combine_anchor_terms(terms: AnchorTerms, isa: bool) -> Tensor:
    """The scalar loss from per-class terms.

    Proxy-Anchor: ``sum Q+ / |C+| + sum Q- / C``. Proxy-ISA:
    ``sum Q+ / sum_{C+} mean w+ + sum Q- / sum_{C-} mean w-``. Only sums over classes
    appear, so sharded terms combine with scalar all-reduces.
    """
    if isa:
        den_pos = terms.w_pos.sum()
        den_neg = terms.w_neg.sum()
    else:
        den_pos = (terms.n_pos > 0).sum().to(terms.q_pos.dtype)
        den_neg = terms.q_neg.new_tensor(float(terms.q_neg.shape[0]))
    return terms.q_pos.sum() / den_pos + terms.q_neg.sum() / den_neg.clamp_min(1e-30)


def norm_softmax_loss(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    temperature: float,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> Tensor:
    """Norm-Softmax: ``CE(S / T, y)`` averaged over the batch -> scalar.

    embeddings (B, d), proxies (C, d), labels (B,).
    """
    return softmax_loss_from_terms(
        softmax_terms(embeddings, proxies, labels, 1.0 / temperature, False, synthetic)
    )


def proxy_nca_loss(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    temperature: float,
    assignment_probability: bool = True,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> Tensor:
    """ProxyNCA++ (``assignment_probability``) or classic ProxyNCA -> scalar.

    ``D_ic = |x̂_i - p̂_c|^2 / T = (2 - 2 S_ic) / T``; the constant 2/T cancels between the
    positive and the log-sum-exp, so the loss is a softmax over ``2 S / T`` with (ProxyNCA++)
    or without (classic) the positive in the denominator.
    """
    return softmax_loss_from_terms(
        softmax_terms(embeddings, proxies, labels, 2.0 / temperature, not assignment_probability, synthetic)
    )


def proxy_anchor_loss(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    alpha: float,
    delta: float,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> Tensor:
    """Proxy-Anchor loss -> scalar. embeddings (B, d), proxies (C, d), labels (B,)."""
    return combine_anchor_terms(anchor_terms(embeddings, proxies, labels, alpha, delta, None, synthetic), False)


def proxy_isa_loss(
    embeddings: Tensor,
    proxies: Tensor,
    labels: Tensor,
    alpha: float,
    delta: float,
    isa: ISAClassParams,
    synthetic: SyntheticProxies | Tensor | None = None,
) -> Tensor:
    """Proxy-ISA loss -> scalar, given the per-class constants ``isa`` (C + n_synthetic,).

    Build ``isa`` from the state with :func:`isa_class_params`.
    """
    return combine_anchor_terms(anchor_terms(embeddings, proxies, labels, alpha, delta, isa, synthetic), True)


def isa_class_params(
    effective_num: Tensor,
    learned_sim: Tensor,
    V: float,
    k: float,
    lam: float,
    tau: float,
    filter_on: bool,
) -> ISAClassParams:
    """Per-class Proxy-ISA constants from the state, all (C,) (docs/losses.md, Proxy-ISA).

    ``nu = 1/(1 + ln(1 + E))``; ``sigma = (1 + e^-tau)(nu - 1)/(1 + e^(V - tau - E)) + 1``;
    ``eta = (1 + k (1 - S_learned)) nu + lam``; ``S_out = S_learned - eta``;
    negatives below ``S_out`` are scaled by ``1/max(1, E)``.
    """
    e = effective_num
    nu = 1.0 / (1.0 + torch.log1p(e))
    # exp(V - tau - E) overflows float32 for V >~ 90: 1/(1 + e^x) is sigmoid(-x), which does not.
    sigma = (1.0 + math.exp(-tau)) * (nu - 1.0) * torch.sigmoid(e - (V - tau)) + 1.0
    eta = (1.0 + k * (1.0 - learned_sim)) * nu + lam
    s_out = learned_sim - eta
    neg_scale = 1.0 / e.clamp_min(1.0)
    return ISAClassParams(sigma, neg_scale, s_out, learned_sim.clone(), filter_on)
