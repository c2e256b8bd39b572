"""Batch samplers: the same global batches for any number of ranks; class balance."""

from __future__ import annotations

from collections import Counter

import pytest

from pipelines.data import ClassBalancedBatchSampler, ShuffleBatchSampler

LABELS = [i % 7 for i in range(140)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_partition_the_single_rank_batches(world):
    for make in (
        lambda r, w: ClassBalancedBatchSampler(LABELS, 16, 4, rank=r, world_size=w, seed=3),
        lambda r, w: ShuffleBatchSampler(len(LABELS), 16, rank=r, world_size=w, seed=3),
    ):
        single = make(0, 1)
        single.set_epoch(5)
        ranks = [make(r, world) for r in range(world)]
        for s in ranks:
            s.set_epoch(5)
        for whole, *parts in zip(single, *ranks):
            assert sum(parts, []) == whole


def test_class_balanced_batches_hold_distinct_classes_with_n_samples_each():
    sampler = ClassBalancedBatchSampler(LABELS, 16, 4, seed=0)
    batches = list(sampler)
    assert len(batches) == len(LABELS) // 16
    for batch in batches:
        counts = Counter(LABELS[i] for i in batch)
        assert len(counts) == 4 and set(counts.values()) == {4}


def test_epochs_differ_and_are_reproducible():
    a, b = ShuffleBatchSampler(100, 10, seed=1), ShuffleBatchSampler(100, 10, seed=1)
    a.set_epoch(0)
    b.set_epoch(0)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="not divisible by 3 workers"):
        ShuffleBatchSampler(100, 10, world_size=3)
    with pytest.raises(ValueError, match="classes per batch"):
        ClassBalancedBatchSampler([0, 0, 1, 1], 8, 2)
