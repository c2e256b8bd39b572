"""Class-sharded proxies: the one file of ``proxies/`` that touches ``torch.distributed``.

The C proxies are split by contiguous class range over the W ranks of a process group
(rank r owns ``C // W + (r < C % W)`` classes, see :func:`split_range`). Every rank sees the
whole (all-gathered) batch and computes the loss terms of the classes it owns; tiny
collectives combine them so that every rank ends up with the loss of the global batch:

* Proxy-Anchor / Proxy-ISA: one all-reduce of 4 scalars (sum of Q+, sum of Q-, and the
  two normalisers: |C+| and the column count, or the ISA weight sums).
* Softmax losses (Norm-Softmax, ProxyNCA, ProxyNCA++): the distributed log-sum-exp, a max
  all-reduce and a sum all-reduce over B-vectors (the positive logit comes from its owner).
* Proxy Synthesis: the batch's proxies are fetched from their owners (:meth:`fetch_rows`,
  whose backward sums the gradient back to the owner).

Autograd convention ("replicated consumer"): after a combining all-reduce, every rank
computes the *same* scalar loss from the same reduced values, so the upstream gradient of
the reduced value is identical on every rank and ``d loss / d (local part)`` is that
gradient itself: the backward of :meth:`ShardContext.all_reduce_sum` is the identity, with
no communication. Each rank's backward thus yields the exact gradient of its own proxy
shard and a *partial* gradient of the gathered embeddings, which the backward of
:meth:`ShardContext.gather_embeddings` sums over the ranks.

With world size 1 every collective is the identity and no ``torch.distributed`` call is
made: single-process code is the same code path.

This module also (de)serialises shards: :func:`shard_state_dict` writes one rank's shard
with its global class range, :func:`load_shard_states` rebuilds any rank's shard from the
shards of a run with any number of ranks (resharding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .functional import AnchorTerms, SoftmaxTerms, combine_anchor_terms, softmax_loss_from_terms

__all__ = [
    "SHARD_KEY",
    "ShardContext",
    "load_shard_states",
    "shard_state_dict",
    "split_range",
]


def split_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s contiguous part of ``n`` items split over ``world``.

    Rank r gets ``n // world + (r < n % world)`` items (the first ranks one more).
    """
    base, rem = divmod(int(n), int(world))
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


# --------------------------------------------------------------------------------------
# Autograd-aware collectives
# --------------------------------------------------------------------------------------
# Single-tensor all-gather / reduce-scatter (torch 2.14 renamed them *_single). nccl has
# them; gloo has them for CPU tensors since the *_single API (verified on torch 2.14);
# older gloo, and gloo on CUDA tensors, fall back to a list all-gather and an all-reduce
# followed by a slice (W times the reduce-scatter's traffic: B x d floats, small).
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GLOO_HAS_SINGLE = hasattr(dist, "reduce_scatter_single")


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward = identity (replicated consumer, see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


class _GatherRows(torch.autograd.Function):
    """All-gather equal-sized row blocks in rank order; backward: sum over ranks, own slice.

    Every rank's loss depends on all the gathered rows through its own proxy shard only, so
    each holds a *partial* gradient of the gathered tensor; the true gradient of this rank's
    rows is the sum of the partials over the ranks: a reduce-scatter where the backend has
    one (``ShardContext._single_collectives``), else an all-reduce and a slice. ``scale``
    multiplies the result: W when DDP *averages* the parameter gradients over W ranks.
    """

    @staticmethod
    def forward(ctx, x: Tensor, ctx_shard: ShardContext, scale: float) -> Tensor:  # type: ignore[override]
        ctx.shard, ctx.scale, ctx.n = ctx_shard, scale, x.shape[0]
        return ctx_shard._all_gather_raw(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        shard: ShardContext = ctx.shard
        grad = grad.contiguous()
        if shard._single_collectives(grad):
            out = grad.new_empty((ctx.n, *grad.shape[1:]))
            _REDUCE_SCATTER_SINGLE(out, grad, op=dist.ReduceOp.SUM, group=shard.group)
        else:
            total = grad.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=shard.group)
            out = total[shard.rank * ctx.n : (shard.rank + 1) * ctx.n]
        if ctx.scale != 1.0:
            out = out * ctx.scale
        return out, None, None


class _FetchRows(torch.autograd.Function):
    """Rows of the global proxy matrix, each filled in by its owner and all-reduced.

    Forward: (C_local, d) local proxies, (k,) local row index or -1 -> (k, d) on every rank.
    Backward: the (k, d) partial gradients are summed over the ranks and each owner adds
    its rows into the gradient of its local proxies.
    """

    @staticmethod
    def forward(ctx, local: Tensor, index: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        own = index >= 0
        out = local.new_zeros(index.shape[0], local.shape[1])
        out[own] = local[index[own]]
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(index)
        ctx.group, ctx.local_shape = group, local.shape
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        own = index >= 0
        g = total.new_zeros(ctx.local_shape)
        g.index_add_(0, index[own], total[own])
        return g, None, None


# --------------------------------------------------------------------------------------
# The shard context
# --------------------------------------------------------------------------------------
class ShardContext:
    """Rank, world size and class range of one shard, and the collectives the losses use.

    ``num_classes`` is the global C; this rank owns classes ``[class_start, class_end)``.
    ``group``: the process group (None = the default group). With ``world_size == 1``
    nothing touches ``torch.distributed`` and every collective is the identity.
    """

    def __init__(self, num_classes: int, rank: int = 0, world_size: int = 1, group: Any = None) -> None:
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if num_classes < world_size:
            raise ValueError(f"cannot shard {num_classes} classes over {world_size} ranks (need C >= W)")
        self.num_classes = num_classes
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.class_start, self.class_end = split_range(num_classes, rank, world_size)
        self._backend: str | None = None

    @classmethod
    def from_process_group(cls, num_classes: int, group: Any = None) -> ShardContext:
        """The shard of this process in ``group`` (default group), or W = 1 without one."""
        if dist.is_available() and dist.is_initialized():
            return cls(num_classes, dist.get_rank(group), dist.get_world_size(group), group)
        return cls(num_classes)

    # ----------------------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        """Classes owned by this rank: ``C // W + (rank < C % W)``."""
        return self.class_end - self.class_start

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)) if self.sharded else "none"
        return self._backend

    def split(self, n: int) -> tuple[int, int]:
        """This rank's contiguous part ``[start, end)`` of ``n`` items (same rule as classes)."""
        return split_range(n, self.rank, self.world_size)

    def localize(self, labels: Tensor) -> Tensor:
        """Global class ids (B,) -> local row ids (B,), -1 where another rank owns the class.

        The identity (the same tensor) when W = 1.
        """
        if not self.sharded:
            return labels
        local = labels - self.class_start
        return torch.where((local >= 0) & (local < self.num_local), local, -1)

    # ----------------------------------------------------------------------------------
    def all_reduce_sum(self, x: Tensor) -> Tensor:
        """Sum of ``x`` over the ranks (any shape). Differentiable with the replicated-consumer
        convention (backward = identity): only use it when every rank computes the same
        function of the result."""
        if not self.sharded:
            return x
        if x.requires_grad:
            return _AllReduceSum.apply(x, self.group)
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def all_reduce_max(self, x: Tensor) -> Tensor:
        """Element-wise maximum of ``x`` over the ranks; no gradient."""
        if not self.sharded:
            return x.detach()
        y = x.detach().clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=self.group)
        return y

    def _single_collectives(self, x: Tensor) -> bool:
        """Whether this backend has single-tensor all-gather / reduce-scatter for ``x``."""
        return self.backend == "nccl" or (self.backend == "gloo" and x.device.type == "cpu" and _GLOO_HAS_SINGLE)

    def _all_gather_raw(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        if self._single_collectives(x):
            out = x.new_empty((x.shape[0] * self.world_size, *x.shape[1:]))
            _ALL_GATHER_SINGLE(out, x, group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts)

    def all_gather(self, x: Tensor) -> Tensor:
        """(n, ...) from every rank -> (n W, ...) in rank order; no gradient. Same n everywhere."""
        if not self.sharded:
            return x
        return self._all_gather_raw(x.detach())

    def gather_embeddings(self, x: Tensor, ddp_average: bool = True) -> Tensor:
        """(B_local, d) -> (B_local W, d) in rank order, differentiable. Same B_local everywhere.

        Backward: the partial gradients of the W ranks are summed and each rank receives the
        slice of its own rows, multiplied by W when ``ddp_average`` (DDP then averages the
        parameter gradients over the W ranks and the result is the exact gradient of the
        global loss); with ``ddp_average=False`` the slice is the exact gradient itself.
        """
        if not self.sharded:
            return x
        if not x.requires_grad:
            return self._all_gather_raw(x)
        return _GatherRows.apply(x, self, float(self.world_size) if ddp_average else 1.0)

    def fetch_rows(self, local: Tensor, classes: Tensor) -> Tensor:
        """Rows of the global (C, d) proxy matrix for global class ids ``classes`` (k,) ->
        (k, d), identical on every rank; ``local`` is this rank's (C_local, d) shard.

        Differentiable: the backward sums the gradient over the ranks and routes each row to
        its owner. Every rank must call it with the same ``classes`` (a collective), and
        every rank's loss must depend on the result (the backward is a collective too).
        """
        if not self.sharded:
            return local[classes]
        return _FetchRows.apply(local, self.localize(classes), self.group)

    # ----------------------------------------------------------------------------------
    def softmax_loss(self, terms: SoftmaxTerms, owned: Tensor) -> Tensor:
        """Mean over the batch of ``LSE_i - pos_i`` over all shards' columns -> scalar.

        ``terms`` from this shard (lse (B,), pos (B,)); ``owned`` (B,) bool: this shard holds
        the positive of row i. ``LSE_i = m_i + log sum_r exp(lse_ri - m_i)`` with
        ``m_i = max_r lse_ri`` (max all-reduce), the sums and the positives in one sum
        all-reduce of a (2, B) tensor.
        """
        if not self.sharded:
            return softmax_loss_from_terms(terms)
        m = self.all_reduce_max(terms.lse)
        parts = torch.stack([torch.exp(terms.lse - m), torch.where(owned, terms.pos, 0.0)])
        total = self.all_reduce_sum(parts)
        return (m + torch.log(total[0]) - total[1]).mean()

    def anchor_loss(self, terms: AnchorTerms, isa: bool) -> Tensor:
        """The Proxy-Anchor (``isa=False``) / Proxy-ISA loss from this shard's per-class terms.

        One all-reduce of ``[sum Q+, sum Q-, den+, den-]``: den+ = |C+| (ISA: sum of mean w+),
        den- = the number of columns of the shard, synthetic ones included (ISA: sum of mean
        w-); summed over the shards they are the global normalisers of
        :func:`~proxies.functional.combine_anchor_terms`.
        """
        if not self.sharded:
            return combine_anchor_terms(terms, isa)
        dtype = terms.q_pos.dtype
        if isa:
            den_pos, den_neg = terms.w_pos.sum(), terms.w_neg.sum()
        else:
            den_pos = (terms.n_pos > 0).sum().to(dtype)
            den_neg = terms.q_neg.new_tensor(float(terms.q_neg.shape[0]))
        total = self.all_reduce_sum(torch.stack([terms.q_pos.sum(), terms.q_neg.sum(), den_pos, den_neg]))
        return total[0] / total[2] + total[1] / total[3].clamp_min(1e-30)

    def __repr__(self) -> str:
        return (
            f"ShardContext(num_classes={self.num_classes}, rank={self.rank}, world_size={self.world_size}, "
            f"classes=[{self.class_start}, {self.class_end}))"
        )


# --------------------------------------------------------------------------------------
# Shard checkpoints
# --------------------------------------------------------------------------------------
# Metadata key of a shard state: {"class_start", "class_end", "num_classes", "world_size",
# "rank", "replicated"}. A state without it is a legacy single-process state: classes [0, C).
SHARD_KEY = "_shard"
OPTIMIZER_KEY = "_proxy_optimizer"


def _per_class_keys(loss: nn.Module) -> set[str]:
    """State-dict keys whose first dimension is the class (C_local rows): the names listed
    by each sharded submodule's ``per_class_state``, with the submodule's prefix."""
    keys = set()
    for prefix, m in loss.named_modules():
        for name in getattr(m, "per_class_state", ()):
            keys.add(f"{prefix}.{name}" if prefix else name)
    return keys


def _shard_of(loss: nn.Module) -> ShardContext:
    for m in loss.modules():
        shard = getattr(m, "shard", None)
        if isinstance(shard, ShardContext):
            return shard
    raise ValueError(f"{type(loss).__name__} has no ShardContext (.shard)")


def shard_state_dict(
    loss: nn.Module, optimizer: torch.optim.Optimizer | None = None, include_replicated: bool | None = None
) -> dict[str, Any]:
    """This rank's shard of ``loss`` as a flat dict, to ``torch.save``.

    The loss' ``state_dict`` (per-class entries are this shard's C_local rows) plus
    ``SHARD_KEY``: its global class range. Replicated state (the ISA memory queue, phase
    flags, the Proxy Synthesis generator) is identical on every rank and only included when
    ``include_replicated`` (default: on rank 0), so a checkpoint holds it once.
    ``optimizer``: its state of the loss' parameters (e.g. Adam moments, C_local rows) is
    added under ``OPTIMIZER_KEY`` by parameter name.
    """
    shard = _shard_of(loss)
    if include_replicated is None:
        include_replicated = shard.rank == 0
    per_class = _per_class_keys(loss)
    state: dict[str, Any] = {
        k: v for k, v in loss.state_dict().items() if include_replicated or k in per_class
    }
    state[SHARD_KEY] = {
        "class_start": shard.class_start, "class_end": shard.class_end, "num_classes": shard.num_classes,
        "world_size": shard.world_size, "rank": shard.rank, "replicated": bool(include_replicated),
    }
    if optimizer is not None:
        opt_states = {}
        for name, p in loss.named_parameters():
            st = optimizer.state.get(p)
            if st:
                opt_states[name] = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
        state[OPTIMIZER_KEY] = opt_states
    return state


def _meta(state: Mapping[str, Any], num_classes: int) -> dict[str, Any]:
    meta = state.get(SHARD_KEY)
    if meta is None:  # a single-process state: the whole class range, replicated state included
        return {"class_start": 0, "class_end": num_classes, "num_classes": num_classes, "replicated": True}
    return dict(meta)


def _assemble(parts: Sequence[tuple[int, int, Tensor]], start: int, end: int) -> Tensor:
    """Rows [start, end) of a per-class tensor given as (part_start, part_end, rows) pieces."""
    first = parts[0][2]
    out = first.new_empty((end - start, *first.shape[1:]))
    for s, e, rows in parts:
        lo, hi = max(s, start), min(e, end)
        if lo < hi:
            out[lo - start : hi - start] = rows[lo - s : hi - s]
    return out


def load_shard_states(loss: nn.Module, states: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Load this rank's shard of ``loss`` from the shard states of a run with any W.

    ``states``: every shard's :func:`shard_state_dict` (load them with ``mmap=True``: only
    the rows of this shard are then read). They must cover ``[0, C)`` without gaps and
    exactly one must hold the replicated state. Per-class entries are rebuilt for this
    rank's class range; replicated ones come from that state. Returns the optimizer state
    of the loss' parameters rebuilt the same way (parameter name -> state; empty when the
    checkpoint has none), for :func:`torch.optim.Optimizer.load_state_dict`.
    """
    shard = _shard_of(loss)
    c = shard.num_classes
    metas = [_meta(s, c) for s in states]
    for m in metas:
        if m["num_classes"] != c:
            raise ValueError(f"checkpoint shard has num_classes {m['num_classes']}, the loss has {c}")
    ranges = sorted((m["class_start"], m["class_end"]) for m in metas)
    covered = 0
    for s, e in ranges:
        if s != covered:
            raise ValueError(f"checkpoint shards do not cover the classes: gap or overlap at {covered}")
        covered = e
    if covered != c:
        raise ValueError(f"checkpoint shards cover classes [0, {covered}) of {c}")
    replicated = [st for st, m in zip(states, metas, strict=True) if m["replicated"]]
    if len(replicated) != 1:
        raise ValueError(f"exactly one checkpoint shard must hold the replicated state, found {len(replicated)}")

    per_class = _per_class_keys(loss)
    start, end = shard.class_start, shard.class_end
    overlapping = [
        (st, m) for st, m in zip(states, metas, strict=True) if m["class_start"] < end and m["class_end"] > start
    ]
    new_state: dict[str, Any] = {}
    for key in loss.state_dict():
        if key in per_class:
            parts = [(m["class_start"], m["class_end"], st[key]) for st, m in overlapping]
            new_state[key] = _assemble(parts, start, end)
        else:
            new_state[key] = replicated[0][key]
    loss.load_state_dict(new_state)

    optim: dict[str, dict[str, Any]] = {}
    for name, _ in loss.named_parameters():
        pieces = [(st.get(OPTIMIZER_KEY) or {}).get(name) for st, _ in overlapping]
        if not pieces or any(p is None for p in pieces):
            continue
        rebuilt: dict[str, Any] = {}
        for key, value in pieces[0].items():
            rows = [(m["class_start"], m["class_end"], p[key]) for (_, m), p in zip(overlapping, pieces, strict=True)]
            # Row-wise state (moments: first dim = the shard's classes) is resharded; the
            # rest (the step count) is the same on every rank.
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows[0][1] - rows[0][0]:
                rebuilt[key] = _assemble(rows, start, end)
            else:
                rebuilt[key] = value.clone() if isinstance(value, Tensor) else value
        optim[name] = rebuilt
    return optim
