"""The standard DML benchmarks, read from the layouts their archives unpack to.

No data is downloaded: users point ``data.root`` at their copy (default ``./data/<name>``).
Classes are split the conventional way (first half of the classes trains, the second half
is evaluated), and ``data.image_size`` 0 means 224.

========= ========================================================== =========================
name      files under data.root                                      split
========= ========================================================== =========================
cub       ``images.txt``, ``image_class_labels.txt``, ``images/``    classes 1-100 / 101-200
          (``classes.txt`` optional; root may also be its parent)
cars      ``cars_annos.mat`` (scipy.io), ``car_ims/``                classes 1-98 / 99-196
sop       ``Ebay_train.txt``, ``Ebay_test.txt``, the image folders   the files' own split
inshop    ``list_eval_partition.txt``, ``img/``                      train / query + gallery
========= ========================================================== =========================
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.config import DataConfig
from pipelines.data.transforms import ImageListDataset, eval_transform, train_transform
from pipelines.data.types import DataError, DataSplit, default_root

DEFAULT_SIZE = 224


def _root(cfg: DataConfig, marker: str, subfolders: tuple[str, ...] = ()) -> Path:
    """The dataset folder: ``data.root`` or ``./data/<data.name>``, or one of its ``subfolders``."""
    root = default_root(cfg)
    if not root.is_dir():
        raise DataError(f"data.root for {cfg.name}: {root} does not exist or is not a folder")
    for candidate in (root, *(root / s for s in subfolders)):
        if (candidate / marker).exists():
            return candidate
    return root


def _lines(path: Path) -> list[str]:
    """Non-empty lines of a split file; DataError naming the file if missing or unreadable."""
    if not path.is_file():
        raise DataError(f"split file {path} is missing")
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read split file {path}: {exc}") from exc


def _table(path: Path, columns: int, skip: int = 0) -> list[list[str]]:
    rows = []
    for n, line in enumerate(_lines(path)[skip:], start=skip + 1):
        parts = line.split()
        if len(parts) < columns:
            raise DataError(f"{path}, line {n}: expected {columns} columns, got {line!r}")
        rows.append(parts)
    return rows


def _datasets(
    cfg: DataConfig, name: str, train: list[tuple[Path, object]], test: list[tuple[Path, object]]
) -> tuple[ImageListDataset, ImageListDataset]:
    """Relabel each part to contiguous ids (sorted raw ids) and wrap it with its transform."""
    size = cfg.image_size or DEFAULT_SIZE
    out = []
    for part, items, tf in (
        ("train", train, train_transform(cfg, size)),
        ("test", test, eval_transform(cfg, size)),
    ):
        if not items:
            raise DataError(f"dataset {name!r}: the {part} split is empty")
        raw = sorted({y for _, y in items})
        label = {y: i for i, y in enumerate(raw)}
        out.append(ImageListDataset([(p, label[y]) for p, y in items], tf, f"{name}/{part}",
                                    classes=[str(y) for y in raw]))
    return out[0], out[1]


def _half_split(items: list[tuple[Path, int]]) -> tuple[list, list]:
    """First half of the (sorted) class ids trains, the rest is evaluated."""
    classes = sorted({y for _, y in items})
    seen = set(classes[: len(classes) // 2])
    return [it for it in items if it[1] in seen], [it for it in items if it[1] not in seen]


def cub(cfg: DataConfig) -> DataSplit:
    """CUB-200-2011: ``images.txt`` (id path), ``image_class_labels.txt`` (id class)."""
    root = _root(cfg, "images.txt", ("CUB_200_2011",))
    paths = {i: p for i, p in _table(root / "images.txt", 2)}
    labels = {i: int(c) for i, c in _table(root / "image_class_labels.txt", 2)}
    missing = sorted(set(paths) - set(labels))
    if missing:
        raise DataError(f"{root / 'image_class_labels.txt'} has no class for image id {missing[0]} "
                        f"({len(missing)} ids without a class)")
    items = [(root / "images" / paths[i], labels[i]) for i in paths]
    train, test = _half_split(items)
    tr, te = _datasets(cfg, "cub", train, test)
    return DataSplit(train=tr, test=te, num_classes=len(tr.classes))


def cars(cfg: DataConfig) -> DataSplit:
    """Cars196: ``cars_annos.mat`` (``annotations.relative_im_path``, ``.class``), ``car_ims/``."""
    import scipy.io

    root = _root(cfg, "cars_annos.mat", ("cars196", "stanford_cars"))
    mat_path = root / "cars_annos.mat"
    if not mat_path.is_file():
        raise DataError(f"split file {mat_path} is missing")
    try:
        mat = scipy.io.loadmat(mat_path, squeeze_me=True)
        ann = np.atleast_1d(mat["annotations"])
        rel = [str(p) for p in np.atleast_1d(ann["relative_im_path"])]
        cls = [int(c) for c in np.atleast_1d(ann["class"])]
    except (OSError, ValueError, KeyError, TypeError, IndexError, scipy.io.matlab.MatReadError) as exc:
        raise DataError(f"cannot read {mat_path} (expected annotations.relative_im_path/class): {exc}") from exc
    items = [(root / p, c) for p, c in zip(rel, cls)]
    train, test = _half_split(items)
    tr, te = _datasets(cfg, "cars", train, test)
    return DataSplit(train=tr, test=te, num_classes=len(tr.classes))


def sop(cfg: DataConfig) -> DataSplit:
    """Stanford Online Products: ``Ebay_{train,test}.txt`` (image_id class_id super_class_id path)."""
    root = _root(cfg, "Ebay_train.txt", ("Stanford_Online_Products",))
    parts = []
    for file in ("Ebay_train.txt", "Ebay_test.txt"):
        rows = _table(root / file, 4, skip=1)  # first line is the header
        parts.append([(root / r[3], int(r[1])) for r in rows])
    tr, te = _datasets(cfg, "sop", parts[0], parts[1])
    return DataSplit(train=tr, test=te, num_classes=len(tr.classes))


def inshop(cfg: DataConfig) -> DataSplit:
    """In-Shop Clothes: ``list_eval_partition.txt`` (count, header, then path item_id status).

    ``status`` train -> training; query/gallery -> the test set, with ``query_indices`` and
    ``gallery_indices`` so evaluation searches queries in the gallery only.
    """
    root = _root(cfg, "list_eval_partition.txt", ("In-shop Clothes Retrieval Benchmark",))
    partition = root / "list_eval_partition.txt"
    rows = _table(partition, 3, skip=2)  # line 1: number of images, line 2: header
    bad = sorted({r[2] for r in rows} - {"train", "query", "gallery"})
    if bad:
        raise DataError(f"{partition}: unknown evaluation_status {bad}; expected train/query/gallery")
    # Archives differ: images under root/img/... or root/Img/img/...
    base = root
    if rows and not (root / rows[0][0]).exists() and (root / "Img" / rows[0][0]).exists():
        base = root / "Img"
    train = [(base / r[0], r[1]) for r in rows if r[2] == "train"]
    query = [(base / r[0], r[1]) for r in rows if r[2] == "query"]
    gallery = [(base / r[0], r[1]) for r in rows if r[2] == "gallery"]
    if not query or not gallery:
        raise DataError(f"{partition}: needs both query and gallery rows")
    tr, te = _datasets(cfg, "inshop", train, query + gallery)
    n_q = len(query)
    return DataSplit(
        train=tr, test=te, num_classes=len(tr.classes),
        query_indices=list(range(n_q)), gallery_indices=list(range(n_q, n_q + len(gallery))),
    )
