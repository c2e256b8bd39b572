"""Proxy-ISA (Li et al., MMAsia 2022): Proxy-Anchor with informative-sample-aware weights.

Per-class state (buffers, in ``state_dict``): ``count`` (clean samples seen), ``effective_num``
(E_c = (1 - beta^n_c) / (1 - beta), beta = (V - 1) / V), ``learned_sim`` (S_learned(c)), and the
memory queue of clean, detached, L2-normalised embeddings. Phases: ``memory_on`` and
``filter_on`` (switched by :meth:`ProxyISALoss.set_epoch`, 0-based epochs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import ProxyLoss, check_positive
from .functional import ISAClassParams, SyntheticProxies, isa_class_params, normalize_rows, proxy_isa_loss
from .memory import MemoryQueue
from .proxy_anchor import check_delta

__all__ = ["ProxyISALoss", "effective_number"]


def effective_number(count: Tensor, V: float) -> Tensor:
    """E = (1 - beta^n) / (1 - beta) with beta = (V - 1) / V, for counts (C,) -> (C,) float64.

    0 at n = 0, 1 at n = 1, -> V as n -> inf.
    """
    beta = (V - 1.0) / V
    # expm1/log1p keep the small-n values exact: 1 - beta^n = -expm1(n log beta).
    return -torch.expm1(count.to(torch.float64) * math.log(beta)) * V


class ProxyISALoss(ProxyLoss):
    """Proxy-ISA. Hyper-parameters (authors' defaults): alpha 32, delta 0.1, V 100, k 0.9,
    lam (lambda) 0.1, h 0.15, tau 1.5, memory_size 55000.

    ``forward`` computes the loss from the state *before* this step, then (training mode
    only) updates it: once ``filter_on``, positives with ``S_{i,y_i} < S_out(y_i)`` are
    outliers (not counted, not enqueued); ``count``/``effective_num`` of the classes with
    clean samples are updated; once ``memory_on``, the clean normalised embeddings are
    enqueued and ``learned_sim`` of those classes becomes ``h * mean <f_j, p̂_c>`` over the
    memory rows of class c. Deterministic (no randomness at all).
    """

    count: Tensor
    effective_num: Tensor
    learned_sim: Tensor

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        alpha: float = 32.0,
        delta: float = 0.1,
        V: float = 100.0,
        k: float = 0.9,
        lam: float = 0.1,
        h: float = 0.15,
        tau: float = 1.5,
        memory_size: int = 55000,
        generator: torch.Generator | None = None,
    ) -> None:
        self.alpha = check_positive("alpha", alpha)
        self.delta = check_delta(delta)
        self.V = check_positive("V", V)
        if self.V <= 1.0:
            raise ValueError(f"V must be > 1 (beta = (V - 1) / V in (0, 1)), got {V!r}")
        self.k = check_positive("k", k, strict=False)
        self.lam = check_positive("lam", lam, strict=False)
        self.h = check_positive("h", h)
        self.tau = check_positive("tau", tau, strict=False)
        if not isinstance(memory_size, int) or isinstance(memory_size, bool) or memory_size < 1:
            raise ValueError(f"memory_size must be an int >= 1, got {memory_size!r}")
        super().__init__(num_classes, embedding_dim, generator)
        self.memory_size = memory_size
        self.register_buffer("count", torch.zeros(num_classes, dtype=torch.long))
        self.register_buffer("effective_num", torch.zeros(num_classes))
        self.register_buffer("learned_sim", torch.ones(num_classes))
        self.memory = MemoryQueue(memory_size, embedding_dim)
        self.memory_on = False
        self.filter_on = False

    # ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int, memory_start_epoch: int = 2) -> None:
        """Switch the phases for a 0-based ``epoch``: the memory (and S_learned updates) from
        ``memory_start_epoch`` on, the outlier filter one epoch later (authors: 2 and 3)."""
        if int(epoch) < 0 or int(memory_start_epoch) < 0:
            raise ValueError(f"epochs are 0-based and >= 0, got {epoch!r}, {memory_start_epoch!r}")
        self.memory_on = int(epoch) >= int(memory_start_epoch)
        self.filter_on = int(epoch) >= int(memory_start_epoch) + 1

    def get_extra_state(self) -> dict[str, Any]:
        # The phase flags belong to the checkpoint: a resumed run continues in its phase.
        return {"memory_on": self.memory_on, "filter_on": self.filter_on}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.memory_on = bool(state["memory_on"])
        self.filter_on = bool(state["filter_on"])

    def class_params(self, extra: int = 0) -> ISAClassParams:
        """Per-class constants from the current state (C + extra,); extras are neutral."""
        params = isa_class_params(
            self.effective_num, self.learned_sim, self.V, self.k, self.lam, self.tau, self.filter_on
        )
        return params.padded(extra)

    # ----------------------------------------------------------------------------------
    def loss_from(
        self, embeddings: Tensor, proxies: Tensor, labels: Tensor, synthetic: SyntheticProxies | None = None
    ) -> Tensor:
        extra = len(synthetic) if synthetic is not None else 0
        return proxy_isa_loss(
            embeddings, proxies, labels, self.alpha, self.delta, self.class_params(extra), synthetic
        )

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return self.loss_from(embeddings, proxies, labels)

    @torch.no_grad()
    def update_state(self, embeddings: Tensor, labels: Tensor) -> None:
        """The post-loss state update from the real batch: embeddings (B, d), labels (B,)."""
        with torch.autocast(embeddings.device.type, enabled=False):
            x_hat = normalize_rows(embeddings.detach())
            proxies = self.proxies.detach()
            if self.filter_on:
                # Outlier boundary from the state before this update. Only the B proxies of
                # the batch are normalised (not the C x d matrix).
                p_hat = normalize_rows(proxies[labels]).to(x_hat.dtype)
                s_pos = (x_hat * p_hat).sum(dim=1)
                s_out = self.class_params().s_out.to(s_pos.dtype)
                clean = s_pos >= s_out[labels]
                x_clean, y_clean = x_hat[clean], labels[clean]
            else:
                x_clean, y_clean = x_hat, labels
            added = torch.bincount(y_clean, minlength=self.num_classes)
            touched = added > 0
            self.count.add_(added)
            e_new = effective_number(self.count, self.V).to(self.effective_num.dtype)
            self.effective_num.copy_(torch.where(touched, e_new, self.effective_num))
            if self.memory_on:
                self.memory.enqueue(x_clean, y_clean)
                self._refresh_learned_sim(proxies, touched)

    def _refresh_learned_sim(self, proxies: Tensor, touched: Tensor) -> None:
        """S_learned(c) = h * mean over memory rows of class c of <f_j, p̂_c>, for touched c.

        Computed as h * <mean_j f_j, p̂_c> (the same, by linearity): one gather of the
        memory rows of the touched classes and a sum per class, no per-row proxy gather.
        """
        feats, labs = self.memory.get()
        classes = touched.nonzero().squeeze(1)  # (k,), at most B classes
        slot = torch.full((self.num_classes,), -1, dtype=torch.long, device=labs.device)
        slot[classes] = torch.arange(classes.numel(), device=labs.device)
        row_slot = slot[labs]
        sel = (row_slot >= 0).nonzero().squeeze(1)
        sums = torch.zeros(classes.numel(), feats.shape[1], dtype=feats.dtype, device=feats.device)
        sums.index_add_(0, row_slot[sel], feats[sel])
        n = torch.bincount(row_slot[sel], minlength=classes.numel())
        p_hat = normalize_rows(proxies[classes])
        means = sums.to(p_hat.dtype) / n.clamp_min(1).unsqueeze(1).to(p_hat.dtype)
        sim = self.h * (means * p_hat).sum(dim=1)
        keep = n > 0  # a class whose rows were all overwritten keeps its value
        self.learned_sim[classes[keep]] = sim[keep].to(self.learned_sim.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, alpha={self.alpha:g}, delta={self.delta:g}, V={self.V:g}, "
            f"k={self.k:g}, lam={self.lam:g}, h={self.h:g}, tau={self.tau:g}, "
            f"memory_size={self.memory_size}, memory_on={self.memory_on}, filter_on={self.filter_on}"
        )
