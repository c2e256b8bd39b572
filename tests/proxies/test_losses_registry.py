"""The registry: names, hyper-parameters, build_loss validation."""

from __future__ import annotations

import math

import pytest
import torch

from proxies import (
    LOSSES,
    ClassicProxyNCALoss,
    HyperParameterError,
    NormSoftmaxLoss,
    ProxyISALoss,
    ProxyLoss,
    ProxyNCAPlusPlusLoss,
    ProxySynthesis,
    build_loss,
    loss_parameters,
)


def test_names():
    assert set(LOSSES) == {"norm_softmax", "proxy_nca", "proxy_nca_pp", "proxy_anchor", "proxy_isa"}
    assert build_loss({"name": "proxy_nca"}, 3, 2).assignment_probability is False
    assert build_loss({"name": "proxy_nca_pp"}, 3, 2).assignment_probability is True
    assert isinstance(build_loss({"name": "proxy_nca"}, 3, 2), ClassicProxyNCALoss)
    assert isinstance(build_loss({"name": "proxy_nca_pp"}, 3, 2), ProxyNCAPlusPlusLoss)


def test_loss_parameters():
    assert loss_parameters("norm_softmax") == {"temperature": pytest.approx(1 / 23)}
    assert loss_parameters("proxy_anchor") == {"alpha": 32.0, "delta": 0.1}
    assert loss_parameters("proxy_isa") == {
        "alpha": 32.0, "delta": 0.1, "V": 100.0, "k": 0.9, "lam": 0.1, "h": 0.15, "tau": 1.5,
        "memory_size": 55000,
    }
    assert set(loss_parameters("proxy_nca")) == {"temperature"}
    with pytest.raises(ValueError, match="unknown loss"):
        loss_parameters("triplet")


def test_build_with_hyper_parameters_and_none():
    loss = build_loss({"name": "norm_softmax", "temperature": 0.1}, 4, 3)
    assert isinstance(loss, NormSoftmaxLoss) and loss.temperature == 0.1
    loss = build_loss({"name": "proxy_isa", "V": None, "k": 0.4, "memory_size": 8}, 4, 3)
    assert isinstance(loss, ProxyISALoss) and loss.V == 100.0 and loss.k == 0.4


def test_unknown_key_names_key_and_loss():
    with pytest.raises(HyperParameterError, match=r"^temperature is not a hyper-parameter of loss 'proxy_anchor'") as err:
        build_loss({"name": "proxy_anchor", "temperature": 0.1}, 4, 3)
    assert err.value.name == "temperature"
    build_loss({"name": "proxy_anchor", "temperature": None}, 4, 3)  # None = not set


# Every hyper-parameter's rule, as its constructor states it: (loss, key, refused, accepted).
RULES = [
    ("norm_softmax", "temperature", [0.0, -0.1, math.inf, math.nan], [1e-3, 5.0]),
    ("proxy_nca", "temperature", [0.0, -1.0, math.nan], [0.1]),
    ("proxy_nca_pp", "temperature", [0.0, -1.0, math.inf], [0.1]),
    ("proxy_anchor", "alpha", [0.0, -32.0, math.nan], [1e-3, 64.0]),
    ("proxy_anchor", "delta", [-0.1, math.nan], [0.0, 0.5]),
    ("proxy_isa", "alpha", [0.0, -1.0], [16.0]),
    ("proxy_isa", "delta", [-0.01, math.inf], [0.0, 0.2]),
    ("proxy_isa", "V", [1.0, 0.5, -2.0, math.nan], [1.5, 1000.0]),
    ("proxy_isa", "k", [-0.1, math.nan], [0.0, 2.0]),
    ("proxy_isa", "lam", [-0.1, math.inf], [0.0, 0.3]),
    ("proxy_isa", "h", [0.0, -0.15, math.nan], [1e-3, 1.0]),
    ("proxy_isa", "tau", [0.0, -1.0, math.nan], [1e-3, 3.0]),
    ("proxy_isa", "memory_size", [0, -5, 2.5, True], [1, 64]),
]


def test_rules_cover_every_hyper_parameter():
    assert {(name, key) for name, key, _, _ in RULES} == {(n, k) for n in LOSSES for k in loss_parameters(n)}


@pytest.mark.parametrize(("name", "key", "refused", "accepted"), RULES, ids=lambda v: str(v))
def test_each_hyper_parameter_has_one_rule_in_its_constructor(name, key, refused, accepted):
    for value in refused:
        with pytest.raises(HyperParameterError, match=rf"^{key} must be") as err:
            build_loss({"name": name, key: value}, 2, 2)
        assert err.value.name == key
    for value in accepted:
        assert getattr(build_loss({"name": name, key: value}, 2, 2), key) == value


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "norm_softmax", "temperature": 0.0},
        {"name": "proxy_nca_pp", "temperature": -1.0},
        {"name": "proxy_anchor", "alpha": 0},
        {"name": "proxy_isa", "V": 0.5},
        {"name": "proxy_isa", "memory_size": 0},
        {"name": "norm_softmax", "synthesis": {"enabled": True, "mu": -1.0}},
        {"name": "norm_softmax", "synthesis": {"enabled": True, "alpha": 0.0}},
        {"name": "norm_softmax", "synthesis": {"enabled": True, "beta": 1.0}},
        {"name": "norm_softmax", "synthesis": "yes"},
        {"temperature": 0.1},
    ],
)
def test_domain_errors(cfg):
    with pytest.raises(ValueError):
        build_loss(cfg, 4, 3)


def test_synthesis_wrapping():
    loss = build_loss({"name": "proxy_anchor", "synthesis": {"enabled": True, "alpha": 0.5, "mu": 0.25}}, 4, 3)
    assert isinstance(loss, ProxySynthesis) and loss.alpha == 0.5 and loss.mu == 0.25
    assert loss.proxies is loss.base.proxies
    plain = build_loss({"name": "proxy_anchor", "synthesis": {"enabled": False, "mu": 0.25}}, 4, 3)
    assert not isinstance(plain, ProxySynthesis)
    defaults = build_loss({"name": "proxy_anchor", "synthesis": {"enabled": True, "alpha": None}}, 4, 3)
    assert defaults.alpha == 0.4 and defaults.mu == 1.0


def test_generator_makes_init_reproducible_and_global_rng_untouched():
    state = torch.get_rng_state()
    a = build_loss({"name": "proxy_anchor"}, 5, 4, generator=torch.Generator().manual_seed(3))
    b = build_loss({"name": "proxy_anchor"}, 5, 4, generator=torch.Generator().manual_seed(3))
    c = build_loss({"name": "proxy_anchor"}, 5, 4, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.proxies, b.proxies) and not torch.equal(a.proxies, c.proxies)
    d = build_loss({"name": "norm_softmax"}, 5, 4)  # no generator: fixed default seed
    e = build_loss({"name": "norm_softmax"}, 5, 4)
    assert torch.equal(d.proxies, e.proxies)
    assert torch.equal(torch.get_rng_state(), state)


def test_constructor_and_input_validation():
    with pytest.raises(ValueError):
        NormSoftmaxLoss(0, 3)
    with pytest.raises(ValueError):
        ClassicProxyNCALoss(1, 3)
    loss = NormSoftmaxLoss(3, 2)
    with pytest.raises(ValueError, match="labels must lie"):
        loss(torch.randn(2, 2), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="embeddings"):
        loss(torch.randn(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="long"):
        loss(torch.randn(2, 2), torch.tensor([0.0, 1.0]))


def test_every_loss_has_one_override_point():
    # forward and Proxy Synthesis (also sharded) both call loss_from; nothing else computes.
    for cls in LOSSES.values():
        assert cls.loss_from is not ProxyLoss.loss_from and not hasattr(cls, "compute")
