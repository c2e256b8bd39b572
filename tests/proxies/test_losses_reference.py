"""Random inputs against the loop-based references of tests/reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from proxies import (
    ISAClassParams,
    ProxyISALoss,
    ProxySynthesis,
    build_loss,
    isa_class_params,
    norm_softmax_loss,
    proxy_anchor_loss,
    proxy_isa_loss,
    proxy_nca_loss,
)
from tests.proxies.isa_official_ref import OfficialISA
from tests.reference.losses_ref import (
    ISAHyper,
    ISAState,
    norm_softmax_ref,
    proxy_anchor_ref,
    proxy_isa_ref,
    proxy_nca_ref,
    synthesize_ref,
)
from tests.reference.problems import distinct_neighbours, random_problem

# (seed, B, C, d, classes absent from the batch)
CASES = [(0, 7, 5, 4, 0), (1, 12, 9, 6, 3), (2, 5, 11, 3, 6), (3, 16, 4, 8, 1)]


def _both(fn, ref, x, p):
    """Values and gradients of ``fn`` and ``ref`` w.r.t. (x, p)."""
    out = []
    for f in (fn, ref):
        xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
        val = f(xx, pp)
        gx, gp = torch.autograd.grad(val, (xx, pp))
        out.append((val.detach(), gx, gp))
    return out


def _assert_same(a, b, tol=1e-10):
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, atol=tol, rtol=tol)


LOSS_PAIRS = {
    "norm_softmax": (
        lambda x, p, y: norm_softmax_loss(x, p, y, 0.05),
        lambda x, p, y: norm_softmax_ref(x, p, y.tolist(), 0.05),
    ),
    "proxy_nca_pp": (
        lambda x, p, y: proxy_nca_loss(x, p, y, 1 / 9, True),
        lambda x, p, y: proxy_nca_ref(x, p, y.tolist(), 1 / 9, True),
    ),
    "proxy_nca": (
        lambda x, p, y: proxy_nca_loss(x, p, y, 0.2, False),
        lambda x, p, y: proxy_nca_ref(x, p, y.tolist(), 0.2, False),
    ),
    "proxy_anchor": (
        lambda x, p, y: proxy_anchor_loss(x, p, y, 32.0, 0.1),
        lambda x, p, y: proxy_anchor_ref(x, p, y.tolist(), 32.0, 0.1),
    ),
    # alpha large enough that the column-max shift path runs
    "proxy_anchor_a100": (
        lambda x, p, y: proxy_anchor_loss(x, p, y, 100.0, 0.2),
        lambda x, p, y: proxy_anchor_ref(x, p, y.tolist(), 100.0, 0.2),
    ),
    # temperature small enough that the row-max shift path runs
    "norm_softmax_t0.01": (
        lambda x, p, y: norm_softmax_loss(x, p, y, 0.01),
        lambda x, p, y: norm_softmax_ref(x, p, y.tolist(), 0.01),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
@pytest.mark.parametrize("name", list(LOSS_PAIRS))
def test_loss_matches_reference(name, case):
    seed, b, c, d, absent = case
    x, p, y = random_problem(seed, b, c, d, absent)
    fn, ref = LOSS_PAIRS[name]
    ours, theirs = _both(lambda xx, pp: fn(xx, pp, y), lambda xx, pp: ref(xx, pp, y), x, p)
    _assert_same(ours, theirs)


def _random_isa_state(seed: int, c: int) -> ISAState:
    g = torch.Generator().manual_seed(seed + 100)
    count = torch.randint(0, 300, (c,), generator=g)
    count[0] = 0
    e = (1 - 0.99 ** count.double()) / 0.01
    sl = torch.rand(c, generator=g, dtype=torch.float64) * 0.3
    sl[0] = 1.0
    return ISAState(count.tolist(), e.tolist(), sl.tolist(), memory_size=20)


@pytest.mark.parametrize("filter_on", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_proxy_isa_matches_reference(case, filter_on):
    seed, b, c, d, absent = case
    x, p, y = random_problem(seed, b, c, d, absent)
    st, hp = _random_isa_state(seed, c), ISAHyper()
    params = isa_class_params(
        torch.tensor(st.effective_num, dtype=torch.float64), torch.tensor(st.learned_sim, dtype=torch.float64),
        hp.V, hp.k, hp.lam, hp.tau, filter_on,
    )
    ours, theirs = _both(
        lambda xx, pp: proxy_isa_loss(xx, pp, y, hp.alpha, hp.delta, params),
        lambda xx, pp: proxy_isa_ref(xx, pp, y.tolist(), st, hp, filter_on),
        x, p,
    )
    _assert_same(ours, theirs)


def test_isa_class_params_match_reference():
    st, hp = _random_isa_state(5, 30), ISAHyper()
    params: ISAClassParams = isa_class_params(
        torch.tensor(st.effective_num, dtype=torch.float64), torch.tensor(st.learned_sim, dtype=torch.float64),
        hp.V, hp.k, hp.lam, hp.tau, True,
    )
    from tests.reference.losses_ref import isa_class_constants

    for c in range(30):
        sigma, neg_scale, s_out, s_learned = isa_class_constants(st, hp, c)
        assert abs(params.sigma[c].item() - sigma) < 1e-12
        assert abs(params.neg_scale[c].item() - neg_scale) < 1e-15
        assert abs(params.s_out[c].item() - s_out) < 1e-12


def test_proxy_isa_training_sequence_matches_reference():
    """Several steps through the phases: loss, count, E, S_learned and the memory.

    The state follows the official step (tests/proxies/isa_official_ref.py: S_learned is
    refreshed for every batch class with memory rows, also one whose samples were all
    outliers; this sequence has such a step). tests/reference's ``isa_update_ref`` predates
    that rule, so only its loss is used here, from the official state of each step.
    """
    c, d, size = 6, 5, 13
    hp = ISAHyper(k=0.4, h=0.5, lam=0.05)
    isa = ProxyISALoss(c, d, k=hp.k, lam=hp.lam, h=hp.h, memory_size=size).double()
    official = OfficialISA(c, d, size, hp)
    g = torch.Generator().manual_seed(7)
    for step in range(8):
        epoch = step // 2  # memory from epoch 2, filter from epoch 3
        isa.set_epoch(epoch)
        x = torch.randn(9, d, generator=g, dtype=torch.float64)
        y = torch.randint(0, c - 1, (9,), generator=g)
        with torch.no_grad():
            isa.proxies.add_(0.1 * torch.randn(c, d, generator=g, dtype=torch.float64))
        p = isa.proxies.detach().clone()
        st = ISAState(official.count.tolist(), official.effective_num.tolist(), official.learned_sim.tolist(), size)
        ref_loss = proxy_isa_ref(x, p, y.tolist(), st, hp, isa.filter_on)
        ours = isa(x, y)
        official_loss = official.step(x, p, y, isa.memory_on, isa.filter_on)
        assert abs(ours.item() - ref_loss.item()) < 1e-10, step
        assert abs(official_loss.item() - ref_loss.item()) < 1e-10, step
        assert isa.count.tolist() == official.count.tolist()
        torch.testing.assert_close(isa.effective_num, official.effective_num)
        torch.testing.assert_close(isa.learned_sim, official.learned_sim, rtol=0, atol=1e-12)
        feats, labs = isa.memory.get()
        assert sorted(labs.tolist()) == sorted(official.mem_targets.tolist())
    assert isa.filter_on and len(isa.memory) == size  # the sequence reached every phase


@pytest.mark.parametrize("mu", [1.0, 0.5, 0.3])
@pytest.mark.parametrize("name", ["norm_softmax", "proxy_nca", "proxy_nca_pp", "proxy_anchor", "proxy_isa"])
def test_proxy_synthesis_matches_reference(name, mu):
    c, d, b, lam = 7, 5, 10, 0.37
    x, p, _ = random_problem(11, b, c, d)
    y = distinct_neighbours(11, b, c)
    refs = {
        "norm_softmax": lambda xe, pe, ye: norm_softmax_ref(xe, pe, ye, 1 / 23),
        "proxy_nca": lambda xe, pe, ye: proxy_nca_ref(xe, pe, ye, 1 / 9, False),
        "proxy_nca_pp": lambda xe, pe, ye: proxy_nca_ref(xe, pe, ye, 1 / 9, True),
        "proxy_anchor": lambda xe, pe, ye: proxy_anchor_ref(xe, pe, ye, 32.0, 0.1),
        "proxy_isa": lambda xe, pe, ye: proxy_isa_ref(
            xe, pe, ye, ISAState.fresh(c, 10), ISAHyper(), False, num_stateless=pe.shape[0] - c
        ),
    }
    loss = build_loss({"name": name, "synthesis": {"enabled": True, "mu": mu}}, c, d).double()
    assert isinstance(loss, ProxySynthesis)
    loss.eval()

    def ours(xx, pp):
        with torch.no_grad():
            loss.proxies.copy_(pp)
        # route the gradient through pp: the wrapper reads loss.proxies
        return loss.base.loss_from(*_ps_inputs(loss, xx, pp, y, lam))

    def ref(xx, pp):
        return refs[name](*synthesize_ref(xx, pp, y.tolist(), lam, mu))

    a, b_ = _both(ours, ref, x, p)
    _assert_same(a, b_)
    # and through the public call
    with torch.no_grad():
        loss.proxies.copy_(p)
    assert abs(loss(x, y, lam=lam).item() - a[0].item()) < 1e-12


def _ps_inputs(ps: ProxySynthesis, x, p, y, lam):
    """What ProxySynthesis.forward hands the base loss, with ``p`` as the proxies."""
    from proxies.functional import SyntheticProxies, normalize_rows

    n = ps.num_synthetic(x.shape[0])
    xh = normalize_rows(x)
    x_syn = torch.lerp(xh.roll(1, 0)[:n], xh[:n], lam)
    syn = SyntheticProxies(y[:n], y.roll(1)[:n], lam)
    y_ext = torch.cat([y, ps.base.num_classes + torch.arange(n)])
    return torch.cat([xh, x_syn]), p, y_ext, syn
