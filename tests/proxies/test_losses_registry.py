"""The registry: names, hyper-parameters, build_loss validation."""

from __future__ import annotations

import pytest
import torch

from proxies import (
    LOSSES,
    ClassicProxyNCALoss,
    NormSoftmaxLoss,
    ProxyISALoss,
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
    with pytest.raises(ValueError, match=r"'proxy_anchor'.*'temperature'"):
        build_loss({"name": "proxy_anchor", "temperature": 0.1}, 4, 3)
    build_loss({"name": "proxy_anchor", "temperature": None}, 4, 3)  # None = not set


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
