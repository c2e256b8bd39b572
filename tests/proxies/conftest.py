"""Shared fixtures of the loss tests: the docs/losses.md known inputs, small random problems."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The references live in tests/reference (not a package of the project); make the repo root
# importable however pytest was started.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

torch.set_num_threads(1)  # shared 2-core machines: tiny problems, no thread pool contention


from tests.reference.problems import known_inputs  # noqa: E402


@pytest.fixture
def known() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return known_inputs()
