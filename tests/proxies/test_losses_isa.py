"""Proxy-ISA: phases, effective numbers, decay limit, outlier filtering, state, checkpoints."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from proxies import ProxyAnchorLoss, ProxyISALoss, effective_number, isa_class_params
from tests.reference.problems import random_problem


def _isa(c=5, d=6, **kw) -> ProxyISALoss:
    return ProxyISALoss(c, d, memory_size=kw.pop("memory_size", 32), **kw).double()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fresh_state_equals_proxy_anchor(seed):
    x, p, y = random_problem(seed, 10, 5, 6, absent=1)
    isa, pa = _isa(), ProxyAnchorLoss(5, 6).double()
    with torch.no_grad():
        isa.proxies.copy_(p)
        pa.proxies.copy_(p)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    la, lb = isa(xa, y), pa(xb, y)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) < 1e-12
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(isa.proxies.grad, pa.proxies.grad)


def test_set_epoch_phases():
    isa = _isa()
    assert (isa.memory_on, isa.filter_on) == (False, False)
    phases = []
    for epoch in range(5):
        isa.set_epoch(epoch)
        phases.append((isa.memory_on, isa.filter_on))
    assert phases == [(False, False), (False, False), (True, False), (True, True), (True, True)]
    isa.set_epoch(0, memory_start_epoch=0)
    assert (isa.memory_on, isa.filter_on) == (True, False)
    with pytest.raises(ValueError):
        isa.set_epoch(-1)


def test_effective_number_formula():
    v = 100.0
    beta = (v - 1) / v
    n = torch.tensor([0, 1, 2, 10, 458, 5000])
    expected = torch.tensor([(1 - beta**k) / (1 - beta) for k in n.tolist()], dtype=torch.float64)
    torch.testing.assert_close(effective_number(n, v), expected, rtol=1e-12, atol=1e-12)
    assert effective_number(torch.tensor([1]), v).item() == pytest.approx(1.0)
    assert effective_number(torch.tensor([10**6]), v).item() == pytest.approx(v)


def test_effective_number_updates_with_counts():
    isa = _isa(c=4)
    x, _, _ = random_problem(0, 6, 4, 6)
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    isa(x, y)
    isa(x, y)
    assert isa.count.tolist() == [6, 4, 2, 0]
    torch.testing.assert_close(isa.effective_num, effective_number(isa.count, 100.0))
    assert isa.effective_num[3].item() == 0.0


def test_decay_limit():
    """sigma = 1 at E = 0 and -> nu(V) = 1 / (1 + ln(1 + V)) as E -> V."""
    v, tau = 100.0, 1.5
    e = torch.tensor([0.0, v - 1e-9, v], dtype=torch.float64)
    params = isa_class_params(e, torch.ones(3, dtype=torch.float64), v, 0.9, 0.1, tau, True)
    assert params.sigma[0].item() == pytest.approx(1.0, abs=1e-12)
    limit = 1.0 / (1.0 + math.log(1.0 + v))
    assert params.sigma[1].item() == pytest.approx(limit, abs=1e-9)
    assert params.sigma[2].item() == pytest.approx(limit, abs=1e-12)
    # monotone decay in between
    grid = torch.linspace(0, v, 201, dtype=torch.float64)
    sig = isa_class_params(grid, torch.ones(201, dtype=torch.float64), v, 0.9, 0.1, tau, True).sigma
    assert bool((sig[1:] <= sig[:-1] + 1e-15).all())


def test_outliers_not_counted_nor_enqueued():
    c, d = 3, 4
    isa = _isa(c=c, d=d)
    with torch.no_grad():
        isa.proxies.copy_(torch.eye(c, d, dtype=torch.float64))
        isa.learned_sim.fill_(0.9)
        isa.effective_num.fill_(50.0)
    isa.memory_on = isa.filter_on = True
    s_out = isa.class_params().s_out[0].item()
    assert -1 < s_out < 1
    # class 0: one sample on its proxy (clean), one opposite to it (outlier); class 1: clean.
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [-1.0, 0.2, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    isa(x, y)
    assert isa.count.tolist() == [1, 1, 0]
    feats, labs = isa.memory.get()
    assert labs.tolist() == [0, 1]
    torch.testing.assert_close(feats[0], x[0])
    # S_learned of touched classes = h * mean over the memory of <f, p̂_c>
    assert isa.learned_sim[0].item() == pytest.approx(0.15 * 1.0)
    assert isa.learned_sim[2].item() == pytest.approx(0.9)  # untouched


def test_without_filter_everything_is_clean():
    isa = _isa(c=3, d=4)
    isa.memory_on = True
    x, _, _ = random_problem(1, 7, 3, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    isa(x, y)
    assert isa.count.tolist() == [3, 2, 2]
    assert len(isa.memory) == 7


def test_no_update_in_eval_mode():
    isa = _isa()
    isa.set_epoch(5)
    x, _, y = random_problem(2, 8, 5, 6)
    before = copy.deepcopy(isa.state_dict())
    isa.eval()
    isa(x, y)
    for k, v in isa.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k


def test_loss_uses_state_before_update():
    isa = _isa()
    isa.set_epoch(3)
    x, _, y = random_problem(3, 8, 5, 6)
    reference = copy.deepcopy(isa).eval()
    assert isa(x, y).item() == reference(x, y).item()
    assert not torch.equal(isa.count, reference.count)


def _train_steps(isa: ProxyISALoss, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(8, isa.embedding_dim, generator=g, dtype=torch.float64)
        y = torch.randint(0, isa.num_classes, (8,), generator=g)
        out.append(isa(x, y).item())
    return out


def test_state_dict_round_trip_restores_exactly():
    isa = _isa(memory_size=10)
    isa.set_epoch(3)
    _train_steps(isa, 4, seed=0)
    buf = io.BytesIO()
    torch.save(isa.state_dict(), buf)
    keys = set(isa.state_dict())
    assert {"count", "effective_num", "learned_sim", "memory.embeddings", "memory.labels", "memory.ptr",
            "memory.num_valid", "proxies"} <= keys
    restored = _isa(memory_size=10)
    buf.seek(0)
    restored.load_state_dict(torch.load(buf, weights_only=False))
    assert (restored.memory_on, restored.filter_on) == (True, True)
    assert _train_steps(isa, 3, seed=1) == _train_steps(restored, 3, seed=1)
    for k, v in isa.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, restored.state_dict()[k]), k


def test_deterministic():
    a, b = _isa(), _isa()
    a.set_epoch(3)
    b.set_epoch(3)
    assert _train_steps(a, 3, 5) == _train_steps(b, 3, 5)
    assert torch.equal(a.memory.embeddings, b.memory.embeddings)


@pytest.mark.parametrize(
    "kw", [{"V": 1.0}, {"alpha": 0.0}, {"memory_size": 0}, {"h": -1.0}, {"k": -0.1}, {"delta": math.nan}]
)
def test_hyper_parameter_validation(kw):
    with pytest.raises(ValueError):
        ProxyISALoss(3, 4, **kw)
