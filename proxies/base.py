"""The base class of every proxy loss: owns the proxies, validates, calls the pure math."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .functional import SyntheticProxies
from .sharding import ShardContext

__all__ = [
    "DEFAULT_INIT_SEED",
    "HyperParameterError",
    "ProxyLoss",
    "check_int",
    "check_real",
    "default_generator",
    "fill_rows_",
    "full_precision",
]

# Without a generator the proxies are initialised from a private generator with this seed:
# the package never touches the global torch RNG (reproducibility of distributed runs).
DEFAULT_INIT_SEED = 0


def default_generator(generator: torch.Generator | None, seed: int = DEFAULT_INIT_SEED) -> torch.Generator:
    """``generator`` itself, or a fresh CPU generator seeded with ``seed``."""
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(seed)


# Rows of the proxy matrix drawn per block by fill_rows_ (about 16 MiB of float32).
_INIT_BLOCK_ELEMS = 1 << 22


def fill_rows_(
    out: Tensor,
    row_start: int,
    total_rows: int,
    fill: Callable[[Tensor, torch.Generator], object],
    generator: torch.Generator,
) -> Tensor:
    """Fill ``out`` (n, d) with rows ``[row_start, row_start + n)`` of a (total_rows, d) matrix
    that ``fill(matrix, generator)`` would have filled in one call. Returns ``out``.

    Why: a proxy shard must start with the same values as the same rows of the unsharded
    proxies (a run gives the same numbers on any number of ranks), without ever holding the
    (C, d) matrix. The whole matrix is drawn block by block (every rank consumes the
    generator exactly as one process would) and only this shard's rows are kept. Blocks hold
    a multiple of 16 elements and the last one at least 16: torch's CPU normal_ draws in
    16-element groups (and recomputes a ragged tail), uniform_ element by element, so the
    block-wise stream equals the one-call stream (tests/distributed checks it).
    """
    n, d = out.shape
    if row_start == 0 and n == total_rows:
        fill(out, generator)
        return out
    rows_per_block = max(16, (_INIT_BLOCK_ELEMS // max(d, 1)) // 16 * 16)
    buf = torch.empty(rows_per_block, d, dtype=out.dtype, device=generator.device)
    r = 0
    while r < total_rows:
        rows = min(rows_per_block, total_rows - r)
        if 0 < (total_rows - r - rows) * d < 16:
            rows = total_rows - r  # no ragged block of fewer than 16 elements at the end
        block = buf[:rows] if rows <= rows_per_block else torch.empty(rows, d, dtype=out.dtype, device=buf.device)
        fill(block, generator)
        lo, hi = max(r, row_start), min(r + rows, row_start + n)
        if lo < hi:
            out[lo - row_start : hi - row_start] = block[lo - r : hi - r]
        r += rows
    return out


def full_precision(embeddings: Tensor) -> Tensor:
    """``embeddings`` (B, d) as float32 if float16 / bfloat16, else unchanged (float32/64).

    Differentiable (the gradient flows back in the input's dtype). The loss entry points
    call it with autocast off: the whole loss, GEMMs included, then runs in float32 (or
    float64), whether or not it is called inside an autocast region. Low precision is not
    an option for these losses: exp(alpha S) with alpha = 32 overflows float16, bfloat16
    rounding of the cosines swamps the margin, and a bfloat16 GEMM in the backward gave
    gradient errors of 1e3 to 5e4 (relative) near convergence (see proxies/functional.py).
    """
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        return embeddings.float()
    return embeddings


class HyperParameterError(ValueError):
    """A hyper-parameter value a loss refuses. ``name`` is the constructor argument and the
    message starts with it ("h must be > 0, got 0.0"), so a caller that knows the argument
    under another name (the config's ``loss.h``) can prefix it.

    Each hyper-parameter's rule lives in the constructor that takes it, and only there: the
    config validates by building the loss on a toy size (``pipelines/config.py``).
    """

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name = name


def check_real(name: str, value: object, low: float = 0.0, *, strict: bool = True) -> float:
    """``value`` as a finite float, > ``low`` (``strict``) or >= ``low``; HyperParameterError
    naming ``name`` otherwise."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise HyperParameterError(name, f"must be a number, got {value!r}") from err
    if not math.isfinite(v):
        raise HyperParameterError(name, f"must be finite, got {value!r}")
    if v <= low if strict else v < low:
        raise HyperParameterError(name, f"must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return v


def check_int(name: str, value: object, low: int) -> int:
    """``value`` itself if it is an int (not a bool) >= ``low``; HyperParameterError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise HyperParameterError(name, f"must be an int >= {low}, got {value!r}")
    return value


class ProxyLoss(nn.Module):
    """A proxy loss: ``loss(embeddings (B, d), labels (B,) long) -> scalar``.

    Owns ``proxies``, an ``nn.Parameter`` of shape (num_local, embedding_dim): all
    ``num_classes`` proxies, or with a ``shard`` (:class:`~proxies.sharding.ShardContext`
    over W ranks) the contiguous class range ``[shard.class_start, shard.class_end)``.
    Sharded, every rank is called with the same (all-gathered) global batch and returns the
    loss of the global batch (see ``proxies/sharding.py``). Subclasses implement
    :meth:`loss_from`, the one override point: :meth:`forward` and Proxy Synthesis both call
    it. Stateful losses (Proxy-ISA) also override :meth:`update_state`, which :meth:`forward`
    calls in training mode after the loss has been computed from the state before the update.
    """

    proxies: nn.Parameter
    # State entries whose first dimension is the class (resharded by load_shard_states).
    per_class_state: tuple[str, ...] = ("proxies",)

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        generator: torch.Generator | None = None,
        shard: ShardContext | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if shard is None:
            shard = ShardContext(num_classes)
        elif not isinstance(shard, ShardContext) or shard.num_classes != num_classes:
            raise ValueError(f"shard must be a ShardContext over {num_classes} classes, got {shard!r}")
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.shard = shard
        self.proxies = nn.Parameter(torch.empty(shard.num_local, embedding_dim))
        self.reset_parameters(generator)

    @property
    def num_local(self) -> int:
        """Number of classes (proxy rows) held here: C, or this rank's share when sharded."""
        return self.shard.num_local

    def init_proxies_(self, fill: Callable[[Tensor, torch.Generator], object], generator: torch.Generator | None) -> None:
        """Fill the proxies with this shard's rows of what ``fill`` draws for all C proxies."""
        with torch.no_grad():
            fill_rows_(self.proxies, self.shard.class_start, self.num_classes, fill, default_generator(generator))

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Proxy-Anchor's init: Kaiming normal, fan-out (std sqrt(2 / C), C = all classes)."""
        # nn.init.kaiming_normal_(mode="fan_out") on the (C, d) matrix, written out because
        # a shard's own shape would give the wrong fan.
        std = math.sqrt(2.0) / math.sqrt(self.num_classes)
        self.init_proxies_(lambda t, g: t.normal_(0.0, std, generator=g), generator)

    # ----------------------------------------------------------------------------------
    def check_inputs(self, embeddings: Tensor, labels: Tensor) -> None:
        """Shapes, dtype and label range; ValueError with the offending value. The one check of
        a training step, with no host sync on an accelerator (the functional layer's own check
        is of shapes only)."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings must be (B, {self.embedding_dim}), got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"labels must be (B,) = ({embeddings.shape[0]},), got {tuple(labels.shape)}")
        if labels.dtype != torch.long:
            raise ValueError(f"labels must be torch.long, got {labels.dtype}")
        if labels.numel() == 0:
            raise ValueError("empty batch")
        if labels.device.type == "cpu":  # reading the range costs nothing on the host: name it
            lo, hi = torch.aminmax(labels)
            if int(lo) < 0 or int(hi) >= self.num_classes:
                raise ValueError(f"labels must lie in [0, {self.num_classes}), got min {int(lo)} max {int(hi)}")
        else:  # on an accelerator int() would stall the stream every step: the device checks it
            torch._assert_async(((labels >= 0) & (labels < self.num_classes)).all(),
                                f"labels must lie in [0, {self.num_classes})")

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """embeddings (B, d), labels (B,) long in [0, C) -> scalar loss.

        Sharded: the global batch (identical on every rank), global labels; the result is
        the loss of the global batch on every rank. Always computed in float32 (float64 if
        the embeddings or the proxies are float64), also inside an autocast region: autocast
        is turned off here and half / bfloat16 embeddings are upcast (:func:`full_precision`).
        """
        self.check_inputs(embeddings, labels)
        with torch.autocast(embeddings.device.type, enabled=False):
            embeddings = full_precision(embeddings)
            loss = self.loss_from(embeddings, self.proxies, self.shard.localize(labels))
            if self.training:
                self.update_state(embeddings, labels)
        return loss

    def loss_from(
        self,
        embeddings: Tensor,
        proxies: Tensor,
        labels: Tensor,
        synthetic: SyntheticProxies | Tensor | None = None,
    ) -> Tensor:
        """The loss of ``embeddings`` (B', d) against ``proxies`` (C_local, d) and optional
        synthetic proxies -> scalar. Implemented by every loss.

        ``labels`` (B',) are shard-local: in ``[0, C_local + n)`` (synthetic j is
        ``C_local + j``), or -1 where another shard owns the positive; with W = 1 they are
        the global labels. ``synthetic``: index-described (:class:`SyntheticProxies`, W = 1;
        ``synthetic.materialise(proxies)`` gives the explicit (C + n, d) rows) or explicit
        raw rows (n, d) of this shard (sharded Proxy Synthesis).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement loss_from")

    def update_state(self, embeddings: Tensor, labels: Tensor) -> None:
        """Per-step state update from the real samples (no-op for stateless losses)."""

    def extra_repr(self) -> str:
        text = f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}"
        if self.shard.sharded:
            text += f", shard=[{self.shard.class_start}, {self.shard.class_end}) of rank {self.shard.rank}/{self.shard.world_size}"
        return text
