"""Plain loop-based re-implementations of docs/losses.md, for tests only.

Written from the specification, independently of ``proxies/``: loops over samples and
classes, one dot product at a time, raw ``exp``/``log`` (float64 inputs assumed), torch
scalars so that autograd gives reference gradients too. Slow on purpose; keep sizes tiny.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def unit(v: Tensor) -> Tensor:
    """v / |v| for one vector (d,)."""
    return v / torch.sqrt(torch.dot(v, v))


def cosines(x: Tensor, p: Tensor) -> list[list[Tensor]]:
    """S[i][c] = <x̂_i, p̂_c> as a nested list of scalar tensors."""
    xs = [unit(x[i]) for i in range(x.shape[0])]
    ps = [unit(p[c]) for c in range(p.shape[0])]
    return [[torch.dot(xi, pc) for pc in ps] for xi in xs]


def _log_sum_exp(values: list[Tensor]) -> Tensor:
    total = values[0] * 0.0
    for v in values:
        total = total + torch.exp(v)
    return torch.log(total)


# ------------------------------------------------------------------------------------------
def norm_softmax_ref(x: Tensor, p: Tensor, y: list[int], temperature: float) -> Tensor:
    """mean_i -log softmax(S_i / T)_{y_i}."""
    s = cosines(x, p)
    total = x.new_zeros(())
    for i in range(x.shape[0]):
        logits = [s[i][c] / temperature for c in range(p.shape[0])]
        total = total + (_log_sum_exp(logits) - logits[y[i]])
    return total / x.shape[0]


def proxy_nca_ref(x: Tensor, p: Tensor, y: list[int], temperature: float, assignment: bool) -> Tensor:
    """From squared distances of the unit vectors, D = |x̂ - p̂|^2 / T (not via cosines)."""
    total = x.new_zeros(())
    for i in range(x.shape[0]):
        xi = unit(x[i])
        dist = []
        for c in range(p.shape[0]):
            diff = xi - unit(p[c])
            dist.append(torch.dot(diff, diff) / temperature)
        den_terms = [-dist[c] for c in range(p.shape[0]) if assignment or c != y[i]]
        total = total + (dist[y[i]] + _log_sum_exp(den_terms))
    return total / x.shape[0]


def proxy_anchor_ref(x: Tensor, p: Tensor, y: list[int], alpha: float, delta: float) -> Tensor:
    s = cosines(x, p)
    b, c_count = x.shape[0], p.shape[0]
    pos_total, neg_total, n_with_pos = x.new_zeros(()), x.new_zeros(()), 0
    for c in range(c_count):
        pos = [torch.exp(-alpha * (s[i][c] - delta)) for i in range(b) if y[i] == c]
        neg = [torch.exp(alpha * (s[i][c] + delta)) for i in range(b) if y[i] != c]
        if pos:
            n_with_pos += 1
            pos_total = pos_total + torch.log(1.0 + sum(pos))
        neg_total = neg_total + torch.log(1.0 + sum(neg, x.new_zeros(())))
    return pos_total / n_with_pos + neg_total / c_count


# ------------------------------------------------------------------------------------------
@dataclass
class ISAState:
    """Reference Proxy-ISA state: per-class lists and a list-based ring memory."""

    count: list[int]
    effective_num: list[float]
    learned_sim: list[float]
    memory_size: int
    memory: list[tuple[Tensor, int]] = field(default_factory=list)

    @classmethod
    def fresh(cls, num_classes: int, memory_size: int) -> ISAState:
        return cls([0] * num_classes, [0.0] * num_classes, [1.0] * num_classes, memory_size)


@dataclass
class ISAHyper:
    alpha: float = 32.0
    delta: float = 0.1
    V: float = 100.0
    k: float = 0.9
    lam: float = 0.1
    h: float = 0.15
    tau: float = 1.5


def isa_class_constants(state: ISAState, hp: ISAHyper, c: int) -> tuple[float, float, float, float]:
    """(sigma_c, 1/max(1, E_c), S_out(c), S_learned(c)), straight from the formulas."""
    e, sl = state.effective_num[c], state.learned_sim[c]
    nu = 1.0 / (1.0 + math.log(1.0 + e))
    sigma = (1.0 + math.exp(-hp.tau)) * (nu - 1.0) / (1.0 + math.exp(hp.V - hp.tau - e)) + 1.0
    eta = (1.0 + hp.k * (1.0 - sl)) * nu + hp.lam
    return sigma, 1.0 / max(1.0, e), sl - eta, sl


def proxy_isa_ref(
    x: Tensor, p: Tensor, y: list[int], state: ISAState, hp: ISAHyper, filter_on: bool,
    num_stateless: int = 0,
) -> Tensor:
    """L_ISA; the last ``num_stateless`` proxies (synthetic classes) get all weights 1."""
    s = cosines(x, p)
    b, c_count = x.shape[0], p.shape[0]
    real = c_count - num_stateless
    q_pos_sum, q_neg_sum = x.new_zeros(()), x.new_zeros(())
    w_pos_den, w_neg_den = 0.0, 0.0
    for c in range(c_count):
        if c < real:
            sigma, neg_scale, s_out, s_learned = isa_class_constants(state, hp, c)
        else:
            sigma, neg_scale, s_out, s_learned = 1.0, 1.0, math.inf, 1.0
        pos_terms, pos_w, neg_terms, neg_w = [], [], [], []
        for i in range(b):
            sic = s[i][c]
            v = float(sic.detach())
            if y[i] == c:
                if filter_on and c < real:
                    w = 1.0 + sigma if s_out <= v <= s_learned else sigma
                else:
                    w = 1.0
                pos_terms.append(torch.exp(hp.alpha * w * (hp.delta - sic)))
                pos_w.append(w)
            else:
                w = neg_scale if v < s_out else 1.0
                neg_terms.append(torch.exp(hp.alpha * w * (sic + hp.delta)))
                neg_w.append(w)
        if pos_terms:
            q_pos_sum = q_pos_sum + torch.log(1.0 + sum(pos_terms))
            w_pos_den += sum(pos_w) / len(pos_w)
        if neg_terms:
            q_neg_sum = q_neg_sum + torch.log(1.0 + sum(neg_terms))
            w_neg_den += sum(neg_w) / len(neg_w)
    return q_pos_sum / w_pos_den + q_neg_sum / w_neg_den


def isa_update_ref(
    x: Tensor, p: Tensor, y: list[int], state: ISAState, hp: ISAHyper, memory_on: bool, filter_on: bool
) -> None:
    """The post-loss state update, in place, from the state before it."""
    x = x.detach()
    p = p.detach()
    beta = (hp.V - 1.0) / hp.V
    clean: list[int] = []
    for i in range(x.shape[0]):
        c = y[i]
        if filter_on:
            _, _, s_out, _ = isa_class_constants(state, hp, c)
            if float(torch.dot(unit(x[i]), unit(p[c]))) < s_out:
                continue  # outlier
        clean.append(i)
    touched = sorted({y[i] for i in clean})
    for c in touched:
        state.count[c] += sum(1 for i in clean if y[i] == c)
        state.effective_num[c] = (1.0 - beta ** state.count[c]) / (1.0 - beta)
    if memory_on:
        for i in clean:
            state.memory.append((unit(x[i]), y[i]))
            if len(state.memory) > state.memory_size:
                state.memory.pop(0)
        for c in touched:
            sims = [float(torch.dot(f, unit(p[c]))) for f, lab in state.memory if lab == c]
            if sims:
                state.learned_sim[c] = hp.h * sum(sims) / len(sims)


# ------------------------------------------------------------------------------------------
def synthesize_ref(x: Tensor, p: Tensor, y: list[int], lam: float, mu: float) -> tuple[Tensor, Tensor, list[int]]:
    """Proxy Synthesis step 2-3 with loops; y must already have distinct cyclic neighbours.

    Returns the extended (B + n, d) embeddings, (C + n, d) proxies and labels.
    """
    b, c_count = x.shape[0], p.shape[0]
    n = min(b, int(math.floor(b * mu)))
    xs = [unit(x[i]) for i in range(b)]
    ps = [unit(p[c]) for c in range(c_count)]
    new_x, new_p, new_y = list(xs), list(ps), list(y)
    for i in range(n):
        prev = (i - 1) % b
        new_x.append(unit(lam * xs[i] + (1.0 - lam) * xs[prev]))
        new_p.append(unit(lam * ps[y[i]] + (1.0 - lam) * ps[y[prev]]))
        new_y.append(c_count + i)
    return torch.stack(new_x), torch.stack(new_p), new_y
