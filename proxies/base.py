"""The base class of every proxy loss: owns the proxies, validates, calls the pure math."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .functional import SyntheticProxies

__all__ = ["DEFAULT_INIT_SEED", "ProxyLoss", "check_positive", "default_generator"]

# Without a generator the proxies are initialised from a private generator with this seed:
# the package never touches the global torch RNG (reproducibility of distributed runs).
DEFAULT_INIT_SEED = 0


def default_generator(generator: torch.Generator | None, seed: int = DEFAULT_INIT_SEED) -> torch.Generator:
    """``generator`` itself, or a fresh CPU generator seeded with ``seed``."""
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(seed)


def check_positive(name: str, value: float, *, strict: bool = True) -> float:
    """``value`` as a finite float, > 0 (``strict``) or >= 0; ValueError naming ``name`` otherwise."""
    try:
        v = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a number, got {value!r}") from err
    if not math.isfinite(v) or (v <= 0 if strict else v < 0):
        raise ValueError(f"{name} must be {'> 0' if strict else '>= 0'} and finite, got {value!r}")
    return v


class ProxyLoss(nn.Module):
    """A proxy loss: ``loss(embeddings (B, d), labels (B,) long) -> scalar``.

    Owns ``proxies``, an ``nn.Parameter`` of shape (num_classes, embedding_dim). Subclasses
    implement :meth:`compute` (a pure function of tensors); the fast built-in losses override
    :meth:`loss_from` to handle Proxy Synthesis' extra proxies without materialising them.
    Stateful losses (Proxy-ISA) override :meth:`update_state`, which :meth:`forward` calls
    in training mode after the loss has been computed from the state before the update.
    """

    proxies: nn.Parameter

    def __init__(self, num_classes: int, embedding_dim: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_dim))
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Proxy-Anchor's init: Kaiming normal, fan-out (std sqrt(2 / C))."""
        with torch.no_grad():
            nn.init.kaiming_normal_(self.proxies, mode="fan_out", generator=default_generator(generator))

    # ----------------------------------------------------------------------------------
    def check_inputs(self, embeddings: Tensor, labels: Tensor) -> None:
        """Shapes, dtype and label range; ValueError with the offending value."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings must be (B, {self.embedding_dim}), got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"labels must be (B,) = ({embeddings.shape[0]},), got {tuple(labels.shape)}")
        if labels.dtype != torch.long:
            raise ValueError(f"labels must be torch.long, got {labels.dtype}")
        if labels.numel() == 0:
            raise ValueError("empty batch")
        lo, hi = torch.aminmax(labels)
        if int(lo) < 0 or int(hi) >= self.num_classes:
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got min {int(lo)} max {int(hi)}")

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """embeddings (B, d), labels (B,) long -> scalar loss."""
        self.check_inputs(embeddings, labels)
        loss = self.loss_from(embeddings, self.proxies, labels)
        if self.training:
            self.update_state(embeddings, labels)
        return loss

    def loss_from(
        self, embeddings: Tensor, proxies: Tensor, labels: Tensor, synthetic: SyntheticProxies | None = None
    ) -> Tensor:
        """The loss for given proxies (C, d) and optional synthetic proxies (labels C + j)."""
        if synthetic is not None:
            proxies = synthetic.materialise(proxies)
        return self.compute(embeddings, proxies, labels)

    def compute(self, embeddings: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        """embeddings (B, d), proxies (C', d), labels (B,) in [0, C') -> scalar. Pure."""
        raise NotImplementedError

    def update_state(self, embeddings: Tensor, labels: Tensor) -> None:
        """Per-step state update from the real samples (no-op for stateless losses)."""

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}"
