"""The data package's types: what every loader returns and the one error it raises.

A module of its own so that the loaders (folder, emoji, standard benchmarks, transforms)
and the backbones import them without importing the package that dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from pipelines.config import DataConfig


class DataError(ValueError):
    """A dataset cannot be used as configured; the message names the file or the problem."""


class TensorImageDataset(Dataset):
    """In-memory images: ``images`` (N, C, H, W) float, ``labels`` (N,) long."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, name: str = "") -> None:
        if images.ndim != 4 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{name}: images must be (N, C, H, W) and labels (N,)")
        self.images = images
        self.labels = labels.long()
        self.name = name

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        return self.images[index], int(self.labels[index]), index

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()


@dataclass
class DataSplit:
    """Training set (seen classes) and evaluation set (unseen classes)."""

    train: Dataset
    test: Dataset
    num_classes: int
    # Optional In-Shop style split: indices into ``test`` used as queries / gallery.
    query_indices: list[int] | None = None
    gallery_indices: list[int] | None = None
    # Optional evaluation group of each ``test`` item (emoji: the design family). A report with
    # ``retrieval_metrics(..., exclude_same_group=(test_groups, None))`` then drops a query's own
    # group from its candidates (e.g. OpenMoji black when the query is OpenMoji colour).
    test_groups: list[int] | None = None
    # The same for each ``train`` item: kept for a validation split carved out of the seen classes.
    train_groups: list[int] | None = None


def dataset_labels(dataset: Dataset) -> list[int]:
    """Labels of a dataset without decoding its images."""
    targets = getattr(dataset, "targets", None)
    if targets is None:
        raise DataError(f"dataset {type(dataset).__name__} exposes no .targets")
    return list(targets)


def class_names(dataset: Dataset) -> list[str] | None:
    """The readable name of each label of ``dataset`` (index = label), if it knows them.

    Image folders and the standard benchmarks name classes by folder or id, the emoji set by
    the emoji's name; in-memory data sets (digits) have none.
    """
    names = getattr(dataset, "names", None) or getattr(dataset, "classes", None)
    return [str(n) for n in names] if names is not None else None


def check_split(split: DataSplit, name: str) -> DataSplit:
    """Refuse datasets that cannot train or evaluate a metric-learning model."""
    train_classes = set(dataset_labels(split.train))
    test_classes = set(dataset_labels(split.test))
    if len(train_classes) < 2:
        raise DataError(f"dataset {name!r}: training split has {len(train_classes)} class(es); need >= 2")
    if len(test_classes) < 2:
        raise DataError(f"dataset {name!r}: evaluation split has {len(test_classes)} class(es); need >= 2")
    if train_classes != set(range(split.num_classes)):
        raise DataError(f"dataset {name!r}: training labels must be 0..{split.num_classes - 1}")
    return split


def default_root(cfg: DataConfig) -> Path:
    """The folder a file data set is read from: ``data.root``, else ``./data/<data.name>``."""
    return Path(cfg.root or f"./data/{cfg.name}")
