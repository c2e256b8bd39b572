"""docs/losses.md 'Known values (float64)', reproduced to 1e-8."""

from __future__ import annotations

import pytest
import torch

from proxies import (
    NormSoftmaxLoss,
    ProxyAnchorLoss,
    ProxyISALoss,
    ProxyNCALoss,
    ProxySynthesis,
    norm_softmax_loss,
    proxy_anchor_loss,
    proxy_nca_loss,
)

TOL = 1e-8


def _with_proxies(loss: torch.nn.Module, p: torch.Tensor) -> torch.nn.Module:
    loss = loss.double()
    with torch.no_grad():
        loss.proxies.copy_(p)
    return loss


def test_proxy_anchor(known):
    x, p, y = known
    assert abs(proxy_anchor_loss(x, p, y, 32.0, 0.1).item() - 50.8960221895) < TOL
    assert abs(_with_proxies(ProxyAnchorLoss(5, 16), p)(x, y).item() - 50.8960221895) < TOL


def test_proxy_nca(known):
    x, p, y = known
    assert abs(proxy_nca_loss(x, p, y, 1 / 9, True).item() - 10.9316917630) < TOL
    assert abs(proxy_nca_loss(x, p, y, 1 / 9, False).item() - 9.7529983734) < TOL
    assert abs(_with_proxies(ProxyNCALoss(5, 16), p)(x, y).item() - 10.9316917630) < TOL
    classic = ProxyNCALoss(5, 16, assignment_probability=False)
    assert abs(_with_proxies(classic, p)(x, y).item() - 9.7529983734) < TOL


def test_norm_softmax(known):
    x, p, y = known
    assert abs(norm_softmax_loss(x, p, y, 1 / 23).item() - 13.8750320860) < TOL
    assert abs(_with_proxies(NormSoftmaxLoss(5, 16), p)(x, y).item() - 13.8750320860) < TOL


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: NormSoftmaxLoss(5, 16, temperature=1 / 23), 14.6017015066),
        (lambda: ProxyNCALoss(5, 16, temperature=1 / 9), 11.5975734104),
    ],
    ids=["norm_softmax", "proxy_nca_pp"],
)
def test_proxy_synthesis(known, make, expected):
    x, p, y = known
    ps = ProxySynthesis(_with_proxies(make(), p), mu=1.0)
    assert abs(ps(x, y, lam=0.3).item() - expected) < TOL


def test_proxy_isa_fresh_equals_proxy_anchor(known):
    x, p, y = known
    isa = _with_proxies(ProxyISALoss(5, 16, memory_size=64), p)
    assert abs(isa(x, y).item() - 50.8960221895) < TOL


def test_proxy_isa_with_state(known):
    x, p, y = known
    isa = _with_proxies(ProxyISALoss(5, 16, memory_size=64), p)
    with torch.no_grad():
        isa.effective_num.copy_(torch.tensor([99.0, 98.0, 60.0, 99.5, 0.0]))
        isa.count.copy_(torch.tensor([458, 389, 91, 527, 0]))
    isa.memory_on = True
    isa.filter_on = True
    assert len(isa.memory) == 0
    assert abs(isa(x, y).item() - 95.1659294958) < TOL
    # The stored rows are the row-normalised X: S_learned = h * mean <x̂_j, p̂_c>.
    expected = torch.tensor([0.121659, 0.120536, 1.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(isa.learned_sim, expected, atol=5e-7, rtol=0)
