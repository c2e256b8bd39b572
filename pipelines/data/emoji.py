"""The emoji retrieval benchmark's loader: ``data.name=emoji`` reads a built folder.

One class per emoji, one image per vendor design; the seen half of the classes trains, the
unseen half is evaluated, and each image's design *family* (OpenMoji colour and black share
their line art) is an evaluation group for the cross-family report. How the folder is built
from pinned npm packages, and its layout, is in ``pipelines/data/emoji_build.py``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from pipelines.config import DataConfig
from pipelines.data.transforms import ImageListDataset, eval_transform, train_transform
from pipelines.data.types import DataError, DataSplit, default_root

DEFAULT_ROOT = str(default_root(DataConfig(name="emoji")))  # where `proxydml data build emoji` writes
MANIFEST_FIELDS = ("key", "name", "category", "design", "family", "split", "file", "sha256", "source_sha256")


# -- loading -------------------------------------------------------------------------------------------
def read_manifest(root: Path) -> list[dict[str, str]]:
    """Rows of ``root/manifest.csv`` (the stamp line skipped). Raises DataError naming the file."""
    manifest = root / "manifest.csv"
    if not root.is_dir():
        raise DataError(
            f"emoji data set folder {root} does not exist or is not a folder; build it with "
            f"`proxydml data build emoji --out {root}` (add --tiny for a 64-class test variant)"
        )
    if not manifest.is_file():
        raise DataError(f"{manifest} is missing: build the data set with `proxydml data build emoji --out {root}`")
    try:
        with manifest.open(newline="") as f:
            first = f.readline()
            if not first.startswith("# stamp="):
                f.seek(0)
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read {manifest}: {exc}") from exc
    need = {"key", "design", "family", "split", "file"}
    if not rows or not need <= set(rows[0]):
        raise DataError(f"{manifest} is empty or lacks the columns {', '.join(sorted(need))}")
    return rows


def emoji_split(cfg: DataConfig) -> DataSplit:
    """``data.name=emoji``: train = the seen half of the classes, test = the unseen half.

    ``test_groups`` holds each test image's design family (OpenMoji colour and black are one
    family) for the cross-family report. ``data.image_size`` 0 = the built size.
    """
    root = default_root(cfg)
    rows = read_manifest(root)
    bad = sorted({r["split"] for r in rows} - {"train", "test"})
    if bad:
        raise DataError(f"{root / 'manifest.csv'}: unknown split value(s) {bad}")
    size = cfg.image_size or _built_size(root)
    parts = {}
    for part in ("train", "test"):
        chosen = [r for r in rows if r["split"] == part]
        keys = sorted({r["key"] for r in chosen})
        label = {k: i for i, k in enumerate(keys)}
        tf = train_transform(cfg, size) if part == "train" else eval_transform(cfg, size)
        name_of = {r["key"]: r["name"] for r in chosen}
        parts[part] = ImageListDataset(
            [(root / r["file"], label[r["key"]]) for r in chosen], tf, f"emoji/{part}", classes=keys,
            names=[name_of[k] for k in keys],
        )
    families = sorted({r["family"] for r in rows})
    fam_id = {f: i for i, f in enumerate(families)}
    return DataSplit(
        train=parts["train"], test=parts["test"], num_classes=len(parts["train"].classes),
        test_groups=[fam_id[r["family"]] for r in rows if r["split"] == "test"],
        train_groups=[fam_id[r["family"]] for r in rows if r["split"] == "train"],
    )


def _built_size(root: Path) -> int:
    try:
        return int(json.loads((root / "summary.json").read_text())["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # unknown: keep the files' own size
