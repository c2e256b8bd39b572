"""Agreement with pytorch-metric-learning where docs/losses.md says the losses are equal."""

from __future__ import annotations

import pytest
import torch

from proxies import NormSoftmaxLoss, ProxyAnchorLoss, ProxyNCAPlusPlusLoss
from tests.reference.problems import random_problem

pml = pytest.importorskip("pytorch_metric_learning.losses")


def _pair(ours, theirs, weight_name, transpose):
    x, p, y = random_problem(0, 12, 7, 5, absent=2, dtype=torch.float32)
    with torch.no_grad():
        ours.proxies.copy_(p)
        getattr(theirs, weight_name).copy_(p.t() if transpose else p)
    return ours(x, y).item(), theirs(x, y).item()


def test_proxy_anchor_equals_pml():
    a, b = _pair(ProxyAnchorLoss(7, 5), pml.ProxyAnchorLoss(7, 5, margin=0.1, alpha=32), "proxies", False)
    assert a == pytest.approx(b, rel=1e-5)


def test_norm_softmax_equals_pml():
    a, b = _pair(NormSoftmaxLoss(7, 5), pml.NormalizedSoftmaxLoss(7, 5, temperature=1 / 23), "W", True)
    assert a == pytest.approx(b, rel=1e-5)


def test_proxy_nca_pp_equals_pml():
    a, b = _pair(ProxyNCAPlusPlusLoss(7, 5), pml.ProxyNCALoss(7, 5, softmax_scale=9), "proxies", False)
    assert a == pytest.approx(b, rel=1e-5)
