"""Proxy Synthesis: mu = 0, the adjacent-label reordering, lambda from the generator."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from proxies import (
    LOSSES,
    NormSoftmaxLoss,
    ProxyISALoss,
    ProxySynthesis,
    adjacent_distinct_order,
    sample_beta,
)
from tests.reference.losses_ref import norm_softmax_ref, synthesize_ref
from tests.reference.problems import random_problem


@pytest.mark.parametrize("name", list(LOSSES))
def test_mu_zero_equals_base_loss(name):
    x, p, y = random_problem(0, 8, 5, 4)
    base = LOSSES[name](5, 4, memory_size=16) if name == "proxy_isa" else LOSSES[name](5, 4)
    twin = LOSSES[name](5, 4, memory_size=16) if name == "proxy_isa" else LOSSES[name](5, 4)
    twin.load_state_dict(base.state_dict())
    ps = ProxySynthesis(base, mu=0.0)
    xa, xb = x.float().requires_grad_(), x.float().requires_grad_()
    la, lb = ps(xa, y), twin(xb, y)
    la.backward()
    lb.backward()
    assert la.item() == lb.item()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ps.proxies.grad, twin.proxies.grad)


def _adjacent_ok(labels: torch.Tensor) -> bool:
    return not bool((labels == labels.roll(1)).any())


def test_reorder_makes_adjacent_labels_differ():
    y = torch.tensor([0, 0, 1, 1])
    perm = adjacent_distinct_order(y)
    assert perm is not None and sorted(perm.tolist()) == [0, 1, 2, 3]
    assert _adjacent_ok(y[perm])
    assert torch.equal(perm, adjacent_distinct_order(y))  # deterministic
    assert adjacent_distinct_order(torch.tensor([0, 1, 2, 0, 1])) is None  # already fine


def test_reorder_exhaustive_small_batches():
    g = torch.Generator().manual_seed(0)
    for b in range(2, 13):
        for _ in range(30):
            y = torch.randint(0, max(2, b // 2), (b,), generator=g)
            counts = torch.bincount(y)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # infeasible batches warn
                perm = adjacent_distinct_order(y)
            if int(counts.max()) <= b // 2:
                assert _adjacent_ok(y if perm is None else y[perm]), y.tolist()


def test_reorder_impossible_warns():
    with pytest.warns(RuntimeWarning):
        perm = adjacent_distinct_order(torch.tensor([0, 0, 0, 1]))
    assert sorted(perm.tolist()) == [0, 1, 2, 3]


def test_reordered_batch_loss_matches_reference():
    x, p, _ = random_problem(1, 4, 3, 5)
    y = torch.tensor([0, 0, 1, 1])
    ns = NormSoftmaxLoss(3, 5).double()
    with torch.no_grad():
        ns.proxies.copy_(p)
    ps = ProxySynthesis(ns, mu=1.0)
    perm = adjacent_distinct_order(y)
    expected = norm_softmax_ref(*synthesize_ref(x[perm], p, y[perm].tolist(), 0.25, 1.0), 1 / 23)
    assert abs(ps(x, y, lam=0.25).item() - expected.item()) < 1e-10
    # without reordering, the result would differ: synthetic samples would mix one class
    wrong = norm_softmax_ref(*synthesize_ref(x, p, y.tolist(), 0.25, 1.0), 1 / 23)
    assert abs(wrong.item() - expected.item()) > 1e-6


def _ps(seed: int | None) -> ProxySynthesis:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return ProxySynthesis(NormSoftmaxLoss(6, 4, generator=torch.Generator().manual_seed(3)), generator=gen)


def test_lambda_from_the_generator_only():
    x, _, _ = random_problem(2, 8, 6, 4, dtype=torch.float32)
    y = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])
    global_state = torch.get_rng_state()
    a, b, c = _ps(7), _ps(7), _ps(8)
    la, lb, lc = a(x, y), b(x, y), c(x, y)
    assert torch.equal(torch.get_rng_state(), global_state)  # global RNG untouched
    assert la.item() == lb.item() and la.item() != lc.item()
    assert a.sample_lambda() == b.sample_lambda() != c.sample_lambda()
    # the same lambda fixed by hand gives the same loss
    g = torch.Generator().manual_seed(7)
    lam = sample_beta(0.4, 0.4, g)
    assert _ps(None)(x, y, lam=lam).item() == la.item()


def test_generator_state_in_state_dict():
    a = _ps(11)
    a.sample_lambda()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = _ps(99)
    b.load_state_dict(torch.load(buf, weights_only=False))
    assert [a.sample_lambda() for _ in range(3)] == [b.sample_lambda() for _ in range(3)]


def test_beta_distribution_moments():
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_beta(0.4, 0.4, g) for _ in range(3000)], dtype=torch.float64)
    assert bool(((draws > 0) & (draws < 1)).all())
    assert abs(draws.mean().item() - 0.5) < 0.03
    assert abs(draws.var().item() - 1 / (4 * 1.8)) < 0.02  # Beta(a, a): 1 / (4 (2a + 1))
    g = torch.Generator().manual_seed(1)
    skewed = torch.tensor([sample_beta(2.0, 5.0, g) for _ in range(3000)], dtype=torch.float64)
    assert abs(skewed.mean().item() - 2 / 7) < 0.02
    tiny = sample_beta(1e-3, 1e-3, torch.Generator().manual_seed(2))
    assert 0.0 <= tiny <= 1.0


def test_isa_state_uses_real_samples_only():
    isa = ProxyISALoss(4, 5, memory_size=32)
    isa.set_epoch(2)  # memory on
    ps = ProxySynthesis(isa, mu=1.0, generator=torch.Generator().manual_seed(0))
    x, _, _ = random_problem(3, 6, 4, 5, dtype=torch.float32)
    y = torch.tensor([0, 1, 2, 0, 1, 3])
    ps(x, y)
    assert isa.count.tolist() == [2, 2, 1, 1]
    feats, labs = isa.memory.get()
    assert labs.tolist() == y.tolist()  # real samples, original order
    assert isa.effective_num.shape == (4,) and isa.learned_sim.shape == (4,)


def test_validation():
    with pytest.raises(ValueError):
        ProxySynthesis(NormSoftmaxLoss(3, 2), alpha=0.0)
    with pytest.raises(ValueError):
        ProxySynthesis(NormSoftmaxLoss(3, 2), mu=-0.1)
    ps = ProxySynthesis(NormSoftmaxLoss(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError):
            ps(torch.randn(4, 2), torch.tensor([0, 1, 2, 0]), lam=1.5)
