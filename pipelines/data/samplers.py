"""Batch samplers that produce the same *global* batches whatever the number of workers.

Each global batch is drawn from a generator seeded by ``(seed, epoch)``; rank ``r`` of ``W``
takes the contiguous slice ``[r*B/W, (r+1)*B/W)``. That is what makes a W=2 run see exactly
the samples of a W=1 run (the distributed equivalence tests rely on it) and what lets a run
resume on a different number of workers.

Augmentation randomness follows the same rule: :class:`SeededBatches` gives every sample the
seed ``sample_seed(seed, epoch, global position)`` and :class:`SeededSamples` draws its random
crop and flip from that seed alone. Sample ``i`` of the global batch stream is then augmented
identically for any number of workers, any number of DataLoader processes, and after a resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset


class BatchSampler(Protocol):
    """A rank's view of the global batch stream (its slice of every global batch)."""

    batch_size: int  # global
    rank: int
    world_size: int
    seed: int
    epoch: int

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[list[int]]: ...
    def __len__(self) -> int: ...


class _RankSlicer:
    """Rank ``r`` of ``W`` takes the contiguous slice ``[r*B/W, (r+1)*B/W)`` of each global batch."""

    def __init__(self, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch size {batch_size} is not divisible by {world_size} workers")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _generator(self) -> torch.Generator:
        g = torch.Generator()
        # Distinct, reproducible stream per epoch; the large odd multiplier spreads seeds.
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        return g

    def _slice(self, batch: list[int]) -> list[int]:
        per_rank = self.batch_size // self.world_size
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]


class ShuffleBatchSampler(_RankSlicer):
    """Plain shuffling; the last incomplete global batch is dropped."""

    def __init__(self, n: int, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0):
        super().__init__(batch_size, rank, world_size, seed)
        if n < batch_size:
            raise ValueError(f"dataset of {n} items is smaller than one batch of {batch_size}")
        self.n = n

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self._generator()).tolist()
        for b in range(len(self)):
            yield self._slice(order[b * self.batch_size : (b + 1) * self.batch_size])


class ClassBalancedBatchSampler(_RankSlicer):
    """``batch_size / samples_per_class`` classes x ``samples_per_class`` samples per batch.

    As in ProxyNCA++ / Proxy-Anchor: classes are visited in a shuffled order, each taking
    ``samples_per_class`` of its (shuffled) samples, with replacement when a class is small.
    One epoch has about ``N / batch_size`` batches.
    """

    def __init__(
        self,
        labels: list[int],
        batch_size: int,
        samples_per_class: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, rank, world_size, seed)
        if batch_size % samples_per_class:
            raise ValueError(f"batch size {batch_size} is not a multiple of {samples_per_class}")
        self.samples_per_class = samples_per_class
        self.classes_per_batch = batch_size // samples_per_class
        labels_t = torch.as_tensor(labels, dtype=torch.long)
        self.classes = torch.unique(labels_t).tolist()
        if len(self.classes) < self.classes_per_batch:
            raise ValueError(
                f"{self.classes_per_batch} classes per batch requested but the dataset has "
                f"{len(self.classes)}"
            )
        self.by_class = {c: torch.nonzero(labels_t == c).flatten() for c in self.classes}
        self.n = len(labels)

    def __len__(self) -> int:
        return max(1, self.n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        g = self._generator()
        queue: list[int] = []
        for _ in range(len(self)):
            batch: list[int] = []
            chosen: set[int] = set()
            while len(chosen) < self.classes_per_batch:
                if not queue:
                    queue = [self.classes[i] for i in torch.randperm(len(self.classes), generator=g)]
                c = queue.pop()
                if c in chosen:  # distinct classes within one batch; c comes back next pass
                    continue
                chosen.add(c)
                idx = self.by_class[c]
                if len(idx) >= self.samples_per_class:
                    pick = idx[torch.randperm(len(idx), generator=g)[: self.samples_per_class]]
                else:
                    pick = idx[torch.randint(len(idx), (self.samples_per_class,), generator=g)]
                batch.extend(pick.tolist())
            yield self._slice(batch)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of the sample at global ``position`` of epoch ``epoch`` (a 63-bit int).

    A multiplicative mix keeps nearby (seed, epoch, position) triples apart; Mersenne
    Twister's seeding scrambles the rest.
    """
    return ((seed * 1_000_003 + epoch) * 2_654_435_761 + position) % (2**63 - 1)


class SeededBatches:
    """A rank's batch sampler whose items are ``(dataset index, augmentation seed)`` pairs.

    The seed comes from the sample's position in the *global* batch stream, not from the
    rank or the loader process that reads it.
    """

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s = self.sampler
        per_rank = s.batch_size // s.world_size
        for step, batch in enumerate(s):
            first = step * s.batch_size + s.rank * per_rank
            yield [(i, sample_seed(s.seed, s.epoch, first + j)) for j, i in enumerate(batch)]


class SeededSamples(Dataset):
    """Reads ``dataset[index]`` with the CPU RNG seeded by the item's augmentation seed.

    torchvision's random transforms draw from the global CPU generator; it is forked around
    each read, so the process's own stream (and CUDA's) is left exactly as it was.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int]) -> Any:
        index, seed = item
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]
