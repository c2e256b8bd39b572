"""Called inside an autocast region, every loss computes exactly what it computes in float32.

The losses turn autocast off at their entry points and upcast half / bfloat16 inputs, and run
their GEMMs in float32 too. With bf16 GEMMs (the previous design) the fused backward of
Norm-Softmax and ProxyNCA++ near convergence had relative gradient errors of 1e3 to 5e4
against float32 (C = 100, d = 128, B = 64, x = p̂[y] + noise), and float16 gave inf / NaN:
the dense part of ``softmax - onehot`` goes through the GEMM and nearly cancels the exact
positive part. Here loss and gradients must equal the plain float32 call to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

from proxies import LOSSES, ProxySynthesis, anchor_terms, build_loss, cosine_similarity, softmax_terms

C, D, B = 50, 64, 32
TOL = {"rtol": 1e-6, "atol": 1e-6}
AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]

PARAMS = [(n, w) for n in LOSSES for w in (False, True)]
IDS = [f"{n}{'+ps' if w else ''}" for n, w in PARAMS]


def _make(name: str, wrapped: bool) -> torch.nn.Module:
    cfg: dict = {"name": name}
    if name == "proxy_isa":
        cfg["memory_size"] = 256
    if wrapped:
        cfg["synthesis"] = {"enabled": True, "alpha": 0.4, "mu": 1.0}
    loss = build_loss(cfg, C, D, generator=torch.Generator().manual_seed(0))
    if hasattr(loss, "set_epoch"):
        loss.set_epoch(3)  # Proxy-ISA: memory and filter on (others: no-op)
    return loss


def _inputs(loss: torch.nn.Module, near: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, d) float32 and labels (B,): generic, or near convergence (x = p[y] + 0.01 noise)."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, C, (B,), generator=g)
    noise = torch.randn(B, D, generator=g)
    if near:
        return loss.proxies.detach()[y] + 0.01 * noise, y
    return 3.0 * noise, y


def _step(loss: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: torch.dtype | None, inside: bool):
    """One training-mode call and backward; returns (loss, dL/dx, dL/dproxies)."""
    x = x.clone().requires_grad_()
    loss.proxies.grad = None
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        value = loss(x, y, lam=0.3) if isinstance(loss, ProxySynthesis) else loss(x, y)
        if inside:  # backward() inside the region must not change anything either
            value.backward()
    if not inside:
        value.backward()
    return value.detach(), x.grad, loss.proxies.grad


@pytest.mark.parametrize("inside", [False, True], ids=["backward-outside", "backward-inside"])
@pytest.mark.parametrize("near", [False, True], ids=["generic", "near-convergence"])
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, wrapped", PARAMS, ids=IDS)
def test_loss_and_gradients_inside_autocast_equal_float32(name, wrapped, dtype, near, inside):
    loss = _make(name, wrapped)
    x, y = _inputs(loss, near)
    ref, amp = loss, copy.deepcopy(loss)
    # Two steps: the second one runs from a non-trivial Proxy-ISA state (memory, E, S_learned).
    for _ in range(2):
        v32, gx32, gp32 = _step(ref, x, y, None, inside)
        v, gx, gp = _step(amp, x, y, dtype, inside)
        assert v.dtype == gx.dtype == gp.dtype == torch.float32
        assert torch.isfinite(v) and torch.isfinite(gx).all() and torch.isfinite(gp).all()
        assert gx32.abs().max() > 0 and gp32.abs().max() > 0
        torch.testing.assert_close(v, v32, **TOL)
        torch.testing.assert_close(gx, gx32, **TOL)
        torch.testing.assert_close(gp, gp32, **TOL)
    for key, value in ref.state_dict().items():  # Proxy-ISA state and the PS generator
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(amp.state_dict()[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, wrapped", PARAMS, ids=IDS)
def test_low_precision_embeddings_are_upcast(name, wrapped, dtype):
    """Half / bf16 embeddings (an autocast network's output): the float32 loss of the same
    values, inside autocast or not; the gradient comes back in the input's dtype."""
    loss = _make(name, wrapped).eval()
    x, y = _inputs(loss, near=True)
    x16 = x.to(dtype)
    ref = loss(x16.float(), y, lam=0.3) if wrapped else loss(x16.float(), y)
    for enabled in (False, True):
        xin = x16.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            value = loss(xin, y, lam=0.3) if wrapped else loss(xin, y)
        value.backward()
        assert value.dtype == torch.float32 and xin.grad.dtype == dtype
        torch.testing.assert_close(value.detach(), ref.detach(), **TOL)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_functional_entry_points_inside_autocast(dtype):
    """cosine_similarity, softmax_terms and anchor_terms: float32 GEMMs inside autocast."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(C, D, generator=g)
    y = torch.randint(0, C, (B,), generator=g)
    x = p[y] + 0.01 * torch.randn(B, D, generator=g)

    def run(enabled: bool) -> list[torch.Tensor]:
        xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            s = cosine_similarity(xx, pp)
            st = softmax_terms(xx, pp, y, 23.0)
            at = anchor_terms(xx, pp, y, 32.0, 0.1)
            total = (s * s).sum() + (st.lse - st.pos).mean() + at.q_pos.sum() + at.q_neg.sum()
            total.backward()  # inside: autocast is on in a custom backward called here
        return [s.detach(), total.detach(), xx.grad, pp.grad]

    for a, b in zip(run(True), run(False)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **TOL)
