"""Proxy-based deep metric learning losses (torch only).

Every loss is an ``nn.Module`` called as ``loss(embeddings (B, d), labels (B,) long) -> scalar``
and owns its proxies as ``loss.proxies`` (C, d), or with a ``shard``
(:class:`~proxies.sharding.ShardContext`) this rank's contiguous class range of them.
The math is in :mod:`proxies.functional`, the class sharding in :mod:`proxies.sharding`.
"""

from .base import HyperParameterError, ProxyLoss
from .functional import (
    AnchorTerms,
    ISAClassParams,
    SoftmaxTerms,
    SyntheticProxies,
    anchor_terms,
    combine_anchor_terms,
    cosine_similarity,
    isa_class_params,
    norm_softmax_loss,
    proxy_anchor_loss,
    proxy_isa_loss,
    proxy_nca_loss,
    softmax_loss_from_terms,
    softmax_terms,
)
from .memory import MemoryQueue
from .norm_softmax import NormSoftmaxLoss
from .proxy_anchor import ProxyAnchorLoss
from .proxy_isa import ProxyISALoss, effective_number
from .proxy_nca import ClassicProxyNCALoss, ProxyNCALoss, ProxyNCAPlusPlusLoss
from .registry import LOSSES, build_loss, loss_parameters
from .sharding import ShardContext, load_shard_states, shard_state_dict, split_range
from .softmax import SoftmaxProxyLoss
from .synthesis import ProxySynthesis, adjacent_distinct_order, sample_beta

__all__ = [
    "LOSSES",
    "AnchorTerms",
    "ClassicProxyNCALoss",
    "HyperParameterError",
    "ISAClassParams",
    "MemoryQueue",
    "NormSoftmaxLoss",
    "ProxyAnchorLoss",
    "ProxyISALoss",
    "ProxyLoss",
    "ProxyNCALoss",
    "ProxyNCAPlusPlusLoss",
    "ProxySynthesis",
    "ShardContext",
    "SoftmaxProxyLoss",
    "SoftmaxTerms",
    "SyntheticProxies",
    "adjacent_distinct_order",
    "anchor_terms",
    "build_loss",
    "combine_anchor_terms",
    "cosine_similarity",
    "effective_number",
    "isa_class_params",
    "load_shard_states",
    "loss_parameters",
    "norm_softmax_loss",
    "proxy_anchor_loss",
    "proxy_isa_loss",
    "proxy_nca_loss",
    "sample_beta",
    "shard_state_dict",
    "softmax_loss_from_terms",
    "softmax_terms",
    "split_range",
]
