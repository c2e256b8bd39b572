"""torch.autograd.gradcheck (float64, small sizes) for every loss, plain and PS-wrapped."""

from __future__ import annotations

import pytest
import torch

from proxies import LOSSES, ProxySynthesis, cosine_similarity
from tests.reference.problems import random_problem


def _set_isa_state(loss: torch.nn.Module) -> None:
    """A non-trivial Proxy-ISA state so the weights are not all 1."""
    isa = getattr(loss, "base", loss)
    if hasattr(isa, "effective_num"):
        with torch.no_grad():
            isa.effective_num.copy_(torch.tensor([0.0, 3.0, 99.0, 40.0, 1.0]))
            isa.learned_sim.copy_(torch.tensor([1.0, 0.1, 0.2, 0.05, 0.9]))
        isa.memory_on = isa.filter_on = True


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "ps"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_gradcheck(name, wrapped):
    x, p, y = random_problem(3, 6, 5, 4, absent=1)
    loss = LOSSES[name](5, 4).double()
    if wrapped:
        loss = ProxySynthesis(loss, mu=0.7)
        y = torch.tensor([0, 1, 0, 2, 3, 2])
    _set_isa_state(loss)
    loss.eval()  # no state update between the gradcheck evaluations
    base = getattr(loss, "base", loss)

    def fn(xx, pp):
        if wrapped:
            return base.loss_from(*_ps_args(loss, xx, pp, y, 0.3))
        return base.loss_from(xx, pp, y)

    xx = x.clone().requires_grad_()
    pp = p.clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (xx, pp))


def _ps_args(ps: ProxySynthesis, x, p, y, lam):
    from proxies.functional import SyntheticProxies, normalize_rows

    n = ps.num_synthetic(x.shape[0])
    xh = normalize_rows(x)
    syn = SyntheticProxies(y[:n], y.roll(1)[:n], lam)
    x_ext = torch.cat([xh, torch.lerp(xh.roll(1, 0)[:n], xh[:n], lam)])
    return x_ext, p, torch.cat([y, ps.base.num_classes + torch.arange(n)]), syn


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradcheck_through_wrapper_parameters(name):
    """The public PS call with a fixed lam: gradients w.r.t. embeddings and the module's proxies."""
    x, _, _ = random_problem(4, 6, 5, 4)
    y = torch.tensor([0, 1, 0, 2, 3, 2])
    ps = ProxySynthesis(LOSSES[name](5, 4).double(), mu=1.0).eval()
    _set_isa_state(ps)
    xx = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v, _p: ps(v, y, lam=0.6), (xx, ps.proxies))


def test_gradcheck_cosine_similarity():
    x, p, _ = random_problem(5, 5, 4, 3)
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    weights = torch.randn(5, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: (cosine_similarity(a, b) * weights).sum(), (xx, pp))
