"""Proxy Synthesis (Gu et al. 2021): a wrapper that adds synthetic classes to any proxy loss."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .base import ProxyLoss, check_real, default_generator, full_precision
from .functional import SyntheticProxies, normalize_rows
from .sharding import ShardContext

__all__ = ["DEFAULT_ALPHA", "DEFAULT_MU", "ProxySynthesis", "adjacent_distinct_order", "sample_beta"]

# The authors' defaults, the one place they are written (the config's defaults use these).
# alpha > 0: the Beta(alpha, alpha) parameter; mu >= 0: the synthetic ratio (0 = the base loss).
DEFAULT_ALPHA = 0.4
DEFAULT_MU = 1.0

# Without a generator, lambda is drawn from a private generator with this seed (never the
# global RNG), so two runs with the same config draw the same lambdas.
DEFAULT_SYNTHESIS_SEED = 1


def _std_normal(gen: torch.Generator) -> float:
    return float(torch.randn((), generator=gen, dtype=torch.float64, device=gen.device))


def _uniform(gen: torch.Generator) -> float:
    # (0, 1]: log(u) stays finite.
    return 1.0 - float(torch.rand((), generator=gen, dtype=torch.float64, device=gen.device))


def _log_gamma_sample(a: float, gen: torch.Generator) -> float:
    """log of a Gamma(a, 1) sample (Marsaglia & Tsang 2000); only the given generator is used.

    For a < 1: Gamma(a) = Gamma(a + 1) * U^(1/a), kept in logs (U^(1/a) underflows for small a).
    """
    boost = 0.0
    if a < 1.0:
        boost = math.log(_uniform(gen)) / a
        a += 1.0
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = _std_normal(gen)
        v = 1.0 + c * x
        if v <= 0.0:
            continue
        v = v * v * v
        if math.log(_uniform(gen)) < 0.5 * x * x + d - d * v + d * math.log(v):
            return math.log(d * v) + boost


def sample_beta(alpha: float, beta: float, generator: torch.Generator) -> float:
    """One draw of Beta(alpha, beta) in (0, 1) as G1 / (G1 + G2) of two Gamma draws.

    Reproducible given the generator; the global RNG is not touched.
    """
    lg1 = _log_gamma_sample(alpha, generator)
    lg2 = _log_gamma_sample(beta, generator)
    # G1 / (G1 + G2) = sigmoid(log G1 - log G2): no overflow, no 0/0.
    return 1.0 / (1.0 + math.exp(min(700.0, lg2 - lg1)))


def adjacent_distinct_order(labels: Tensor) -> Tensor | None:
    """A permutation (B,) after which no two cyclically adjacent labels are equal, or None
    when ``labels`` (B,) already has that property.

    Deterministic: sort by (count desc, label, position) and deal the result onto the even
    positions, then the odd ones. This succeeds whenever it is possible (no label on more
    than B // 2 samples, B >= 2); otherwise a warning is issued and the order is the best
    this construction gives (a label with more than half the batch must touch itself).
    """
    b = labels.shape[0]
    if b < 2:
        return None
    if not bool((labels == labels.roll(1)).any()):
        return None
    counts = torch.bincount(labels)
    # Stable sorts: position, then label, then count (desc) as the primary key.
    by_label = torch.argsort(labels, stable=True)
    order = by_label[torch.argsort(-counts[labels[by_label]], stable=True)]
    slots = torch.cat([torch.arange(0, b, 2), torch.arange(1, b, 2)]).to(labels.device)
    perm = torch.empty_like(order)
    perm[slots] = order
    if int(counts.max()) > b // 2:
        warnings.warn(
            f"Proxy Synthesis: a label holds {int(counts.max())} of {b} samples; adjacent labels "
            "cannot all differ, some synthetic samples mix two samples of one class",
            RuntimeWarning,
            stacklevel=3,
        )
    return perm


class ProxySynthesis(nn.Module):
    """Proxy Synthesis around a proxy loss: ``loss(embeddings (B, d), labels (B,), lam=None)``.

    Per batch: reorder the batch so adjacent labels differ (cyclically) if needed; draw one
    ``lam ~ Beta(alpha, alpha)`` from ``generator`` (or use the given ``lam``); build
    ``x~_i = lam x̂_i + (1 - lam) x̂_{i-1}`` and ``p~_i = lam p̂_{y_i} + (1 - lam) p̂_{y_{i-1}}``
    with label ``C + i``; keep the first ``floor(B mu)`` (at most B); apply the base loss
    over ``B + n`` embeddings and ``C + n`` proxies. Gradients flow through the synthetics.
    ``mu = 0`` is exactly the base loss. A stateful base (Proxy-ISA) updates its state from
    the real samples only (synthetic classes have no state). The generator state is part of
    ``state_dict`` (``_extra_state``), so a resumed run draws the same lambdas.

    Class-sharded base (``base_loss.shard`` over W ranks): every rank gets the same global
    batch and draws the same lambda (same seed, same number of draws: the generator state
    stays identical on every rank). Synthetic proxy j is counted on exactly one rank, the one
    whose contiguous part of the n synthetic columns holds j (the class-range rule applied to
    n); its two real proxies are fetched from their owners (``ShardContext.fetch_rows``),
    and their gradient is summed back to the owners.
    """

    def __init__(
        self,
        base_loss: ProxyLoss,
        alpha: float = DEFAULT_ALPHA,
        mu: float = DEFAULT_MU,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base_loss, ProxyLoss):
            raise ValueError(f"base_loss must be a ProxyLoss, got {type(base_loss).__name__}")
        self.alpha = check_real("alpha", alpha)
        self.mu = check_real("mu", mu, strict=False)
        self.base = base_loss
        self.generator = default_generator(generator, DEFAULT_SYNTHESIS_SEED)

    @property
    def proxies(self) -> nn.Parameter:
        """The base loss' proxies (C_local, d): all of them, or this rank's shard."""
        return self.base.proxies

    @property
    def shard(self) -> ShardContext:
        return self.base.shard

    @property
    def num_classes(self) -> int:
        return self.base.num_classes

    @property
    def embedding_dim(self) -> int:
        return self.base.embedding_dim

    def set_epoch(self, epoch: int, **kwargs: Any) -> None:
        """Forwarded to the base loss when it has phases (Proxy-ISA)."""
        fn = getattr(self.base, "set_epoch", None)
        if fn is not None:
            fn(epoch, **kwargs)

    def get_extra_state(self) -> dict[str, Any]:
        return {"generator_state": self.generator.get_state()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator_state"])

    def sample_lambda(self) -> float:
        """One lam ~ Beta(alpha, alpha) from this wrapper's generator."""
        return sample_beta(self.alpha, self.alpha, self.generator)

    def num_synthetic(self, batch_size: int) -> int:
        """floor(B mu), at most B."""
        return min(batch_size, int(math.floor(batch_size * self.mu)))

    def forward(self, embeddings: Tensor, labels: Tensor, lam: float | None = None) -> Tensor:
        """embeddings (B, d), labels (B,) long, optional fixed ``lam`` -> scalar loss.

        Like every proxy loss, computed in float32 (or float64) with autocast off, also when
        called inside an autocast region (half / bfloat16 embeddings are upcast).
        """
        self.base.check_inputs(embeddings, labels)
        with torch.autocast(embeddings.device.type, enabled=False):
            return self._forward(full_precision(embeddings), labels, lam)

    def _forward(self, embeddings: Tensor, labels: Tensor, lam: float | None) -> Tensor:
        """:meth:`forward` after the checks, with autocast off and float32/64 embeddings."""
        base = self.base
        n = self.num_synthetic(embeddings.shape[0])
        if n == 0:
            return base(embeddings, labels)
        if lam is None:
            lam = self.sample_lambda()
        lam = float(lam)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {lam!r}")

        perm = adjacent_distinct_order(labels)
        x_hat = normalize_rows(embeddings)
        xs, ys = (x_hat, labels) if perm is None else (x_hat[perm], labels[perm])
        # x~_i = lam x̂_i + (1 - lam) x̂_{i-1}: row i paired with its cyclic predecessor.
        x_syn = torch.lerp(xs.roll(1, dims=0)[:n], xs[:n], lam)
        first, second = ys[:n], ys.roll(1)[:n]
        shard = base.shard
        synthetic: SyntheticProxies | Tensor
        if not shard.sharded:
            synthetic = SyntheticProxies(first=first, second=second, lam=lam)
            y_all = torch.cat([ys, base.num_classes + torch.arange(n, device=labels.device)])
        else:
            synthetic, y_syn = self._local_synthetic(first, second, lam)
            y_all = torch.cat([shard.localize(ys), y_syn])
        loss = base.loss_from(torch.cat([xs, x_syn]), base.proxies, y_all, synthetic)
        if base.training:
            base.update_state(embeddings, labels)
        return loss

    def _local_synthetic(self, first: Tensor, second: Tensor, lam: float) -> tuple[Tensor, Tensor]:
        """Sharded: this rank's raw synthetic proxies (n_local, d) and the local labels (n,)
        of the n synthetic samples (``C_local + j - start`` for this rank's j, else -1).

        ``first``/``second`` (n,) global class ids, identical on every rank.
        """
        base = self.base
        shard = base.shard
        n = first.shape[0]
        start, end = shard.split(n)
        # The batch's proxies (at most 2n distinct classes), fetched once from their owners.
        classes, inverse = torch.unique(torch.cat([first, second]), return_inverse=True)
        p_hat = normalize_rows(shard.fetch_rows(base.proxies, classes))
        # Same as SyntheticProxies.raw: lam p̂_first + (1 - lam) p̂_second, unnormalised. Even
        # an empty slice keeps the fetch in this rank's graph: its backward is a collective.
        q = torch.lerp(p_hat[inverse[n + start : n + end]], p_hat[inverse[start:end]], lam)
        y_syn = torch.full((n,), -1, dtype=torch.long, device=first.device)
        y_syn[start:end] = base.num_local + torch.arange(end - start, device=first.device)
        return q, y_syn

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}, mu={self.mu:g}"
