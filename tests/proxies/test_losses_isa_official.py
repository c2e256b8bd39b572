"""Proxy-ISA against a transcription of the official training step (tests/proxies/isa_official_ref.py):
the S_learned refresh of every batch class with memory rows, also one whose samples were all
outliers in the step (float64, 1e-9)."""

from __future__ import annotations

import pytest
import torch

from proxies import ProxyISALoss, ProxySynthesis
from tests.proxies.isa_official_ref import OfficialISA
from tests.reference.losses_ref import ISAHyper

TOL = 1e-9
C, D = 4, 6


def _assert_state(ours: ProxyISALoss, ref: OfficialISA) -> None:
    assert ours.count.tolist() == ref.count.tolist()
    torch.testing.assert_close(ours.effective_num, ref.effective_num, rtol=0, atol=TOL)
    torch.testing.assert_close(ours.learned_sim, ref.learned_sim, rtol=0, atol=TOL)
    feats, labs = ours.memory.get()
    # Ours is a ring buffer in storage order, the reference a list of the newest rows: the
    # same rows once sorted by (label, first coordinate).
    assert sorted(labs.tolist()) == sorted(ref.mem_targets.tolist())
    key_ours = labs.double() * 10 + feats[:, 0]
    key_ref = ref.mem_targets.double() * 10 + ref.mem_feats[:, 0]
    torch.testing.assert_close(feats[key_ours.argsort()], ref.mem_feats[key_ref.argsort()], rtol=0, atol=TOL)


def _near(p: torch.Tensor, y: torch.Tensor, sign: torch.Tensor, noise: float, g: torch.Generator) -> torch.Tensor:
    """Embeddings (B, d): sign_i * p̂[y_i] plus Gaussian noise of std ``noise``."""
    p_hat = torch.nn.functional.normalize(p, dim=1)
    return sign.unsqueeze(1) * p_hat[y] + noise * torch.randn(y.shape[0], p.shape[1], generator=g, dtype=p.dtype)


def _setup(memory_size: int = 32) -> tuple[ProxyISALoss, OfficialISA, torch.Generator]:
    g = torch.Generator().manual_seed(3)
    ours = ProxyISALoss(C, D, memory_size=memory_size).double()
    with torch.no_grad():
        ours.proxies.copy_(torch.randn(C, D, generator=g, dtype=torch.float64))
    ours.set_epoch(3)  # memory and filter on
    assert ours.memory_on and ours.filter_on
    return ours, OfficialISA(C, D, memory_size), g


def _two_steps(ours: torch.nn.Module, isa: ProxyISALoss, ref: OfficialISA, g: torch.Generator) -> tuple[float, float]:
    """Step 1: every sample near its proxy (clean, enqueued). An optimiser-like move of the
    proxies. Step 2: class 0's two samples opposite to its proxy (all outliers). Returns
    (S_learned(0) before step 2, the loss of step 2 when ``ours`` is the plain loss)."""
    y1 = torch.tensor([0, 0, 1, 2, 1, 3])
    x1 = _near(isa.proxies.detach(), y1, torch.ones(6, dtype=torch.float64), 0.05, g)
    p1 = isa.proxies.detach().clone()
    v1 = ours(x1, y1)
    r1 = ref.step(x1, p1, y1, memory_on=True, filter_on=True)
    if ours is isa:
        assert abs(v1.item() - r1.item()) < TOL * max(1.0, abs(r1.item()))
    _assert_state(isa, ref)
    assert isa.count[0].item() == 2 and (isa.memory.get()[1] == 0).sum().item() == 2

    with torch.no_grad():  # the proxies move between the steps, as after an optimiser step
        isa.proxies.add_(0.3 * torch.randn(C, D, generator=g, dtype=torch.float64))
    y2 = torch.tensor([0, 0, 1, 2, 3, 1])
    sign = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    x2 = _near(isa.proxies.detach(), y2, sign, 0.02, g)
    p2 = isa.proxies.detach().clone()
    # The two class-0 samples lie below its outlier boundary (state before step 2).
    s_out0 = isa.class_params().s_out[0].item()
    cos0 = torch.nn.functional.cosine_similarity(x2[:2], p2[0].expand(2, D), dim=1)
    assert bool((cos0 < s_out0).all()), (cos0, s_out0)
    before = isa.learned_sim[0].item()
    v2 = ours(x2, y2)
    r2 = ref.step(x2, p2, y2, memory_on=True, filter_on=True)
    if ours is isa:
        assert abs(v2.item() - r2.item()) < TOL * max(1.0, abs(r2.item()))
    return before, v2.item()


def test_all_outlier_class_gets_its_learned_sim_refreshed():
    isa, ref, g = _setup()
    before, _ = _two_steps(isa, isa, ref, g)
    # Class 0: no clean sample in step 2 (not counted, nothing enqueued) ...
    assert isa.count[0].item() == 2
    assert (isa.memory.get()[1] == 0).sum().item() == 2
    # ... but S_learned(0) is recomputed from its two memory rows and the moved proxy.
    _assert_state(isa, ref)
    feats, labs = isa.memory.get()
    p_hat0 = torch.nn.functional.normalize(isa.proxies.detach()[0], dim=0)
    expected = 0.15 * (feats[labs == 0] @ p_hat0).mean().item()
    assert abs(isa.learned_sim[0].item() - expected) < TOL
    # The previous rule (refresh only classes with a clean sample) would have kept `before`:
    # the test tells the two apart.
    assert abs(isa.learned_sim[0].item() - before) > 1e-3


def test_all_outlier_class_refresh_under_proxy_synthesis():
    """The wrapper updates the state from the real samples only: the same state as above."""
    isa, ref, g = _setup()
    ps = ProxySynthesis(isa, mu=0.5)
    _two_steps(ps, isa, ref, g)
    _assert_state(isa, ref)


def test_no_refresh_without_memory_rows():
    """A batch class that has never had a clean sample (no memory rows) keeps S_learned."""
    isa, ref, g = _setup()
    y = torch.tensor([0, 1, 1, 2])
    sign = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        isa.effective_num.fill_(50.0)  # a tight boundary: S_out = 1 - (nu + lam) > -1
        ref.effective_num.fill_(50.0)
    x = _near(isa.proxies.detach(), y, sign, 0.02, g)
    p = isa.proxies.detach().clone()
    v = isa(x, y)
    r = ref.step(x, p, y, memory_on=True, filter_on=True)
    assert abs(v.item() - r.item()) < TOL * max(1.0, abs(r.item()))
    assert isa.learned_sim[0].item() == 1.0 and isa.count[0].item() == 0
    _assert_state(isa, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_sequence_matches_official_step(seed):
    """Random steps through every phase (memory from epoch 2, filter from 3, the memory
    wrapping around): loss, count, E, S_learned and memory after every step."""
    c, d, size = 6, 5, 13
    hp = {"k": 0.4, "h": 0.5, "lam": 0.05}
    isa = ProxyISALoss(c, d, memory_size=size, **hp).double()
    ref = OfficialISA(c, d, size, ISAHyper(**hp))
    g = torch.Generator().manual_seed(100 + seed)
    all_outlier_refreshes = 0
    for step in range(10):
        isa.set_epoch(step // 2)
        y = torch.randint(0, c - 1, (9,), generator=g)
        x = torch.randn(9, d, generator=g, dtype=torch.float64)
        with torch.no_grad():
            isa.proxies.add_(0.1 * torch.randn(c, d, generator=g, dtype=torch.float64))
        p = isa.proxies.detach().clone()
        if isa.memory_on and isa.filter_on:
            _, _, s_out = ref.class_constants()
            clean = torch.nn.functional.cosine_similarity(x, p[y], dim=1) >= s_out[y]
            in_memory = set(ref.mem_targets.tolist())
            all_outlier_refreshes += sum(
                1 for k in torch.unique(y).tolist() if not bool(clean[y == k].any()) and k in in_memory
            )
        v = isa(x, y)
        r = ref.step(x, p, y, isa.memory_on, isa.filter_on)
        assert abs(v.item() - r.item()) < TOL * max(1.0, abs(r.item())), step
        _assert_state(isa, ref)
    assert isa.filter_on and len(isa.memory) == size
    if seed == 0:  # this sequence exercises the all-outlier refresh
        assert all_outlier_refreshes > 0
