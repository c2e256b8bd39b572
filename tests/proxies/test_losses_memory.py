"""The ring-buffer memory queue."""

from __future__ import annotations

import io

import pytest
import torch

from proxies import MemoryQueue


def _rows(start: int, n: int, dim: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    lab = torch.arange(start, start + n)
    return lab[:, None].float().expand(n, dim).clone(), lab


def test_fill_and_get():
    q = MemoryQueue(5, 3)
    assert len(q) == 0 and q.get()[0].shape == (0, 3)
    q.enqueue(*_rows(0, 3))
    f, lab = q.get()
    assert lab.tolist() == [0, 1, 2] and f[:, 0].tolist() == [0, 1, 2]
    assert int(q.ptr) == 3


def test_ring_wrap_around():
    q = MemoryQueue(5, 3)
    q.enqueue(*_rows(0, 3))
    q.enqueue(*_rows(3, 4))  # 3, 4 fill the end; 5, 6 overwrite 0, 1
    f, lab = q.get()
    assert lab.tolist() == [5, 6, 2, 3, 4]
    assert f[:, 1].tolist() == [5, 6, 2, 3, 4]
    assert len(q) == 5 and int(q.ptr) == 2


def test_batch_larger_than_queue_keeps_the_newest():
    q = MemoryQueue(4, 3)
    q.enqueue(*_rows(0, 1))
    q.enqueue(*_rows(1, 10))  # same as one by one: the last four, 7..10
    f, lab = q.get()
    assert sorted(lab.tolist()) == [7, 8, 9, 10]
    sequential = MemoryQueue(4, 3)
    for i in range(11):
        sequential.enqueue(*_rows(i, 1))
    assert torch.equal(sequential.labels, q.labels) and torch.equal(sequential.ptr, q.ptr)


def test_state_dict_round_trip():
    q = MemoryQueue(6, 3)
    q.enqueue(*_rows(0, 8))
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    r = MemoryQueue(6, 3)
    r.load_state_dict(torch.load(buf))
    for a, b in zip(q.get(), r.get()):
        assert torch.equal(a, b)
    assert int(r.ptr) == int(q.ptr) and len(r) == len(q)
    q.enqueue(*_rows(100, 2))
    r.enqueue(*_rows(100, 2))
    assert torch.equal(q.labels, r.labels)


def test_detached_and_validated():
    q = MemoryQueue(4, 2)
    x = torch.randn(2, 2, requires_grad=True)
    q.enqueue(x, torch.tensor([0, 1]))
    assert not q.embeddings.requires_grad
    with pytest.raises(ValueError):
        q.enqueue(torch.randn(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        MemoryQueue(0, 2)
