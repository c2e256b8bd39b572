"""ProxyNCA++ proxies start as in the authors' code: randn(C, d) / 8, from the given generator,
and a class shard holds exactly the same rows of that draw."""

from __future__ import annotations

import math

import pytest
import torch

import proxies.base as pbase
from proxies import ShardContext, build_loss


def _nca_pp(c: int, d: int, seed: int | None = 5, shard: ShardContext | None = None) -> torch.Tensor:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return build_loss({"name": "proxy_nca_pp"}, c, d, generator=gen, shard=shard).proxies.detach()


def test_equals_randn_over_8_of_the_generator():
    for c, d in [(7, 6), (100, 33), (3, 1)]:
        expected = torch.randn(c, d, generator=torch.Generator().manual_seed(5)) / 8
        assert torch.equal(_nca_pp(c, d), expected)


def test_statistics_of_randn_over_8():
    c, d = 2000, 512
    w = _nca_pp(c, d, seed=11)
    n = w.numel()
    # Entries N(0, 1/64): mean within 5 standard errors, std within 1 %.
    assert abs(w.mean().item()) < 5 * (1 / 8) / math.sqrt(n)
    assert w.std().item() == pytest.approx(1 / 8, rel=0.01)
    # Row norms: about sqrt(d) / 8 (2.83 here; 5.7 at d = 2048), with a small spread
    # (std of a chi_d over 8: about 1 / (8 sqrt(2)) = 0.088).
    norms = w.norm(dim=1)
    assert norms.mean().item() == pytest.approx(math.sqrt(d) / 8, rel=0.01)
    assert norms.std().item() == pytest.approx(1 / (8 * math.sqrt(2)), rel=0.1)
    # Not the Kaiming-uniform init of Norm-Softmax / classic ProxyNCA (|w| <= 1/sqrt(d)).
    assert w.abs().max().item() > 1 / math.sqrt(d)


def test_no_global_rng_and_default_seed():
    state = torch.get_rng_state()
    a = _nca_pp(9, 4, seed=None)
    assert torch.equal(torch.get_rng_state(), state)
    expected = torch.randn(9, 4, generator=torch.Generator().manual_seed(pbase.DEFAULT_INIT_SEED)) / 8
    assert torch.equal(a, expected)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("c, d", [(11, 6), (40, 5), (7, 33)])
def test_shard_rows_equal_the_full_init(monkeypatch, world, c, d):
    """Each shard equals the same rows of the W = 1 init (exactly), also when the draw is
    split into many blocks with ragged ends."""
    monkeypatch.setattr(pbase, "_INIT_BLOCK_ELEMS", 64)
    full = _nca_pp(c, d)
    rows = []
    for rank in range(world):
        shard = ShardContext(c, rank, world)
        part = _nca_pp(c, d, shard=shard)
        assert part.shape == (shard.num_local, d)
        assert torch.equal(part, full[shard.class_start : shard.class_end])
        rows.append(part)
    assert torch.equal(torch.cat(rows), full)


def test_classic_proxy_nca_keeps_its_init():
    """Only ProxyNCA++ changed: classic ProxyNCA keeps nn.Linear's Kaiming-uniform init."""
    d = 16
    w = build_loss({"name": "proxy_nca"}, 50, d, generator=torch.Generator().manual_seed(5)).proxies.detach()
    assert w.abs().max().item() <= 1 / math.sqrt(d)
