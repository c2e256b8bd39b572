"""The fused engine behind the proxy losses: one autograd function per step, chunked GEMMs,
and the kernels of each loss family (``proxies/functional.py`` is the public face).

Notation (shapes): ``B`` embeddings ``x`` (B, d) of any norm, integer labels ``y`` (B,) in
``[0, C)``, proxies ``p`` (C, d). Every function normalises both sides itself and works on the
cosine matrix ``S = x̂ p̂ᵀ`` (B, C).

Design, and why:

* **One fused autograd function per step** (:class:`_ProxyLossFunction`). The step is
  bandwidth-bound around three GEMMs (``S = x̂ p̂ᵀ``, ``dx̂ = dS p̂``, ``dp̂ = dSᵀ x̂``), so the
  code avoids every B x C and C x d temporary it can: the proxies are never materialised
  normalised (the GEMM runs on the raw proxies and ``1/|p_c|`` is folded into per-column
  factors); the work runs chunk by chunk of proxies, each GEMM block followed by the
  loss' elementwise work in place while it is in cache; the backward needs no B x C pass
  besides its GEMMs (the kernels leave the gradient matrix, up to row / column factors,
  in the buffer of S, and precompute what the normalisation gradient needs, which is then
  one in-place ``addcmul_`` per chunk of the proxy gradient); the per-positive terms (B
  entries) are gathered / scattered instead of masking a full B x C matrix.
* **Per-class / per-sample terms, combined afterwards.** The fused function returns vectors
  (Proxy-Anchor / Proxy-ISA: ``Q+`` and ``Q-`` per class plus the weight normalisers; softmax
  losses: a per-sample log-sum-exp and the positive logit). The scalar loss is a tiny
  expression of those vectors, so class-sharded proxies (``proxies/sharding.py``) only have
  to combine vectors: sums for the anchor losses, a log-sum-exp over shards for the softmax
  losses (``logaddexp`` of the per-shard ``lse``).
* **Log-sum-exp with a static shift.** ``log(1 + sum exp z)`` is computed as a log-sum-exp
  with an implicit zero column. The shift is chosen from the *bound* of ``z`` (cosines lie
  in [-1, 1]): when ``exp`` of the bound cannot overflow the loss dtype the shift is 0 and
  no reduction pass is needed; otherwise the per-row / per-column maximum is used.
* **Always float32 (float64 if an input is float64), also inside autocast.** Every entry
  point (these functions, ``ProxyLoss.forward``, ``ProxySynthesis.forward``) turns autocast
  off and upcasts float16 / bfloat16 inputs, and the GEMMs run in that dtype too. Why the
  GEMMs as well: near convergence the gradient w.r.t. S of the softmax losses is
  ``softmax - onehot``, a small difference of two numbers close to 1; the dense part goes
  through the GEMM and the positive part is added exactly, so a bf16 GEMM (8-bit mantissa)
  leaves a rounding error of about 2^-8 |p| in a gradient that is orders of magnitude
  smaller (measured at C = 100, d = 128, B = 64, x near p[y]: relative gradient errors of
  1.5e3 for ProxyNCA++ and 4.7e4 for Norm-Softmax; under float16 inf / NaN, the unshifted
  ``exp(scale S)`` terms exceed its range). alpha = 32 in ``exp`` needs float32 as well.
* Gradients of the ISA weights and of the masks are zero by definition (constants).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Same epsilon as F.normalize: a zero row stays zero instead of becoming NaN.
_NORM_EPS = 1e-12
# exp(x) is finite and far from the overflow threshold (log(max) = 88.7 / 709.8) below these.
_EXP_SAFE = {torch.float32: 80.0, torch.float64: 700.0}
# Cosines can exceed 1 by rounding; the exp bounds use this slack.
_COS_BOUND = 1.05


# --------------------------------------------------------------------------------------
# dtypes and normalisation
# --------------------------------------------------------------------------------------
def loss_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the whole loss (GEMMs included) runs in: float64 if any input is float64,
    else float32.

    Half / bfloat16 inputs (an autocast network's output) are upcast: exp(alpha * S) with
    alpha = 32 overflows float16, bfloat16 rounding of the cosines would swamp the margin
    delta, and low-precision GEMMs ruin the gradients near convergence (module docstring).
    """
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def normalize_rows(x: Tensor) -> Tensor:
    """L2-normalise the rows of ``x`` (N, d) -> (N, d), in float32/float64, autocast off.

    Differentiable (plain autograd: the embedding side is only B x d).
    """
    dtype = loss_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return F.normalize(x.to(dtype), p=2.0, dim=1, eps=_NORM_EPS)


def _inv_norm(p: Tensor) -> Tensor:
    """1 / max(|p_c|, eps) for the rows of ``p`` (C, d) -> (C,)."""
    return torch.linalg.vector_norm(p, dim=1).clamp_min_(_NORM_EPS).reciprocal_()


# --------------------------------------------------------------------------------------
# Proxy Synthesis: synthetic proxies described, not materialised
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticProxies:
    """Extra proxies ``q_j = lam * p̂[first_j] + (1 - lam) * p̂[second_j]`` (n of them).

    They are appended after the C real proxies (class ids ``C + j``) and normalised by the
    loss like every proxy. Describing them by indices keeps the fused function from copying
    the C x d proxy matrix and lets it scatter their gradient into n rows only.
    """

    first: Tensor  # (n,) long, real class ids
    second: Tensor  # (n,) long, real class ids
    lam: float

    def __len__(self) -> int:
        return int(self.first.numel())

    def raw(self, proxies: Tensor, inv_norm: Tensor) -> Tensor:
        """Unnormalised synthetic proxies (n, d) from raw proxies (C, d) and their 1/|p| (C,)."""
        a = proxies[self.first] * inv_norm[self.first, None]
        b = proxies[self.second] * inv_norm[self.second, None]
        return torch.lerp(b, a, self.lam)

    def materialise(self, proxies: Tensor) -> Tensor:
        """All C + n proxies (C + n, d), differentiable; for losses without a fused path."""
        p_hat = normalize_rows(proxies)
        q = torch.lerp(p_hat[self.second], p_hat[self.first], self.lam)
        return torch.cat([p_hat, normalize_rows(q)], dim=0)


# --------------------------------------------------------------------------------------
# Proxy blocks and column chunks
# --------------------------------------------------------------------------------------
# The step is processed in chunks of proxy rows (= columns of S) of about this many
# elements of the proxy matrix (8 MiB of float32): the forward GEMM of a chunk is followed
# by the loss' elementwise work on its (B, w) block of S while it is in cache, and the
# backward GEMMs of a chunk by the normalisation gradient of its (w, d) rows of the proxy
# gradient. Every B x C and C x d matrix then crosses the memory bus about once per
# direction, and no B x C temporary is allocated. Smaller chunks fit L2 better but mean
# more (Python-level, and multi-threaded) ops per step; measured on our 2-core machines
# (L2 4 MiB, large L3), 2^20 to 2^24 elements performed the same within noise.
_CHUNK_ELEMS = 1 << 21
_MIN_CHUNK_COLS = 64
# Rows handled at once by the unfused normalisation backward of cosine_similarity.
_PROJ_ROWS = 128


def _chunk_width(d: int) -> int:
    return max(_MIN_CHUNK_COLS, _CHUNK_ELEMS // max(d, 1))


def _workspace(like: Tensor, b: int, width: int, dtype: torch.dtype | None = None) -> Tensor:
    """A (b, width) scratch buffer, allocated once per step: the kernels' per-chunk
    temporaries are views of it (an uncached allocator would page-fault a fresh one each
    chunk)."""
    return torch.empty(b, width, dtype=dtype or like.dtype, device=like.device)


class _Blocks:
    """The proxy columns of S: the real proxies and optionally the synthetic ones.

    ``mats[k]`` is a raw (unnormalised) (C_k, d) matrix; column ``c`` of S belongs to
    block 0 if ``c < C`` else to block 1 (the synthetic proxies ``q``, described by indices
    or given explicitly as ``extra`` (n, d)).
    """

    def __init__(self, proxies: Tensor, synthetic: SyntheticProxies | None, extra: Tensor | None = None) -> None:
        self.proxies = proxies
        self.synthetic = synthetic
        self.mats = [proxies]
        if synthetic is not None and len(synthetic) > 0:
            idx = torch.cat([synthetic.first, synthetic.second])
            inv_rows = torch.zeros(proxies.shape[0], dtype=proxies.dtype, device=proxies.device)
            inv_rows[idx] = _inv_norm(proxies[idx])
            self.mats.append(synthetic.raw(proxies, inv_rows))
        elif extra is not None and extra.shape[0] > 0:
            # Explicit extra columns (class-sharded Proxy Synthesis: the synthetic proxies
            # are mixed from rows fetched from other ranks, not from rows of ``proxies``).
            self.mats.append(extra)
        self.sizes = [m.shape[0] for m in self.mats]
        self.num_cols = sum(self.sizes)

    def chunks(self, d: int) -> list[tuple[int, slice, slice]]:
        """(block, rows of the block, columns of S) for every chunk, in column order."""
        step = _chunk_width(d)
        out, offset = [], 0
        for k, n in enumerate(self.sizes):
            for s in range(0, n, step):
                e = min(n, s + step)
                out.append((k, slice(s, e), slice(offset + s, offset + e)))
            offset += n
        return out

    def rows(self, cols: Tensor) -> Tensor:
        """Raw proxy rows of the given columns of S (k,) -> (k, d)."""
        if len(self.mats) == 1:
            return self.mats[0][cols]
        c0 = self.sizes[0]
        real = self.mats[0][cols.clamp(max=c0 - 1)]
        synth = self.mats[1][(cols - c0).clamp(min=0)]
        return torch.where((cols < c0).unsqueeze(1), real, synth)


def _positives_by_chunk(
    y: Tensor, chunks: list[tuple[int, slice, slice]]
) -> list[tuple[Tensor, Tensor] | None]:
    """For each chunk, the positives (i, y_i) that fall in it as (rows i, chunk-local
    columns), or None when it has none (most chunks: a batch holds few classes).

    Rows with ``y_i < 0`` (positive owned by another shard) sort before column 0 and fall
    in no chunk.
    """
    order = torch.argsort(y, stable=True)
    ys = y[order]
    starts = torch.tensor([g.start for _, _, g in chunks] + [chunks[-1][2].stop], device=y.device)
    bounds = torch.searchsorted(ys, starts).tolist()
    return [
        (order[bounds[k] : bounds[k + 1]], ys[bounds[k] : bounds[k + 1]] - g.start)
        if bounds[k + 1] > bounds[k] else None
        for k, (_, _, g) in enumerate(chunks)
    ]


def _project_(g: Tensor, mat: Tensor, inv: Tensor) -> None:
    """In place: ``g_c -= inv_c^2 <mat_c, g_c> mat_c`` for the rows of g, mat (w, d), inv (w,).

    The gradient of the normalisation ``p̂ = p / |p|``: with G = dL/dp̂ / |p| (what the GEMM
    gives once the columns of dL/dS are scaled by 1/|p|), dL/dp = G - p̂ <p̂, G>.
    """
    t = torch.linalg.vecdot(g, mat)
    g.addcmul_(mat, (t * inv * inv).unsqueeze(1), value=-1.0)


# --------------------------------------------------------------------------------------
# Cosine similarity (the normalise-then-cosine helper for losses without a fused path)
# --------------------------------------------------------------------------------------
class _CosineFunction(torch.autograd.Function):
    """S = x̂ (p / |p|)ᵀ with the proxy normalisation folded into the GEMM's scaling."""

    @staticmethod
    def forward(ctx, x_hat: Tensor, proxies: Tensor) -> Tensor:  # type: ignore[override]
        inv = _inv_norm(proxies)
        s = (x_hat @ proxies.t()).mul_(inv)
        ctx.save_for_backward(x_hat, proxies, inv)
        return s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_s: Tensor):  # type: ignore[override]
        x_hat, proxies, inv = ctx.saved_tensors
        # backward() may be called inside an autocast region: keep the GEMMs in x_hat's dtype.
        with torch.autocast(x_hat.device.type, enabled=False):
            d = grad_s.to(x_hat.dtype) * inv  # column-scaled: D_ic = dS_ic / |p_c|
            dx = d @ proxies
            g = d.t() @ x_hat
            for start in range(0, g.shape[0], _PROJ_ROWS):
                sl = slice(start, start + _PROJ_ROWS)
                _project_(g[sl], proxies[sl], inv[sl])
        return dx, g


def cosine_similarity(embeddings: Tensor, proxies: Tensor) -> Tensor:
    """Cosine matrix between embeddings (B, d) and proxies (C, d) -> (B, C), float32/64.

    Differentiable in both. The embeddings are normalised with autograd; the proxy
    normalisation is folded into the GEMM (its gradient costs one pass over C x d). Runs in
    :func:`loss_dtype` with autocast off, GEMM included, also when called inside an
    autocast region. This is the building block for losses without a fused path of their own.
    """
    compute = loss_dtype(embeddings, proxies)
    x_hat = normalize_rows(embeddings)
    with torch.autocast(embeddings.device.type, enabled=False):
        return _CosineFunction.apply(x_hat, proxies.to(compute))


# --------------------------------------------------------------------------------------
# Segment log(1 + sum exp) over the positives (B entries grouped by label)
# --------------------------------------------------------------------------------------
def _segment_log1p_sum_exp(z: Tensor, index: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """``out[c] = log(1 + sum_{i: index_i = c} exp(z_i))`` and ``pi_i = d out[index_i] / d z_i``.

    z (N,), index (N,) long -> out (num_segments,), pi (N,). The implicit zero column is
    the ``1``: the per-segment shift includes it, so empty segments give exactly 0.
    """
    m = z.new_zeros(num_segments).scatter_reduce_(0, index, z, reduce="amax", include_self=True)
    e = torch.exp(z - m[index])
    s = torch.exp(-m).index_add_(0, index, e)
    out = m + torch.log(s)
    return out, e / s[index]


@dataclass(frozen=True)
class ISAClassParams:
    """Per-class constants of Proxy-ISA for the C' columns (real classes, then synthetic).

    All (C',): ``sigma`` (decay), ``neg_scale`` = 1 / max(1, E_c), ``s_out`` (outlier
    boundary, +inf = no interval), ``s_learned``. ``filter_on`` switches the positive weights.
    """

    sigma: Tensor
    neg_scale: Tensor
    s_out: Tensor
    s_learned: Tensor
    filter_on: bool

    def to(self, dtype: torch.dtype) -> ISAClassParams:
        return ISAClassParams(
            self.sigma.to(dtype), self.neg_scale.to(dtype), self.s_out.to(dtype),
            self.s_learned.to(dtype), self.filter_on,
        )

    def padded(self, extra: int) -> ISAClassParams:
        """Append ``extra`` neutral classes (synthetic proxies: all weights 1, no state)."""
        if extra == 0:
            return self
        one = self.sigma.new_ones(extra)
        inf = self.sigma.new_full((extra,), math.inf)
        return ISAClassParams(
            torch.cat([self.sigma, one]), torch.cat([self.neg_scale, one]),
            torch.cat([self.s_out, inf]), torch.cat([self.s_learned, one]), self.filter_on,
        )


# --------------------------------------------------------------------------------------
# Kernels: the B x C part of each loss, forward (chunk by chunk) and backward by hand
# --------------------------------------------------------------------------------------
class _Grad:
    """The gradient w.r.t. S of one step, in factored form.

    ``dL/dS_ic / |p_c| = rho_i * M_ic * col_c + [c = y_i] vals_i``: the dense matrix ``M``
    (B, C') the kernel left behind, a row factor ``rho`` ((B,), a float, or None = 1,
    applied on the B x d side), a column factor ``col`` ((C',) or None = 1, applied to each
    chunk in cache) and the positives' entries ``vals`` (B,). The proxy normalisation
    needs ``t_c = sum_i (dL/dS_ic / |p_c|) S_raw_ic``: ``t`` (C',) is its dense part when
    the kernel could precompute it (``raw_pos`` = S_raw at the positives gives the rest),
    None = compute it from the proxy gradient (a row dot product per proxy).
    """

    def __init__(
        self, m: Tensor, rho: Tensor | float | None, col: Tensor | None, vals: Tensor,
        t: Tensor | None = None, raw_pos: Tensor | None = None,
    ) -> None:
        self.m, self.rho, self.col, self.vals, self.t, self.raw_pos = m, rho, col, vals, t, raw_pos


def _uniform_value(g: Tensor) -> float | None:
    """The common value of ``g`` (C,) if all its entries are equal (the usual case: the
    gradient of a plain sum, an expanded scalar), else None."""
    if g.numel() == 0:
        return 0.0
    if g.stride(0) == 0 or torch.equal(g, g[:1].expand_as(g)):
        return float(g[0])
    return None


class SoftmaxKernel:
    """Row log-sum-exp of ``z = scale * S`` (optionally without the positive column).

    Outputs: ``lse`` (B,) and ``pos`` = ``scale * S_{i, y_i}`` (B,). Pass 1 (fused with the
    GEMM) accumulates the row sums; pass 2 (only when a gradient is needed) overwrites S
    with ``M_ic = exp(z_ic - shift_i) / |p_c|`` and computes ``u_c = sum_i e_ic z_ic / s_i``,
    so that the backward needs no B x C or C x d pass besides its GEMMs.
    """

    differentiable = (True, True)

    def __init__(self, scale: float, exclude_positive: bool) -> None:
        self.scale = scale
        self.exclude_positive = exclude_positive

    def begin(self, s_raw: Tensor, y: Tensor, need_grad: bool, width: int) -> bool:
        """Set up; returns True when the whole S must exist before the chunks (row shift)."""
        b, c = s_raw.shape
        self.need_grad = need_grad
        self.work_z = _workspace(s_raw, b, width)
        self.work_e = _workspace(s_raw, b, width) if need_grad else None
        # Zero, not empty: a row whose positive lives on another shard (label -1) keeps 0.
        self.pos = s_raw.new_zeros(b)
        self.s = s_raw.new_zeros(b)
        # |z| <= bound: if exp(bound) and the sum of C of them cannot overflow, shift 0
        # and the GEMM and this kernel run fused chunk by chunk.
        self.safe = self.scale * _COS_BOUND + math.log(c) <= _EXP_SAFE[s_raw.dtype]
        self.shift = None
        return not self.safe

    def _logits(self, blk: Tensor, inv: Tensor, pk: tuple[Tensor, Tensor] | None) -> Tensor:
        """z = scale S for one chunk (in the workspace), the positive column at -inf if excluded."""
        z = torch.mul(blk, inv * self.scale, out=self.work_z[:, : blk.shape[1]])
        if pk is not None and self.exclude_positive:
            z[pk] = -math.inf
        return z

    def prepare(self, s_raw: Tensor, inv: Tensor, chunks, positives) -> None:
        """Extreme temperatures: the row maxima of z over the whole (already computed) S."""
        shift = s_raw.new_full((s_raw.shape[0],), -math.inf)
        for (_, _, gs), pk in zip(chunks, positives):
            torch.maximum(shift, self._logits(s_raw[:, gs], inv[gs], pk).amax(dim=1), out=shift)
        # A row can have no column at all in a shard (classic ProxyNCA: the shard's only
        # class is its positive): shift 0 there instead of -inf - -inf = nan.
        self.shift = torch.nan_to_num_(shift, neginf=0.0).unsqueeze(1)

    def chunk(self, blk: Tensor, inv: Tensor, pk: tuple[Tensor, Tensor] | None, gs: slice) -> None:
        z = self._logits(blk, inv, pk)
        if pk is not None:
            self.pos[pk[0]] = blk[pk] * inv[pk[1]] * self.scale
        if self.shift is not None:
            z.sub_(self.shift)
        self.s.add_(z.exp_().sum(dim=1))

    def finish(self, s_raw: Tensor, y: Tensor, inv: Tensor, chunks, positives):
        lse = torch.log(self.s)
        if self.shift is not None:
            lse = lse + self.shift.squeeze(1)
        if not self.need_grad:
            return (lse, self.pos), None
        b = s_raw.shape[0]
        raw_pos = s_raw[torch.arange(b, device=y.device), y.clamp(min=0)]
        u = s_raw.new_empty(s_raw.shape[1])
        # s = 0 only for a row with no column in this shard (see prepare): its terms are 0.
        inv_s = torch.where(self.s > 0, self.s.reciprocal(), 0.0)
        for (_, _, gs), pk in zip(chunks, positives):
            blk = s_raw[:, gs]
            z = self._logits(blk, inv[gs], pk)
            e = self.work_e[:, : blk.shape[1]]
            if self.shift is None:
                torch.exp(z, out=e)
            else:
                torch.sub(z, self.shift, out=e).exp_()
            if pk is not None and self.exclude_positive:
                z[pk] = 0.0  # e = 0 there: 0 instead of 0 * -inf
            torch.mv(z.mul_(e).t(), inv_s, out=u[gs])
            torch.mul(e, inv[gs], out=blk)
        return (lse, self.pos), (s_raw, self.s, y, u, raw_pos)

    def backward(self, state, grads: Sequence[Tensor], inv: Tensor) -> _Grad:
        m, s, y, u, raw_pos = state
        g_lse, g_pos = grads
        rho = torch.where(s > 0, g_lse * self.scale / s, 0.0)
        # Rows whose positive is on another shard (label -1) have no positive entry here.
        vals = torch.where(y >= 0, g_pos * self.scale * inv[y.clamp(min=0)], 0.0)
        common = _uniform_value(g_lse)
        # sum_i rho_i M_ic S_raw_ic = sum_i g_i e_ic z_ic / s_i = g u_c for a uniform g.
        t = None if common is None else u * common
        return _Grad(m, rho, None, vals, t, raw_pos)


class AnchorKernel:
    """Per-class Proxy-Anchor (Proxy-ISA when ``isa`` is given) terms.

    Outputs (C',) each: ``q_pos``, ``q_neg`` (differentiable), ``w_pos``, ``w_neg`` (mean
    weight over the positives / negatives of each class: 1 for Proxy-Anchor), ``n_pos``
    (number of positives of each class in the batch), ``n_neg``. Works in place on S,
    which ends up holding ``M_ic = dQ-_c/dS_ic / |p_c|``.
    """

    differentiable = (True, True, False, False, False, False)

    def __init__(self, alpha: float, delta: float, isa: ISAClassParams | None) -> None:
        self.alpha = alpha
        self.delta = delta
        self.isa = isa

    def begin(self, s_raw: Tensor, y: Tensor, need_grad: bool, width: int) -> bool:
        b, c = s_raw.shape
        self.need_grad = need_grad
        self.work_raw = _workspace(s_raw, b, width) if need_grad else None
        if self.isa is not None:
            self.work_f = _workspace(s_raw, b, width)
            self.work_mask = _workspace(s_raw, b, width, torch.bool)
        # Zero, not empty: rows whose positive is on another shard (label -1) keep 0.
        self.s_pos = s_raw.new_zeros(b)
        self.raw_pos = s_raw.new_zeros(b)
        self.q_neg = s_raw.new_empty(c)
        self.u = s_raw.new_empty(c) if need_grad else None
        self.w_neg_sum = s_raw.new_empty(c) if self.isa is not None else None
        # z <= bound (w- <= 1): if exp(bound) and a sum of B of them cannot overflow, shift 0
        # and the implicit zero column is the 1; otherwise the column maximum (per chunk).
        bound = self.alpha * (_COS_BOUND + abs(self.delta))
        self.safe = bound + math.log(max(b, 1)) <= _EXP_SAFE[s_raw.dtype]
        if self.isa is not None:
            self.f_high = s_raw.new_tensor(self.alpha)
        return False

    def chunk(self, blk: Tensor, inv: Tensor, pk: tuple[Tensor, Tensor] | None, gs: slice) -> None:
        alpha, delta, isa = self.alpha, self.delta, self.isa
        if pk is not None:
            pr, pc = pk
            # Positives: B entries, gathered (never a masked B x C matrix).
            self.raw_pos[pr] = blk[pr, pc]
            self.s_pos[pr] = self.raw_pos[pr] * inv[pc]
        w = blk.shape[1]
        raw = self.work_raw[:, :w].copy_(blk) if self.need_grad else None  # in cache, for u below
        # Negatives: z_ic = alpha w-_ic (S_ic + delta), positives masked to -inf.
        if isa is not None:
            # w-_ic = 1/max(1, E_c) below the outlier boundary; compare on the raw cosines
            # (S_ic < s_out_c  <=>  S_raw_ic < s_out_c |p_c|).
            below = torch.lt(blk, isa.s_out[gs] / inv, out=self.work_mask[:, :w])
            f = torch.where(below, isa.neg_scale[gs] * alpha, self.f_high, out=self.work_f[:, :w])
            # mean of w- over the negatives: column sum minus the positives
            w_sum = f.sum(dim=0)
            if pk is not None:
                w_sum.index_add_(0, pc, -f[pr, pc])
            self.w_neg_sum[gs] = w_sum.div_(alpha)
            blk.mul_(inv).add_(delta).mul_(f)
        else:
            blk.mul_(inv * alpha).add_(alpha * delta)
        if pk is not None:
            blk[pr, pc] = -math.inf
        if self.safe:
            s = blk.exp_().sum(dim=0).add_(1.0)
            self.q_neg[gs] = torch.log(s)
        else:
            m = blk.amax(dim=0).clamp_min_(0.0)
            s = blk.sub_(m).exp_().sum(dim=0).add_(torch.exp(-m))
            self.q_neg[gs] = m + torch.log(s)
        if self.need_grad:
            # dQ-_c/dS_ic = alpha w-_ic e_ic / s_c (alpha is inside f); stored / |p_c|.
            if isa is not None:
                blk.mul_(f).mul_(inv / s)
            else:
                blk.mul_(inv * (alpha / s))
            # u_c = sum_i M_ic S_raw_ic: the normalisation gradient needs no C x d dot.
            torch.sum(raw.mul_(blk), dim=0, out=self.u[gs])

    def finish(self, s_raw: Tensor, y: Tensor, inv: Tensor, chunks, positives):
        b, c = s_raw.shape
        alpha, delta, isa = self.alpha, self.delta, self.isa
        # Rows whose positive is on another shard (label -1) go to a dummy segment c, dropped.
        own = y >= 0
        seg = torch.where(own, y, c)
        yc = y.clamp(min=0)
        n_pos = torch.bincount(seg, minlength=c + 1)[:c].to(s_raw.dtype)
        n_neg = b - n_pos
        s_pos = self.s_pos
        if isa is not None and isa.filter_on:
            inside = (s_pos >= isa.s_out[yc]) & (s_pos <= isa.s_learned[yc])
            w_p = isa.sigma[yc] + inside.to(s_pos.dtype)
        else:
            w_p = torch.ones_like(s_pos)
        q_pos, pi = _segment_log1p_sum_exp(alpha * w_p * (delta - s_pos), seg, c + 1)
        q_pos = q_pos[:c]
        w_pos_sum = s_pos.new_zeros(c + 1).index_add_(0, seg, w_p)[:c]
        w_pos = torch.where(n_pos > 0, w_pos_sum / n_pos.clamp_min(1.0), torch.zeros_like(n_pos))
        if isa is not None:
            w_neg = torch.where(n_neg > 0, self.w_neg_sum / n_neg.clamp_min(1.0), torch.zeros_like(n_neg))
        else:
            w_neg = (n_neg > 0).to(s_raw.dtype)
        pos_scale = torch.where(own, pi * (-alpha) * w_p * inv[yc], 0.0)
        state = (s_raw, yc, pos_scale, self.u, self.raw_pos) if self.need_grad else None
        return (q_pos, self.q_neg, w_pos, w_neg, n_pos, n_neg), state

    def backward(self, state, grads: Sequence[Tensor], inv: Tensor) -> _Grad:
        m, y, pos_scale, u, raw_pos = state
        g_pos, g_neg = grads[0], grads[1]
        vals = pos_scale * g_pos[y]
        t = u * g_neg
        common = _uniform_value(g_neg)
        if common is not None:
            # The usual case (the loss sums Q-): a scalar, applied on the B x d side.
            return _Grad(m, common, None, vals, t, raw_pos)
        return _Grad(m, None, g_neg, vals, t, raw_pos)


# --------------------------------------------------------------------------------------
# The fused function
# --------------------------------------------------------------------------------------
class _ProxyLossFunction(torch.autograd.Function):
    """(x̂ (B, d), proxies (C, d)) -> kernel outputs, with a hand-written backward.

    Forward, chunk by chunk of proxy rows: 1/|p| of the chunk, the GEMM block
    ``S_raw[:, chunk] = x̂ p_chunkᵀ``, and the kernel's elementwise work on that block in
    place while it is in cache. Backward, chunk by chunk: ``dx̂ += D_chunk p_chunk``,
    ``G_chunk = D_chunkᵀ x̂`` and the normalisation gradient on G_chunk in cache.
    Synthetic proxies send their gradient back to the n real rows they mix. Every input is
    in one dtype (float32 or float64, see :func:`_fused`) and so is every GEMM.
    """

    @staticmethod
    def forward(ctx, x_hat, proxies, labels, kernel, synthetic, extra):  # type: ignore[override]
        blocks = _Blocks(proxies, synthetic, extra)
        b, d = x_hat.shape
        chunks = blocks.chunks(d)
        positives = _positives_by_chunk(labels, chunks)
        need_grad = any(ctx.needs_input_grad[:2])
        s_raw = x_hat.new_empty(b, blocks.num_cols)
        inv = x_hat.new_empty(blocks.num_cols)
        two_pass = kernel.begin(s_raw, labels, need_grad, _chunk_width(d))

        def gemm(k: int, ls: slice, gs: slice) -> None:
            mat = blocks.mats[k][ls]
            inv_k = inv[gs]
            torch.linalg.vector_norm(mat, dim=1, out=inv_k).clamp_min_(_NORM_EPS).reciprocal_()
            torch.mm(x_hat, mat.t(), out=s_raw[:, gs])

        if two_pass:
            for k, ls, gs in chunks:
                gemm(k, ls, gs)
            kernel.prepare(s_raw, inv, chunks, positives)
        for (k, ls, gs), pk in zip(chunks, positives):
            if not two_pass:
                gemm(k, ls, gs)
            kernel.chunk(s_raw[:, gs], inv[gs], pk, gs)
        outputs, state = kernel.finish(s_raw, labels, inv, chunks, positives)
        ctx.kernel, ctx.state, ctx.blocks = kernel, state, blocks
        ctx.chunks, ctx.positives, ctx.inv = chunks, positives, inv
        ctx.extra_shape = None if extra is None else extra.shape
        ctx.save_for_backward(x_hat, proxies, labels)
        for out, diff in zip(outputs, kernel.differentiable):
            if not diff:
                ctx.mark_non_differentiable(out)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        x_hat = ctx.saved_tensors[0]
        # backward() may be called inside an autocast region: keep the GEMMs in x_hat's dtype.
        with torch.autocast(x_hat.device.type, enabled=False):
            return _ProxyLossFunction._backward_impl(ctx, grads)

    @staticmethod
    def _backward_impl(ctx, grads: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        x_hat, proxies, labels = ctx.saved_tensors
        blocks: _Blocks = ctx.blocks
        inv = ctx.inv
        dtype = x_hat.dtype
        gr: _Grad = ctx.kernel.backward(ctx.state, grads, inv)
        rho = gr.rho.unsqueeze(1) if isinstance(gr.rho, Tensor) else gr.rho
        # D = diag(rho) M diag(col) + positives. rho goes on the B x d side:
        # D P = rho (M' P) and Dᵀ x̂ = M'ᵀ (rho x̂), M' = M diag(col).
        x_side = x_hat if rho is None else x_hat * rho
        dx = torch.zeros_like(x_hat)
        grads_p = [torch.empty(n, x_hat.shape[1], dtype=dtype, device=x_hat.device) for n in blocks.sizes]
        sparse_g = gr.vals.unsqueeze(1) * x_hat
        inv2 = inv * inv
        coef = None
        # Labels -1 (positive on another shard) have vals 0: any valid row will do for them.
        labels = labels.clamp(min=0)
        if gr.t is not None:
            # t_c = sum_i (dL/dS_ic / |p_c|) S_raw_ic; the positives add vals_i S_raw_{i,y_i}.
            coef = gr.t.index_add(0, labels, gr.vals * gr.raw_pos).mul_(inv2)
        for (k, ls, gs), pk in zip(ctx.chunks, ctx.positives):
            m = gr.m[:, gs]
            if gr.col is not None:
                m = m * gr.col[gs]  # a (B, w) temporary, in cache
            mat = blocks.mats[k][ls]
            g = grads_p[k][ls]
            dx.addmm_(m, mat)
            torch.mm(m.t(), x_side, out=g)
            if pk is not None:
                g.index_add_(0, pk[1], sparse_g[pk[0]])
            # the normalisation gradient: g_c -= t_c / |p_c|^2 p_c, in cache
            if coef is None:
                g.addcmul_(mat, torch.linalg.vecdot(g, mat).mul_(inv2[gs]).unsqueeze(1), value=-1.0)
            else:
                g.addcmul_(mat, coef[gs].unsqueeze(1), value=-1.0)
        if rho is not None:
            dx.mul_(rho)
        # positives: dx_i += vals_i p_{y_i}
        dx.addcmul_(gr.vals.unsqueeze(1), blocks.rows(labels))
        g_p = grads_p[0]
        g_extra = None
        if ctx.extra_shape is not None:
            # Explicit extra columns: their gradient goes back through autograd (always a
            # tensor, also when empty, so that a collective upstream runs on every rank).
            g_extra = grads_p[1] if len(grads_p) > 1 else x_hat.new_zeros(ctx.extra_shape)
        elif len(grads_p) > 1:
            _synthetic_backward(blocks, grads_p[1], g_p, inv[: blocks.sizes[0]])
        return dx, g_p, None, None, None, g_extra


def _synthetic_backward(blocks: _Blocks, g_q: Tensor, g_p: Tensor, inv_p: Tensor) -> None:
    """Send the gradient of the raw synthetic proxies (n, d) back to the proxies (in g_p)."""
    syn = blocks.synthetic
    assert syn is not None
    p = blocks.proxies
    for idx, w in ((syn.first, syn.lam), (syn.second, 1.0 - syn.lam)):
        p_hat = p[idx] * inv_p[idx, None]
        gh = g_q * w  # d/d p̂_idx
        # Through p̂ = p / |p|: dp = (dp̂ - p̂ <p̂, dp̂>) / |p|.
        gp = (gh - p_hat * (p_hat * gh).sum(1, keepdim=True)) * inv_p[idx, None]
        g_p.index_add_(0, idx, gp)


def run_fused(
    kernel, embeddings: Tensor, proxies: Tensor, labels: Tensor, synthetic: SyntheticProxies | Tensor | None
) -> tuple[Tensor, ...]:
    """Normalise the embeddings (autograd), run the fused function, return kernel outputs.

    Everything, GEMMs included, runs in :func:`loss_dtype` (float32, or float64 if an input
    is float64) with autocast off, also when called inside an autocast region.
    """
    compute = loss_dtype(embeddings, proxies)
    x_hat = normalize_rows(embeddings)
    with torch.autocast(embeddings.device.type, enabled=False):
        extra = synthetic.to(compute) if isinstance(synthetic, Tensor) else None
        described = None if isinstance(synthetic, Tensor) else synthetic
        return _ProxyLossFunction.apply(x_hat, proxies.to(compute), labels, kernel, described, extra)


def check_shapes(
    embeddings: Tensor, proxies: Tensor, labels: Tensor, synthetic: SyntheticProxies | Tensor | None
) -> int:
    """Validate shapes; returns the number of columns C' = C + n_synthetic."""
    if embeddings.dim() != 2 or proxies.dim() != 2 or embeddings.shape[1] != proxies.shape[1]:
        raise ValueError(
            f"embeddings (B, d) and proxies (C, d) expected, got {tuple(embeddings.shape)} "
            f"and {tuple(proxies.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(f"labels (B,) expected for B={embeddings.shape[0]}, got {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be torch.long, got {labels.dtype}")
    if embeddings.shape[0] == 0:
        raise ValueError("empty batch")
    if isinstance(synthetic, Tensor) and (synthetic.dim() != 2 or synthetic.shape[1] != proxies.shape[1]):
        raise ValueError(f"extra proxies must be (n, {proxies.shape[1]}), got {tuple(synthetic.shape)}")
    return proxies.shape[0] + (len(synthetic) if synthetic is not None else 0)
