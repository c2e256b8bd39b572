"""Proxy-ISA (Li et al., MMAsia 2022): Proxy-Anchor with informative-sample-aware weights.

Per-class state (buffers, in ``state_dict``): ``count`` (clean samples seen), ``effective_num``
(E_c = (1 - beta^n_c) / (1 - beta), beta = (V - 1) / V), ``learned_sim`` (S_learned(c)), and the
memory queue of clean, detached, L2-normalised embeddings. Phases: ``memory_on`` and
``filter_on`` (switched by :meth:`ProxyISALoss.set_epoch`, 0-based epochs).

Class-sharded (a :class:`~proxies.sharding.ShardContext` over W ranks), the per-class state
is *owner-held*: each rank keeps ``count``, ``effective_num`` and ``learned_sim`` of the
classes it owns (C_local entries, the same numbers as the same entries of one process),
because only the owner needs them: the loss terms of class c, its outlier boundary and its
``S_learned`` update all happen on the rank that owns proxy c. What every rank needs is
shared explicitly: the outlier decision of each sample (made by the owner of its label, one
sum all-reduce of B flags), after which every rank enqueues the same clean rows of the
all-gathered batch in rank order, so the memory queue is identical on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import ProxyLoss, check_int, check_real
from .functional import ISAClassParams, SyntheticProxies, anchor_terms, isa_class_params, normalize_rows
from .memory import MemoryQueue
from .sharding import ShardContext

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
    enqueued and ``learned_sim`` of *every* class of the batch that has rows in the memory
    (after this enqueue) becomes ``h * mean <f_j, p̂_c>`` over those rows, also for a class
    whose samples in this step were all outliers (as the official code does; docs/losses.md).
    Deterministic (no randomness at all).
    """

    count: Tensor
    effective_num: Tensor
    learned_sim: Tensor
    per_class_state = ("proxies", "count", "effective_num", "learned_sim")

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
        shard: ShardContext | None = None,
    ) -> None:
        # The rules (every value finite), checked here only (the config builds the loss to check):
        self.alpha = check_real("alpha", alpha)  # > 0: the scale, as Proxy-Anchor
        self.delta = check_real("delta", delta, strict=False)  # >= 0: the margin, as Proxy-Anchor
        self.V = check_real("V", V, 1.0)  # > 1: beta = (V - 1) / V must lie in (0, 1)
        self.k = check_real("k", k, strict=False)  # >= 0: search-length slope (0: constant)
        self.lam = check_real("lam", lam, strict=False)  # >= 0: search-length offset
        # > 0: S_learned = h * mean cosine; h = 0 would pin every S_learned at 0, whatever the
        # memory holds (the official code and the paper use 0.15).
        self.h = check_real("h", h)
        # > 0: the decay sigma_c is a sigmoid in E_c centred at E_c = V - tau, and E_c < V; with
        # tau <= 0 the centre lies at or beyond what E_c ever reaches (authors: 1.5).
        self.tau = check_real("tau", tau)
        self.memory_size = check_int("memory_size", memory_size, 1)
        super().__init__(num_classes, embedding_dim, generator, shard)
        # Owner-held: this shard's classes only (all C with W = 1).
        self.register_buffer("count", torch.zeros(self.num_local, dtype=torch.long))
        self.register_buffer("effective_num", torch.zeros(self.num_local))
        self.register_buffer("learned_sim", torch.ones(self.num_local))
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
        """Per-class constants from the current state (C_local + extra,); extras are neutral."""
        params = isa_class_params(
            self.effective_num, self.learned_sim, self.V, self.k, self.lam, self.tau, self.filter_on
        )
        return params.padded(extra)

    # ----------------------------------------------------------------------------------
    def loss_from(
        self,
        embeddings: Tensor,
        proxies: Tensor,
        labels: Tensor,
        synthetic: SyntheticProxies | Tensor | None = None,
    ) -> Tensor:
        extra = len(synthetic) if synthetic is not None else 0
        terms = anchor_terms(embeddings, proxies, labels, self.alpha, self.delta, self.class_params(extra), synthetic)
        return self.shard.anchor_loss(terms, isa=True)

    @torch.no_grad()
    def update_state(self, embeddings: Tensor, labels: Tensor) -> None:
        """The post-loss state update from the real batch: embeddings (B, d), labels (B,)
        global (sharded: the all-gathered batch, the same on every rank)."""
        shard = self.shard
        with torch.autocast(embeddings.device.type, enabled=False):
            x_hat = normalize_rows(embeddings.detach())
            proxies = self.proxies.detach()
            local = shard.localize(labels)
            if self.filter_on:
                # Outlier boundary from the state before this update, decided by the owner of
                # each label. Only the proxies of the batch are normalised (not C x d).
                rows = (local >= 0).nonzero().squeeze(1) if shard.sharded else None
                y_own = local if rows is None else local[rows]
                x_own = x_hat if rows is None else x_hat[rows]
                p_hat = normalize_rows(proxies[y_own]).to(x_hat.dtype)
                s_pos = (x_own * p_hat).sum(dim=1)
                s_out = self.class_params().s_out.to(s_pos.dtype)
                outlier = s_pos < s_out[y_own]
                if rows is not None:
                    # Every sample is decided by exactly one rank: a sum shares the decisions.
                    flags = torch.zeros(labels.shape[0], dtype=torch.long, device=labels.device)
                    flags[rows] = outlier.long()
                    outlier = shard.all_reduce_sum(flags) > 0
                clean = ~outlier
                x_clean, y_clean, local_clean = x_hat[clean], labels[clean], local[clean]
            else:
                x_clean, y_clean, local_clean = x_hat, labels, local
            mine = local_clean[local_clean >= 0] if shard.sharded else local_clean
            added = torch.bincount(mine, minlength=self.num_local)
            touched = added > 0  # classes with a clean sample: only their count / E change
            self.count.add_(added)
            e_new = effective_number(self.count, self.V).to(self.effective_num.dtype)
            self.effective_num.copy_(torch.where(touched, e_new, self.effective_num))
            if self.memory_on:
                self.memory.enqueue(x_clean, y_clean)
                # S_learned: every class of the batch that this rank owns, clean or not, as
                # the official code does (docs/losses.md). Why: S_learned(c) (and with it the
                # outlier boundary) then follows the moving proxy c through the memory rows
                # even in a step where all of c's samples were outliers, instead of keeping
                # a value measured against an older proxy.
                in_batch = torch.zeros(self.num_local, dtype=torch.bool, device=labels.device)
                in_batch[local[local >= 0] if shard.sharded else local] = True
                self._refresh_learned_sim(proxies, in_batch)

    def _refresh_learned_sim(self, proxies: Tensor, classes_mask: Tensor) -> None:
        """S_learned(c) = h * mean over memory rows of class c of <f_j, p̂_c>, for the local
        classes c of ``classes_mask`` (C_local,) bool that have rows in the memory; the
        others keep their value. ``proxies`` (C_local, d): as used in this step's forward.

        Computed as h * <mean_j f_j, p̂_c> (the same, by linearity): one gather of the
        memory rows of those classes and a sum per class, no per-row proxy gather.
        """
        feats, labs = self.memory.get()
        classes = classes_mask.nonzero().squeeze(1)  # (k,) local ids, at most B classes
        # One slot per local class plus a last one (-1) for the rows of other shards' classes.
        slot = torch.full((self.num_local + 1,), -1, dtype=torch.long, device=labs.device)
        slot[classes] = torch.arange(classes.numel(), device=labs.device)
        row_slot = slot[self.shard.localize(labs)]
        sel = (row_slot >= 0).nonzero().squeeze(1)
        sums = torch.zeros(classes.numel(), feats.shape[1], dtype=feats.dtype, device=feats.device)
        sums.index_add_(0, row_slot[sel], feats[sel])
        n = torch.bincount(row_slot[sel], minlength=classes.numel())
        p_hat = normalize_rows(proxies[classes])
        means = sums.to(p_hat.dtype) / n.clamp_min(1).unsqueeze(1).to(p_hat.dtype)
        sim = self.h * (means * p_hat).sum(dim=1)
        keep = n > 0  # no memory rows (all outliers so far, or overwritten): keep the value
        self.learned_sim[classes[keep]] = sim[keep].to(self.learned_sim.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, alpha={self.alpha:g}, delta={self.delta:g}, V={self.V:g}, "
            f"k={self.k:g}, lam={self.lam:g}, h={self.h:g}, tau={self.tau:g}, "
            f"memory_size={self.memory_size}, memory_on={self.memory_on}, filter_on={self.filter_on}"
        )
