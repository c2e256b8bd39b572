"""One contract for every registered loss, plain and wrapped in Proxy Synthesis."""

from __future__ import annotations

import copy

import pytest
import torch

from proxies import LOSSES, ProxySynthesis, build_loss

C, D, B = 7, 6, 10
LABELS = torch.tensor([0, 1, 2, 0, 3, 1, 4, 2, 0, 6])  # class 5 absent


def _make(name: str, wrapped: bool, seed: int = 0) -> torch.nn.Module:
    cfg = {"name": name}
    if name == "proxy_isa":
        cfg["memory_size"] = 64
    if wrapped:
        cfg["synthesis"] = {"enabled": True, "alpha": 0.4, "mu": 0.5}
    return build_loss(cfg, C, D, generator=torch.Generator().manual_seed(seed))


def _call(loss, x, y):
    return loss(x, y, lam=0.3) if isinstance(loss, ProxySynthesis) else loss(x, y)


def _x(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=dtype) * 3.0


PARAMS = [(n, w) for n in LOSSES for w in (False, True)]
IDS = [f"{n}{'+ps' if w else ''}" for n, w in PARAMS]


@pytest.mark.parametrize("name, wrapped", PARAMS, ids=IDS)
def test_finite_and_gradients_reach_everything(name, wrapped):
    loss = _make(name, wrapped)
    if hasattr(loss, "set_epoch"):
        loss.set_epoch(3)  # ISA: memory and filter on; others: no-op
    x = _x().requires_grad_()
    for _ in range(2):  # the second step runs from a non-trivial ISA state
        x.grad = None
        loss.proxies.grad = None
        value = _call(loss, x, LABELS)
        assert value.dim() == 0 and torch.isfinite(value)
        value.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    g = loss.proxies.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


@pytest.mark.parametrize("name, wrapped", PARAMS, ids=IDS)
def test_state_dict_round_trip(name, wrapped):
    a = _make(name, wrapped, seed=0)
    if hasattr(a, "set_epoch"):
        a.set_epoch(3)
    x = _x()
    _call(a, x, LABELS)  # some state (ISA) and generator use (PS)
    b = _make(name, wrapped, seed=1)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert not torch.equal(_make(name, wrapped, seed=1).proxies, a.proxies)
    x2 = _x() * 0.5 + 1.0
    for _ in range(2):
        assert _call(a, x2, LABELS).item() == _call(b, x2, LABELS).item()
    if wrapped:  # lambda drawn from the restored generator
        assert a(x2, LABELS).item() == b(x2, LABELS).item()


@pytest.mark.parametrize("name, wrapped", PARAMS, ids=IDS)
def test_dtypes_agree(name, wrapped):
    base = _make(name, wrapped).eval()  # eval: no ISA update between the calls
    x64 = _x(torch.float64)
    l64 = _call(copy.deepcopy(base).double(), x64, LABELS)
    l32 = _call(copy.deepcopy(base), x64.float(), LABELS)
    # bf16 values as an autocast network hands them over: upcast, the loss in float32
    x16 = x64.to(torch.bfloat16)
    l16_plain = _call(copy.deepcopy(base), x16.float(), LABELS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = copy.deepcopy(base)
        xb = x64.float().requires_grad_()
        lbf = _call(m, xb, LABELS)
        lbf2 = _call(m, x16, LABELS)
    lbf.backward()
    assert l64.dtype == torch.float64 and l32.dtype == torch.float32 and lbf.dtype == torch.float32
    assert lbf2.dtype == torch.float32
    assert torch.isfinite(xb.grad).all() and torch.isfinite(m.proxies.grad).all()
    assert l32.item() == pytest.approx(l64.item(), rel=1e-5)
    # Inside autocast the loss runs in float32 all the way (tests/proxies/test_losses_autocast.py
    # checks the gradients): the same number as outside.
    assert lbf.item() == pytest.approx(l32.item(), rel=1e-6, abs=1e-6)
    assert lbf2.item() == pytest.approx(l16_plain.item(), rel=1e-6, abs=1e-6)
    assert lbf2.item() == pytest.approx(l64.item(), rel=0.05)  # only the bf16 input rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alpha_32_safe_under_autocast_with_extreme_cosines(dtype):
    """Embeddings on (or opposite) their proxies: exp(alpha (S + delta)) would overflow bf16
    and fp16; inside autocast the loss still runs in float32 and equals the plain call."""
    loss = build_loss({"name": "proxy_anchor"}, C, D)
    x = torch.cat([loss.proxies.detach()[:5], -loss.proxies.detach()[:5]]) * 100
    y = torch.tensor([0, 1, 2, 3, 4, 1, 2, 3, 4, 0])
    with torch.autocast("cpu", dtype=dtype):
        value = loss(x, y)
    assert torch.isfinite(value) and value.dtype == torch.float32
    assert value.item() == pytest.approx(loss(x, y).item(), rel=1e-6, abs=1e-6)
