"""One Proxy-ISA training step the way the authors' code does it, for tests only.

A dense, pure-torch transcription (float64 assumed) of the official step
(rioyokotalab/ProxyISA): the loss from the state before the step, then the state update.
The snapshots of that repository reachable from here hold its memory buffer but not the ISA
loss itself, so the step is transcribed from docs/losses.md ("Proxy-ISA"), which records
the official behaviour where it differs from the paper. In the style of the authors' code
(one-hot masks over the B x C cosine matrix, ``l2_norm`` with +1e-12 under the root),
independent of ``proxies/`` and of tests/reference (whose update refreshes ``S_learned`` only
for classes with a clean sample, the rule before the official one was adopted).

The state update of one step, in order:

1. outliers (filter on): positives with ``S_{i,y_i} < S_out(y_i)``, S_out from the state
   before the step; the rest are clean;
2. ``count[c] += #clean of c`` and ``E_c`` recomputed, for classes with a clean sample only;
3. memory on: enqueue the clean ``x̂`` (ring buffer, the oldest rows dropped), then for EVERY
   class c of the batch with rows in the memory (after the enqueue), clean samples or not:
   ``S_learned(c) = h * mean_{j in memory, y_j = c} <f_j, p̂_c>``, p̂ as in this step's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tests.reference.losses_ref import ISAHyper


def l2_norm(x: Tensor) -> Tensor:
    """Rows of x (N, d) over sqrt(|x|^2 + 1e-12), as the authors' ``l2_norm``."""
    return x / torch.sqrt((x * x).sum(dim=1, keepdim=True) + 1e-12)


@dataclass
class OfficialISA:
    """Hyper-parameters and state of the official step; tensors (C,) float64 / long."""

    num_classes: int
    dim: int
    memory_size: int
    hp: ISAHyper = field(default_factory=ISAHyper)  # alpha, delta, V, k, lam, h, tau
    count: Tensor = field(init=False)
    effective_num: Tensor = field(init=False)
    learned_sim: Tensor = field(init=False)
    mem_feats: Tensor = field(init=False)
    mem_targets: Tensor = field(init=False)

    def __post_init__(self) -> None:
        c = self.num_classes
        self.count = torch.zeros(c, dtype=torch.long)
        self.effective_num = torch.zeros(c, dtype=torch.float64)
        self.learned_sim = torch.ones(c, dtype=torch.float64)
        self.mem_feats = torch.zeros(0, self.dim, dtype=torch.float64)
        self.mem_targets = torch.zeros(0, dtype=torch.long)

    # ------------------------------------------------------------------------------------
    def class_constants(self) -> tuple[Tensor, Tensor, Tensor]:
        """(sigma, 1 / max(1, E), S_out), each (C,), from the current state."""
        e, s_l = self.effective_num, self.learned_sim
        nu = 1.0 / (1.0 + torch.log(1.0 + e))
        sigma = (1.0 + math.exp(-self.hp.tau)) * (nu - 1.0) / (1.0 + torch.exp(self.hp.V - self.hp.tau - e)) + 1.0
        eta = (1.0 + self.hp.k * (1.0 - s_l)) * nu + self.hp.lam
        return sigma, 1.0 / torch.clamp(e, min=1.0), s_l - eta

    def loss(self, x: Tensor, p: Tensor, y: Tensor, filter_on: bool) -> Tensor:
        """L_ISA of embeddings x (B, d), proxies p (C, d), labels y (B,) -> scalar."""
        cos = l2_norm(x) @ l2_norm(p).t()
        pos_mask = torch.nn.functional.one_hot(y, self.num_classes).to(cos.dtype)
        neg_mask = 1.0 - pos_mask
        sigma, neg_scale, s_out = self.class_constants()
        c = cos.detach()  # the weights are constants
        if filter_on:
            inside = (c >= s_out) & (c <= self.learned_sim)
            w_pos = torch.where(inside, 1.0 + sigma, sigma).expand_as(c)
        else:
            w_pos = torch.ones_like(c)
        w_neg = torch.where(c < s_out, neg_scale, torch.ones_like(neg_scale)).expand_as(c)
        pos_exp = torch.exp(self.hp.alpha * w_pos * (self.hp.delta - cos))
        neg_exp = torch.exp(self.hp.alpha * w_neg * (cos + self.hp.delta))
        n_pos, n_neg = pos_mask.sum(dim=0), neg_mask.sum(dim=0)
        with_pos, with_neg = n_pos > 0, n_neg > 0
        q_pos = torch.log(1.0 + (pos_mask * pos_exp).sum(dim=0))
        q_neg = torch.log(1.0 + (neg_mask * neg_exp).sum(dim=0))
        mean_w_pos = (pos_mask * w_pos).sum(dim=0)[with_pos] / n_pos[with_pos]
        mean_w_neg = (neg_mask * w_neg).sum(dim=0)[with_neg] / n_neg[with_neg]
        return q_pos[with_pos].sum() / mean_w_pos.sum() + q_neg[with_neg].sum() / mean_w_neg.sum()

    @torch.no_grad()
    def update(self, x: Tensor, p: Tensor, y: Tensor, memory_on: bool, filter_on: bool) -> None:
        """The post-loss update (module docstring), in place; p as used in this step's loss."""
        x_hat, p_hat = l2_norm(x), l2_norm(p)
        _, _, s_out = self.class_constants()  # the state before this step
        if filter_on:
            s_pos = (x_hat * p_hat[y]).sum(dim=1)
            clean = s_pos >= s_out[y]
        else:
            clean = torch.ones_like(y, dtype=torch.bool)
        beta = (self.hp.V - 1.0) / self.hp.V
        for c in torch.unique(y[clean]).tolist():
            self.count[c] += int((y[clean] == c).sum())
            self.effective_num[c] = (1.0 - beta ** int(self.count[c])) / (1.0 - beta)
        if not memory_on:
            return
        self.mem_feats = torch.cat([self.mem_feats, x_hat[clean]])[-self.memory_size :]
        self.mem_targets = torch.cat([self.mem_targets, y[clean]])[-self.memory_size :]
        for c in torch.unique(y).tolist():  # every class of the batch, clean or not
            rows = self.mem_targets == c
            if bool(rows.any()):
                self.learned_sim[c] = self.hp.h * (self.mem_feats[rows] @ p_hat[c]).mean()

    def step(self, x: Tensor, p: Tensor, y: Tensor, memory_on: bool, filter_on: bool) -> Tensor:
        """One official step: the loss from the state before it, then the update."""
        value = self.loss(x, p, y, filter_on)
        self.update(x, p, y, memory_on, filter_on)
        return value
