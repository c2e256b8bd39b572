"""Class sharding without processes: ranges, label localisation, shard-wise init, the kernels
with labels owned elsewhere, and resharding of checkpoint states (W = 2 -> 1 and 3)."""

from __future__ import annotations

import pytest
import torch

import proxies.base as pbase
from proxies import (
    ShardContext,
    anchor_terms,
    build_loss,
    load_shard_states,
    shard_state_dict,
    softmax_terms,
    split_range,
)
from proxies.softmax import kaiming_uniform_linear_

torch.set_num_threads(1)


def test_split_range_is_contiguous_and_balanced():
    for n, w in [(11, 2), (11, 4), (5, 5), (200_000, 3), (7, 1)]:
        parts = [split_range(n, r, w) for r in range(w)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert [e - s for s, e in parts] == [n // w + (r < n % w) for r in range(w)]


def test_shard_context_validates_and_localizes():
    with pytest.raises(ValueError, match="C >= W"):
        ShardContext(3, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        ShardContext(8, 2, 2)
    sc = ShardContext(11, 1, 2)  # classes [6, 11)
    assert (sc.class_start, sc.class_end, sc.num_local) == (6, 11, 5)
    y = torch.tensor([0, 5, 6, 10, 7])
    assert sc.localize(y).tolist() == [-1, -1, 0, 4, 1]
    one = ShardContext(11)
    assert one.localize(y) is y and not one.sharded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c,d", [(37, 3), (100, 7), (5, 2), (33, 1), (301, 17)])
def test_shard_init_equals_rows_of_the_full_init(monkeypatch, dtype, c, d):
    monkeypatch.setattr(pbase, "_INIT_BLOCK_ELEMS", 64)  # many blocks, ragged ends
    fills = [lambda t, g: t.normal_(0.0, 0.3, generator=g), kaiming_uniform_linear_]
    for fill in fills:
        full = torch.empty(c, d, dtype=dtype)
        gen = torch.Generator().manual_seed(3)
        fill(full, gen)
        after = torch.rand(1, generator=gen)
        for w in (2, 3, 4):
            for r in range(w):
                s, e = split_range(c, r, w)
                gen_r = torch.Generator().manual_seed(3)
                out = pbase.fill_rows_(torch.empty(e - s, d, dtype=dtype), s, c, fill, gen_r)
                assert torch.equal(out, full[s:e])
                # the generator ends where one process' ends (Proxy Synthesis is seeded from it)
                assert torch.equal(torch.rand(1, generator=gen_r), after)


@pytest.mark.parametrize("name", ["proxy_anchor", "norm_softmax", "proxy_isa"])
def test_built_shards_hold_the_rows_of_the_full_loss(name):
    full = build_loss({"name": name}, 13, 8, generator=torch.Generator().manual_seed(1))
    for w in (2, 3):
        for r in range(w):
            sh = build_loss({"name": name}, 13, 8, generator=torch.Generator().manual_seed(1),
                            shard=ShardContext(13, r, w))
            s, e = split_range(13, r, w)
            assert torch.equal(sh.proxies.detach(), full.proxies.detach()[s:e])


def _problem(b=10, c=9, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    p = torch.randn(c, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (b,), generator=g)
    return x, p, y


@pytest.mark.parametrize("exclude", [False, True])
def test_softmax_terms_of_a_shard(exclude):
    """A shard's lse is the log-sum-exp over its columns only; pos is 0 where the label lives
    elsewhere; both sum back to the full terms."""
    x, p, y = _problem()
    full = softmax_terms(x, p, y, 9.0, exclude)
    lses, pos = [], torch.zeros_like(full.pos)
    for r in range(3):
        sc = ShardContext(9, r, 3)
        t = softmax_terms(x, p[sc.class_start : sc.class_end], sc.localize(y), 9.0, exclude)
        owned = sc.localize(y) >= 0
        assert (t.pos[~owned] == 0).all()
        lses.append(t.lse)
        pos += t.pos
    torch.testing.assert_close(torch.logsumexp(torch.stack(lses), 0), full.lse)
    torch.testing.assert_close(pos, full.pos)


def test_anchor_terms_of_a_shard_are_slices_of_the_full_terms():
    x, p, y = _problem(seed=1)
    full = anchor_terms(x, p, y, 32.0, 0.1)
    for r in range(3):
        sc = ShardContext(9, r, 3)
        s, e = sc.class_start, sc.class_end
        t = anchor_terms(x, p[s:e], sc.localize(y), 32.0, 0.1)
        for name in ("q_pos", "q_neg", "n_pos", "n_neg", "w_pos", "w_neg"):
            torch.testing.assert_close(getattr(t, name), getattr(full, name)[s:e])


def test_gradients_of_a_shard_with_foreign_labels_are_finite_and_exact():
    """Classic ProxyNCA on a one-class shard whose class is some row's positive: that row has
    no column at all here (lse = -inf); the backward must give 0 there, not nan."""
    x, p, y = _problem(c=5, seed=2)
    y[0] = 4
    sc = ShardContext(5, 3, 4)  # classes [4, 5): one class
    pp = p[4:5].clone().requires_grad_()
    xx = x.clone().requires_grad_()
    t = softmax_terms(xx, pp, sc.localize(y), 18.0, True)
    assert torch.isinf(t.lse[0]) and t.lse[0] < 0
    weights = torch.where(torch.isfinite(t.lse), torch.exp(t.lse.clamp_min(-50)), 0.0)
    (weights.sum() + t.pos.sum()).backward()
    assert torch.isfinite(xx.grad).all() and torch.isfinite(pp.grad).all()


def _trained_state(loss, steps=2):
    """A few updates so that every kind of state is non-trivial (proxies, ISA, optimiser)."""
    opt = torch.optim.Adam(loss.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x = torch.randn(12, 8, generator=g)
        y = torch.randint(0, 13, (12,), generator=g)
        opt.zero_grad()
        loss(x, y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("spec", [
    {"name": "proxy_isa", "memory_size": 20},
    {"name": "norm_softmax", "synthesis": {"enabled": True}},
])
def test_shard_states_reshard_from_two_to_one_and_three(spec):
    # One process trains; its state is cut into W = 2 shard states as two ranks would write
    # them (same values: the distributed tests show the ranks hold exactly these rows).
    full = build_loss(spec, 13, 8, generator=torch.Generator().manual_seed(1))
    for m in full.modules():
        if hasattr(m, "set_epoch"):
            m.set_epoch(5, memory_start_epoch=0)
    opt = _trained_state(full)
    full_sd = full.state_dict()
    states = []
    for r in range(2):
        sh = build_loss(spec, 13, 8, generator=torch.Generator().manual_seed(1), shard=ShardContext(13, r, 2))
        s, e = split_range(13, r, 2)
        per_class = {k for k in full_sd if k.split(".")[-1] in ("proxies", "count", "effective_num", "learned_sim")}
        sh.load_state_dict({k: (v[s:e] if k in per_class else v) for k, v in full_sd.items()})
        sh_opt = torch.optim.Adam(sh.parameters(), lr=0.1)
        st = opt.state[full.proxies]
        sh_opt.state[sh.proxies] = {k: (v[s:e] if v.dim() else v) for k, v in st.items()}
        states.append(shard_state_dict(sh, sh_opt))
    assert "memory.embeddings" not in states[1] and states[1]["_shard"]["replicated"] is False

    for w in (1, 3):
        for r in range(w):
            target = build_loss(spec, 13, 8, generator=torch.Generator().manual_seed(99),
                                shard=ShardContext(13, r, w))
            optim = load_shard_states(target, states[::-1])  # order does not matter
            s, e = split_range(13, r, w)
            for k, v in target.state_dict().items():
                want = full_sd[k]
                if isinstance(v, torch.Tensor) and k.split(".")[-1] in ("proxies", "count", "effective_num",
                                                                        "learned_sim"):
                    want = want[s:e]
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, want), k
            name = "base.proxies" if "synthesis" in spec else "proxies"
            for k, v in opt.state[full.proxies].items():
                assert torch.equal(optim[name][k], v[s:e] if v.dim() else v), k


def test_load_shard_states_rejects_incomplete_checkpoints():
    shards = [build_loss({"name": "proxy_anchor"}, 9, 4, shard=ShardContext(9, r, 3)) for r in range(3)]
    states = [shard_state_dict(s) for s in shards]
    target = build_loss({"name": "proxy_anchor"}, 9, 4)
    with pytest.raises(ValueError, match="cover"):
        load_shard_states(target, states[:2])
    with pytest.raises(ValueError, match="replicated"):
        load_shard_states(target, states[1:] + [shard_state_dict(shards[0], include_replicated=False)])
    other = build_loss({"name": "proxy_anchor"}, 10, 4)
    with pytest.raises(ValueError, match="num_classes"):
        load_shard_states(other, states)
    # A legacy single-process state (no shard metadata) is the whole class range.
    legacy = build_loss({"name": "proxy_anchor"}, 9, 4, generator=torch.Generator().manual_seed(4))
    load_shard_states(shards[1], [legacy.state_dict()])
    assert torch.equal(shards[1].proxies, legacy.proxies[3:6])
