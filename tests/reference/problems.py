"""Inputs of the loss tests: the docs/losses.md known values' inputs and small random problems."""

from __future__ import annotations

import math

import torch


def known_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X (8, 16), P (5, 16), y (8,) of docs/losses.md 'Known values', float64."""
    x = torch.tensor(
        [[math.sin(0.5 + 0.7 * i + 1.3 * j) + 0.3 * math.cos(1.0 + i * j) for j in range(16)] for i in range(8)],
        dtype=torch.float64,
    )
    p = torch.tensor(
        [[math.sin(3 + 0.7 * c + 1.3 * j) + 0.3 * math.cos(6 + c * j) for j in range(16)] for c in range(5)],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 1, 2, 0, 1, 3, 0, 2])
    return x, p, y


def random_problem(seed: int, b: int, c: int, d: int, absent: int = 0, dtype=torch.float64):
    """x (b, d), p (c, d), y (b,) with the last ``absent`` classes missing from the batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=dtype) * 2.0
    p = torch.randn(c, d, generator=g, dtype=dtype)
    y = torch.randint(0, c - absent, (b,), generator=g)
    return x, p, y


def distinct_neighbours(seed: int, b: int, c: int) -> torch.Tensor:
    """Labels (b,) in [0, c) whose cyclic neighbours differ (c >= 3)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        y = torch.randint(0, c, (b,), generator=g)
        if not bool((y == y.roll(1)).any()):
            return y
