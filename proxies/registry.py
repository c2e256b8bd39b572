"""Losses by name, their hyper-parameters, and building one from a config mapping.

Adding a loss: one file with a :class:`~proxies.base.ProxyLoss` subclass (its hyper-parameters
are constructor arguments, each with its default and its check), one line in LOSSES, and one
``LossConfig`` field per new hyper-parameter (tests/pipelines/test_config.py checks that).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import HyperParameterError
from .norm_softmax import NormSoftmaxLoss
from .proxy_anchor import ProxyAnchorLoss
from .proxy_isa import ProxyISALoss
from .proxy_nca import ClassicProxyNCALoss, ProxyNCAPlusPlusLoss
from .sharding import ShardContext
from .synthesis import ProxySynthesis

__all__ = ["LOSSES", "SYNTHESIS_KEYS", "build_loss", "loss_parameters"]

LOSSES: dict[str, type] = {
    "norm_softmax": NormSoftmaxLoss,
    "proxy_nca": ClassicProxyNCALoss,
    "proxy_nca_pp": ProxyNCAPlusPlusLoss,
    "proxy_anchor": ProxyAnchorLoss,
    "proxy_isa": ProxyISALoss,
}

# Constructor arguments that are not hyper-parameters.
_NOT_HYPER = {"self", "num_classes", "embedding_dim", "generator", "shard"}
SYNTHESIS_KEYS = ("enabled", "alpha", "mu")


def _loss_class(name: str) -> type:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


def loss_parameters(name: str) -> dict[str, Any]:
    """The hyper-parameters of loss ``name`` and their defaults (from its constructor)."""
    sig = inspect.signature(_loss_class(name).__init__)
    return {
        p.name: p.default
        for p in sig.parameters.values()
        if p.name not in _NOT_HYPER and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def build_loss(
    config: Mapping[str, Any],
    num_classes: int,
    embedding_dim: int,
    generator: torch.Generator | None = None,
    shard: ShardContext | None = None,
) -> nn.Module:
    """Build the loss a config describes.

    ``config``: ``name`` (a key of LOSSES), that loss' hyper-parameters (None = default),
    optionally ``synthesis``: ``{"enabled": bool, "alpha": float, "mu": float}``. A non-None
    key the loss does not take, or a value it refuses, raises :class:`HyperParameterError`
    naming the key. ``generator`` initialises the proxies and seeds Proxy Synthesis' own
    generator. ``shard``: build only this rank's shard of the ``num_classes`` proxies (see
    ``proxies/sharding.py``); every rank must pass a generator in the same state (the proxies
    of a shard are the same rows of the unsharded init, and Proxy Synthesis draws the same
    lambdas on every rank).
    """
    if "name" not in config or config["name"] is None:
        raise ValueError("loss config needs a 'name'")
    name = config["name"]
    allowed = loss_parameters(name)
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key in ("name", "synthesis") or value is None:
            continue
        if key not in allowed:
            raise HyperParameterError(
                key, f"is not a hyper-parameter of loss {name!r}; it takes: {', '.join(allowed) or 'none'}"
            )
        kwargs[key] = value
    loss = _loss_class(name)(num_classes, embedding_dim, generator=generator, shard=shard, **kwargs)

    syn = config.get("synthesis")
    if syn is None:
        return loss
    if not isinstance(syn, Mapping):
        raise ValueError(f"synthesis must be a mapping with keys {SYNTHESIS_KEYS}, got {syn!r}")
    unknown = [k for k, v in syn.items() if k not in SYNTHESIS_KEYS and v is not None]
    if unknown:
        raise ValueError(f"synthesis has no key {unknown[0]!r}; it takes: {', '.join(SYNTHESIS_KEYS)}")
    if not syn.get("enabled"):
        return loss
    ps_kwargs = {k: syn[k] for k in ("alpha", "mu") if syn.get(k) is not None}
    ps_gen = None
    if generator is not None:
        # A generator of its own, seeded from the given one: lambdas do not depend on how
        # many numbers the proxy init consumed from a shared stream.
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        ps_gen = torch.Generator().manual_seed(seed)
    return ProxySynthesis(loss, generator=ps_gen, **ps_kwargs)
