"""The per-class / per-sample terms (the sharding interface), non-uniform upstream
gradients, and the chunked code paths (forced by tiny chunk sizes)."""

from __future__ import annotations

import pytest
import torch

import proxies.fused as pf
from proxies import (
    anchor_terms,
    cosine_similarity,
    isa_class_params,
    norm_softmax_loss,
    proxy_anchor_loss,
    proxy_isa_loss,
    proxy_nca_loss,
    softmax_terms,
)
from tests.reference.losses_ref import (
    ISAHyper,
    ISAState,
    norm_softmax_ref,
    proxy_anchor_ref,
    proxy_isa_ref,
    proxy_nca_ref,
)
from tests.reference.problems import random_problem


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Column chunks of 3 and row chunks of 2: every loop runs many times."""
    monkeypatch.setattr(pf, "_CHUNK_ELEMS", 1)
    monkeypatch.setattr(pf, "_MIN_CHUNK_COLS", 3)
    monkeypatch.setattr(pf, "_PROJ_ROWS", 2)


def _grads(fn, x, p):
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    val = fn(xx, pp)
    return (val.detach(), *torch.autograd.grad(val, (xx, pp)))


def _close(a, b):
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, atol=1e-10, rtol=1e-10)


# Oracles: straightforward masked versions on top of the (separately tested) cosine helper.
def _softmax_oracle(x, p, y, scale, exclude):
    z = cosine_similarity(x, p) * scale
    pos = z.gather(1, y[:, None]).squeeze(1)
    if exclude:
        z = z.masked_fill(torch.nn.functional.one_hot(y, p.shape[0]).bool(), -torch.inf)
    return torch.logsumexp(z, dim=1), pos


def _anchor_oracle(x, p, y, alpha, delta):
    s = cosine_similarity(x, p)
    onehot = torch.nn.functional.one_hot(y, p.shape[0]).bool()
    zero = s.new_zeros(1, p.shape[0])
    zp = (-alpha * (s - delta)).masked_fill(~onehot, -torch.inf)
    zn = (alpha * (s + delta)).masked_fill(onehot, -torch.inf)
    return torch.logsumexp(torch.cat([zp, zero]), 0), torch.logsumexp(torch.cat([zn, zero]), 0)


@pytest.mark.parametrize("exclude", [False, True])
@pytest.mark.parametrize("scale", [9.0, 400.0])  # 400: the shifted (row max) path
def test_softmax_terms_weighted(exclude, scale, tiny_chunks):
    x, p, y = random_problem(0, 9, 11, 5, absent=2)
    w1 = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w2 = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def ours(xx, pp):
        t = softmax_terms(xx, pp, y, scale, exclude)
        return (t.lse * w1).sum() - (t.pos * w2).sum()

    def oracle(xx, pp):
        lse, pos = _softmax_oracle(xx, pp, y, scale, exclude)
        return (lse * w1).sum() - (pos * w2).sum()

    _close(_grads(ours, x, p), _grads(oracle, x, p))
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    assert torch.autograd.gradcheck(ours, (xx, pp))


@pytest.mark.parametrize("alpha", [32.0, 100.0])
def test_anchor_terms_weighted(alpha, tiny_chunks):
    x, p, y = random_problem(1, 9, 11, 5, absent=2)
    w1 = torch.rand(11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w2 = torch.rand(11, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def ours(xx, pp):
        t = anchor_terms(xx, pp, y, alpha, 0.1)
        return (t.q_pos * w1).sum() + (t.q_neg * w2).sum()

    def oracle(xx, pp):
        qp, qn = _anchor_oracle(xx, pp, y, alpha, 0.1)
        return (qp * w1).sum() + (qn * w2).sum()

    _close(_grads(ours, x, p), _grads(oracle, x, p))
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    assert torch.autograd.gradcheck(ours, (xx, pp))


def test_anchor_terms_counts():
    x, p, y = random_problem(2, 9, 6, 4, absent=2)
    t = anchor_terms(x, p, y, 32.0, 0.1)
    assert t.n_pos.tolist() == torch.bincount(y, minlength=6).double().tolist()
    assert (t.n_pos + t.n_neg == 9).all()
    assert (t.q_pos[t.n_pos == 0] == 0).all()
    assert (t.w_pos == (t.n_pos > 0).double()).all() and (t.w_neg == 1).all()


def test_losses_in_chunks_match_reference(tiny_chunks):
    x, p, y = random_problem(3, 10, 13, 6, absent=3)
    yl = y.tolist()
    st = ISAState([0, 5, 50, 99, 200, 1, 0, 9, 30, 60, 2, 3, 4], [0.0] * 13, [1.0] * 13, 8)
    st.effective_num = [(1 - 0.99**n) / 0.01 for n in st.count]
    st.learned_sim = [1.0, 0.2, 0.1, 0.3, 0.05, 0.9, 1.0, 0.4, 0.2, 0.1, 0.6, 0.7, 0.3]
    hp = ISAHyper()
    params = isa_class_params(
        torch.tensor(st.effective_num, dtype=torch.float64), torch.tensor(st.learned_sim, dtype=torch.float64),
        hp.V, hp.k, hp.lam, hp.tau, True,
    )
    pairs = [
        (lambda a, b: norm_softmax_loss(a, b, y, 0.05), lambda a, b: norm_softmax_ref(a, b, yl, 0.05)),
        (lambda a, b: proxy_nca_loss(a, b, y, 0.1, False), lambda a, b: proxy_nca_ref(a, b, yl, 0.1, False)),
        (lambda a, b: proxy_anchor_loss(a, b, y, 32.0, 0.1), lambda a, b: proxy_anchor_ref(a, b, yl, 32.0, 0.1)),
        (
            lambda a, b: proxy_isa_loss(a, b, y, 32.0, 0.1, params),
            lambda a, b: proxy_isa_ref(a, b, yl, st, hp, True),
        ),
    ]
    for ours, ref in pairs:
        _close(_grads(ours, x, p), _grads(ref, x, p))


def test_cosine_similarity_matches_direct(tiny_chunks):
    x, p, _ = random_problem(4, 5, 7, 3)
    w = torch.randn(5, 7, dtype=torch.float64)

    def direct(xx, pp):
        s = torch.nn.functional.normalize(xx, dim=1) @ torch.nn.functional.normalize(pp, dim=1).t()
        return (s * w).sum()

    _close(_grads(lambda a, b: (cosine_similarity(a, b) * w).sum(), x, p), _grads(direct, x, p))


def test_no_grad_path_same_values():
    x, p, y = random_problem(5, 8, 6, 4)
    with_grad = proxy_anchor_loss(x, p.clone().requires_grad_(), y, 32.0, 0.1)
    with torch.no_grad():
        no_grad = proxy_anchor_loss(x, p, y, 32.0, 0.1)
    assert with_grad.item() == pytest.approx(no_grad.item(), abs=1e-12)
    with torch.no_grad():
        ns = softmax_terms(x, p, y, 9.0).lse
    torch.testing.assert_close(ns, softmax_terms(x, p.clone().requires_grad_(), y, 9.0).lse.detach())


@pytest.mark.parametrize("name", ["norm_softmax", "proxy_nca", "proxy_anchor"])
def test_synthetic_proxies_in_chunks(name, tiny_chunks):
    from proxies.functional import SyntheticProxies
    from tests.reference.losses_ref import synthesize_ref

    x, p, _ = random_problem(6, 8, 9, 5)
    y = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6])
    lam, n = 0.35, 5
    syn = SyntheticProxies(y[:n], y.roll(1)[:n], lam)
    y_ext = torch.cat([y, 9 + torch.arange(n)])
    fns = {
        "norm_softmax": (lambda a, b, yy, s=None: norm_softmax_loss(a, b, yy, 0.05, s), norm_softmax_ref, (0.05,)),
        "proxy_nca": (lambda a, b, yy, s=None: proxy_nca_loss(a, b, yy, 0.1, False, s), proxy_nca_ref, (0.1, False)),
        "proxy_anchor": (
            lambda a, b, yy, s=None: proxy_anchor_loss(a, b, yy, 32.0, 0.1, s), proxy_anchor_ref, (32.0, 0.1),
        ),
    }
    ours_fn, ref_fn, args = fns[name]

    def ours(xx, pp):
        xh = torch.nn.functional.normalize(xx, dim=1)
        x_ext = torch.cat([xh, torch.lerp(xh.roll(1, 0)[:n], xh[:n], lam)])
        return ours_fn(x_ext, pp, y_ext, syn)

    def ref(xx, pp):
        xe, pe, ye = synthesize_ref(xx, pp, y.tolist(), lam, n / 8)
        return ref_fn(xe, pe, ye, *args)

    _close(_grads(ours, x, p), _grads(ref, x, p))
