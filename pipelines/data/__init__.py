"""Datasets and batch samplers.

Every dataset yields ``(image: FloatTensor[C, H, W], label: int, index: int)``. Training labels
are contiguous ``0..C-1`` (they index the proxies); evaluation labels only need to compare
equal within the evaluation set. ``build_datasets`` is the one entry point the train loop uses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.samplers import (
    BatchSampler,
    ClassBalancedBatchSampler,
    SeededBatches,
    SeededSamples,
    ShuffleBatchSampler,
    sample_seed,
)
from pipelines.data.types import (
    DataError,
    DataSplit,
    TensorImageDataset,
    check_split,
    class_names,
    dataset_labels,
    default_root,
)

if TYPE_CHECKING:  # the config imports DATASETS to check data.name: no import back at run time
    from pipelines.config import DataConfig

# The loaders import their modules when called: torchvision and PIL cost ~1.3 s of start-up
# that `proxydml --help`, `stack` and `config` never need.


def digits_file() -> Path:
    """scikit-learn's copy of the digits table, found without importing scikit-learn.

    ``sklearn.datasets.load_digits`` reads this same file, but importing ``sklearn.datasets``
    costs ~1.7 CPU-s (measured: 2.0 CPU-s for import and load against 0.3 CPU-s for this
    read), paid by every Train worker and trial of a digits run.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DataError("data.name=digits needs scikit-learn installed (it ships the digits table)")
    return Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"


def _digits(cfg: DataConfig) -> DataSplit:
    """scikit-learn's 8x8 handwritten digits: train on 0-4, evaluate on the unseen 5-9."""
    from pipelines.data.transforms import eval_size

    table = np.loadtxt(digits_file(), delimiter=",")  # 1797 rows: 64 pixels (0-16), then the label
    images = torch.tensor(table[:, :-1].reshape(-1, 1, 8, 8), dtype=torch.float32) / 16.0
    labels = torch.tensor(table[:, -1], dtype=torch.long)
    def at(size: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(x, size=size, mode="bilinear") if size and size != 8 else x

    seen = labels < 5
    return DataSplit(
        train=TensorImageDataset(at(cfg.image_size, images[seen]), labels[seen], "digits/train"),
        test=TensorImageDataset(at(eval_size(cfg, cfg.image_size or 8), images[~seen]), labels[~seen], "digits/test"),
        num_classes=5,
    )


def _folder(cfg: DataConfig) -> DataSplit:
    from pipelines.data.folder import image_folder

    train, test = image_folder(cfg)
    return DataSplit(train=train, test=test, num_classes=len(train.classes))


def _emoji(cfg: DataConfig) -> DataSplit:
    from pipelines.data.emoji import emoji_split

    return emoji_split(cfg)


def _standard(name: str):
    def load(cfg: DataConfig) -> DataSplit:
        from pipelines.data import standard

        return getattr(standard, name)(cfg)

    load.__name__ = f"_{name}"
    return load


DATASETS = {
    "digits": _digits,
    "folder": _folder,
    "emoji": _emoji,
    **{name: _standard(name) for name in ("cub", "cars", "sop", "inshop")},
}


# Data sets read from a folder (``data.root``, default ``./data/<name>``): all but the in-memory digits.
FILE_DATASETS = tuple(name for name in DATASETS if name != "digits")


# ``data.root`` values ``<scheme>://...`` (object storage) are read from a local copy that a
# resolver registered for the scheme provides: services/ registers ``s3`` (a per-node cache,
# services/snapshots.py). The pipeline itself never talks to the storage.
RootResolver = Callable[[str], "str | Path"]
_ROOT_RESOLVERS: dict[str, RootResolver] = {}


def register_root_resolver(scheme: str, resolve: RootResolver) -> None:
    """Read ``data.root=<scheme>://...`` from the local folder ``resolve(root)`` returns; it raises
    DataError naming the file when the data cannot be fetched or verified."""
    _ROOT_RESOLVERS[scheme] = resolve


def with_local_root(cfg: DataConfig) -> DataConfig:
    """``cfg`` with a remote ``data.root`` replaced by its local copy (see :func:`register_root_resolver`).

    Only the data loaders see the local path: the config that is logged, hashed into the run
    name and stored with checkpoints keeps the remote URI, the same on every node.
    """
    if cfg.name not in FILE_DATASETS or "://" not in cfg.root:
        return cfg
    scheme = cfg.root.split("://", 1)[0]
    if scheme not in _ROOT_RESOLVERS:
        raise DataError(f"data.root={cfg.root}: no reader for {scheme}:// data in this process "
                        "(the proxydml commands provide one for s3://)")
    return dataclasses.replace(cfg, root=str(_ROOT_RESOLVERS[scheme](cfg.root)))


def with_absolute_root(cfg: DataConfig) -> DataConfig:
    """``cfg`` with a relative ``data.root`` (or the default ``./data/<name>``) made absolute.

    Ray Train workers run in their own folders, not where ``proxydml`` was started, so a
    relative root must be resolved once on the driver before the config is shipped. The
    resolved path is part of the run hash: the same command from the same folder gives the
    same run name.
    """
    if cfg.name not in FILE_DATASETS or "://" in cfg.root or (cfg.name == "folder" and not cfg.root):
        return cfg  # a folder data set without a root fails later with its own message
    root = default_root(cfg)
    return cfg if root.is_absolute() else dataclasses.replace(cfg, root=str(root.resolve()))


def check_training_classes(split: DataSplit, cfg: DataConfig) -> list[int]:
    """Training classes with a single image: refused under class-balanced sampling.

    With ``samples_per_class`` n >= 2 such a class would fill its n slots with copies of one
    image (positives that teach nothing), so it is an error naming the classes. With plain
    shuffling a proxy loss can still use it; the classes are returned (and printed) so that
    nothing is skipped or kept silently.
    """
    counts: dict[int, int] = {}
    for y in dataset_labels(split.train):
        counts[y] = counts.get(y, 0) + 1
    single = sorted(c for c, n in counts.items() if n == 1)
    if single and cfg.samples_per_class >= 2:
        names = getattr(split.train, "classes", None)
        shown = [str(names[c]) if names is not None and c < len(names) else str(c) for c in single[:5]]
        raise DataError(
            f"dataset {cfg.name!r}: {len(single)} training class(es) have a single image "
            f"(e.g. {', '.join(shown)}); data.samples_per_class={cfg.samples_per_class} needs >= 2 "
            "images per class: remove them or set data.samples_per_class=0"
        )
    return single


# Fixed, not train.seed: runs with different seeds must be scored on the same held-out classes.
VAL_SEED = 0


def hold_out_classes(split: DataSplit, n: int, name: str) -> DataSplit:
    """Evaluate on ``n`` held-out seen classes instead of the unseen ones (``data.val_classes``).

    The classes are one seeded draw (``VAL_SEED``), whatever the run's seed. Training keeps the
    other seen classes, relabelled ``0..C-n-1``. The held-out images are read with the
    evaluation transform of the unseen set (resize + centre crop at the evaluation size), so a
    validation score measures what a test score would, on classes the test never uses.
    In-Shop's query/gallery split does not carry over: the held-out set is scored all-vs-all.
    """
    labels = torch.tensor(dataset_labels(split.train))
    c = split.num_classes
    if not 2 <= n <= c - 2:
        raise DataError(
            f"data.val_classes={n}: dataset {name!r} has {c} seen classes; hold out between 2 and {c - 2} "
            "so that both training and validation keep >= 2 classes"
        )
    held = torch.zeros(c, dtype=torch.bool)
    held[torch.randperm(c, generator=torch.Generator().manual_seed(VAL_SEED))[:n]] = True
    keep = (~held).nonzero().squeeze(1)
    relabel = torch.full((c,), -1, dtype=torch.long)
    relabel[keep] = torch.arange(len(keep))
    tr = (~held[labels]).nonzero().squeeze(1).tolist()
    va = held[labels].nonzero().squeeze(1).tolist()
    train, test = split.train, split.test
    if isinstance(train, TensorImageDataset):
        images = train.images[va]
        if isinstance(test, TensorImageDataset) and test.images.shape[-2:] != images.shape[-2:]:
            images = torch.nn.functional.interpolate(images, size=tuple(test.images.shape[-2:]), mode="bilinear")
        new_train: Dataset = TensorImageDataset(train.images[tr], relabel[labels[tr]], f"{train.name}/train")
        val: Dataset = TensorImageDataset(images, labels[va], f"{train.name}/val")
    elif hasattr(train, "samples") and hasattr(test, "transform"):
        from pipelines.data.transforms import ImageListDataset

        names = list(getattr(train, "classes", [str(i) for i in range(c)]))
        samples = [(Path(p), int(y)) for p, y in train.samples]
        base = getattr(train, "name", name)
        new_train = ImageListDataset([(samples[i][0], int(relabel[samples[i][1]])) for i in tr], train.transform,
                                     f"{base}-val{n}", classes=[names[k] for k in keep.tolist()])
        val = ImageListDataset([samples[i] for i in va], test.transform, f"{base}/val{n}", classes=names)
    else:
        raise DataError(f"data.val_classes: dataset {name!r} ({type(train).__name__}) cannot hold out classes")
    groups = split.train_groups
    return DataSplit(
        train=new_train, test=val, num_classes=len(keep),
        test_groups=[groups[i] for i in va] if groups is not None else None,
        train_groups=[groups[i] for i in tr] if groups is not None else None,
    )


def build_datasets(cfg: DataConfig) -> DataSplit:
    """Build the train/eval split named by ``cfg.name`` and check it.

    With ``data.val_classes`` > 0 the evaluation set is a held-out part of the seen classes
    (``hold_out_classes``); the unseen classes are then not read at all. A remote ``data.root``
    is read from its local copy (:func:`with_local_root`).
    """
    cfg = with_local_root(cfg)
    split = check_split(DATASETS[cfg.name](cfg), cfg.name)
    if cfg.val_classes:
        split = check_split(hold_out_classes(split, cfg.val_classes, cfg.name), cfg.name)
    single = check_training_classes(split, cfg)
    if single:
        print(f"note: dataset {cfg.name!r}: {len(single)} training class(es) have a single image (kept)")
    return split


def build_batch_sampler(
    labels: list[int], cfg: DataConfig, *, rank: int, world_size: int, seed: int
) -> BatchSampler:
    """The per-rank view of the global batch stream (same global batches for any W)."""
    if cfg.samples_per_class:
        return ClassBalancedBatchSampler(
            labels, cfg.batch_size, cfg.samples_per_class, rank=rank, world_size=world_size, seed=seed
        )
    return ShuffleBatchSampler(len(labels), cfg.batch_size, rank=rank, world_size=world_size, seed=seed)


__all__ = [
    "DATASETS",
    "FILE_DATASETS",
    "default_root",
    "BatchSampler",
    "ClassBalancedBatchSampler",
    "DataError",
    "DataSplit",
    "SeededBatches",
    "SeededSamples",
    "ShuffleBatchSampler",
    "sample_seed",
    "TensorImageDataset",
    "build_batch_sampler",
    "build_datasets",
    "check_split",
    "class_names",
    "check_training_classes",
    "dataset_labels",
    "hold_out_classes",
    "register_root_resolver",
    "with_local_root",
]
