"""A gallery to index: its items, the decode step, the embed step and the embeddings files.

The steps are plain functions of numpy batches so that any engine can run them: Ray Data runs
``decode_batch`` in CPU tasks and ``GalleryEmbedder`` in an actor pool (services/runtime.py);
a test runs them in one process. A batch is a dict of equal-length columns:

- ``id`` int64 (the global id, the item's position in the listing), ``path`` str, ``class`` str
  ("" when unknown), then after decoding ``image`` float32 (n, C, H, W), ``ok`` bool,
  ``sha256`` str and ``error`` str; after embedding ``vector`` float32 (n, d) and ``node`` str.

An item that cannot be decoded keeps its row (``ok`` False, ``error`` naming the file and why),
so the driver decides, once, whether that is an error or a skip (``--skip-bad``).
"""

from __future__ import annotations

import ctypes
import hashlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.config import Config
from pipelines.data.transforms import eval_transform, load_image
from pipelines.data.types import DataError, class_names, dataset_labels
from pipelines.evaluate import eval_autocast
from pipelines.models import EmbeddingModel

__all__ = ["IMAGE_SUFFIXES", "GalleryEmbedder", "GalleryItems", "decode_batch", "decode_image", "folder_items",
           "dataset_items", "embed_items", "image_channels", "query_transform", "read_embeddings", "write_embeddings"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Rows per Parquet file of the embeddings: a shard the index build holds in memory at a time
# (100k x 512-d float32 = 200 MB).
SHARD_ROWS = 100_000


@dataclass
class GalleryItems:
    """What a gallery lists: parallel columns, ids = positions. ``images`` holds the decoded
    images (N, C, H, W) of a data set that has no files (digits); else None."""

    paths: list[str]
    classes: list[str]
    images: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per item (id, path, class[, image]): the input of the decode step."""
        out = [{"id": i, "path": p, "class": c} for i, (p, c) in enumerate(zip(self.paths, self.classes))]
        if self.images is not None:
            for row, image in zip(out, self.images):
                row["image"] = image
        return out


def folder_items(root: Path) -> GalleryItems:
    """Every image file under ``root`` (sorted); its class is its first sub-folder, if any."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"gallery folder {root} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    classes = [p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else "" for p in files]
    return GalleryItems([str(p) for p in files], classes)


def dataset_items(dataset: Any) -> GalleryItems:
    """The items of an evaluation data set (the unseen half of a recipe), in its own order, so a
    gallery id is the data set index the evaluation uses."""
    labels = dataset_labels(dataset)
    names = class_names(dataset)
    classes = [names[y] if names is not None else str(y) for y in labels]
    samples = getattr(dataset, "samples", None)
    if samples is not None:
        return GalleryItems([str(p) for p, _ in samples], classes)
    images = np.stack([dataset[i][0].numpy() for i in range(len(dataset))]).astype(np.float32)
    return GalleryItems(["" for _ in labels], classes, images)


def query_transform(cfg: Config) -> Any:
    """The evaluation transform of ``cfg``: what every gallery and query image goes through."""
    return eval_transform(cfg.data, cfg.data.image_size)


def decode_image(raw: bytes, name: str, transform: Any) -> np.ndarray:
    """An image file's bytes -> (C, H, W) float32 through ``transform``; DataError naming ``name``."""
    return transform(load_image(io.BytesIO(raw), name=name)).numpy()


def decode_batch(batch: dict[str, np.ndarray], cfg: Config) -> dict[str, np.ndarray]:
    """Read, hash and decode a batch of files with ``cfg``'s evaluation transform."""
    n = len(batch["id"])
    if "image" in batch:  # an in-memory data set: already decoded
        return {**batch, "image": np.asarray(batch["image"], dtype=np.float32), "ok": np.ones(n, dtype=bool),
                "sha256": np.array([hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
                                    for x in batch["image"]]), "error": np.array([""] * n)}
    transform = query_transform(cfg)
    images: list[np.ndarray | None] = []
    ok, sha, error = np.ones(n, dtype=bool), [], []
    for i, path in enumerate(batch["path"]):
        try:
            raw = Path(path).read_bytes()
            images.append(decode_image(raw, str(path), transform))
            sha.append(hashlib.sha256(raw).hexdigest())
            error.append("")
        except (OSError, DataError) as exc:
            images.append(None)
            ok[i] = False
            sha.append("")
            error.append(str(exc) if isinstance(exc, DataError) else f"cannot read image {path}: {exc}")
    shape = next((x.shape for x in images if x is not None), (3, 1, 1))
    stacked = np.stack([x if x is not None else np.zeros(shape, dtype=np.float32) for x in images])
    return {**batch, "image": stacked.astype(np.float32), "ok": ok, "sha256": np.array(sha),
            "error": np.array(error)}


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory in the process instead of returning it to the
    kernel; True where it took (glibc), False elsewhere.

    An inference loop frees and reallocates a forward pass's activations (tens of MB) every
    batch. By default glibc unmaps or trims them and the next batch faults the pages in again:
    measured on the emoji demo model, 120,000 page faults per batch of 64 and about 45% of the
    forward's time in the kernel (0.60 s per batch instead of 0.33 s). This covers the main
    heap; a thread's own arena is shrunk regardless, so processes that embed in a thread start
    with ``MALLOC_ARENA_MAX=1`` (services/runtime.py). The cost is a resident size at the peak
    of one batch, which an embedding process reaches anyway.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    # No block gets its own mapping (glibc maps anything over 32 MB, and a thread's arena maps
    # whatever outgrows its 64 MB heaps): all of it comes from the main heap, which is then
    # never trimmed below 1 GB.
    return all([libc.mallopt(m_mmap_max, 0) == 1,
                libc.mallopt(m_trim_threshold, 1 << 30) == 1,
                libc.mallopt(m_top_pad, 64 << 20) == 1])


class GalleryEmbedder:
    """The model of one version, embedding decoded batches (the evaluation's precision rule).

    Built from the config and the weights (not a path) so that an actor on any node can hold it.
    """

    def __init__(self, config: Config, state: dict[str, torch.Tensor], in_channels: int = 3,
                 threads: int = 0, node: str = "") -> None:
        if threads:
            torch.set_num_threads(threads)
        keep_freed_memory()
        self.cfg = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = EmbeddingModel(config.model, in_channels)
        self.model.load_state_dict(state)
        self.model.to(self.device).eval()
        self.node = node

    @torch.no_grad()
    def embed(self, images: np.ndarray) -> np.ndarray:
        """(n, C, H, W) float32 -> (n, d) float32 embeddings, not normalised."""
        # Ray Data hands read-only arrays; torch wants writable memory (copied only when it is not).
        x = torch.from_numpy(np.require(images, np.float32, ["C", "W"])).to(self.device)
        with eval_autocast(self.cfg.train.eval_precision, self.device):
            return self.model(x).float().cpu().numpy()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: v for k, v in batch.items() if k != "image"}
        out["vector"] = self.embed(batch["image"])
        out["node"] = np.array([self.node] * len(batch["id"]))
        return out


def embed_items(items: GalleryItems, cfg: Config, state: dict[str, torch.Tensor], *, batch_size: int,
                threads: int = 1, node: str = "") -> Iterator[dict[str, np.ndarray]]:
    """Embed ``items`` in this process: consecutive batches of ``batch_size`` in id order, each
    decoded (:func:`decode_batch`) then embedded (:class:`GalleryEmbedder` on ``threads`` torch
    threads, restored on exit). Yields what the embedding actors yield: the batch's columns,
    ``ok``/``error``/``sha256`` and ``vector`` (n, d)."""
    before = torch.get_num_threads()
    try:
        embedder = GalleryEmbedder(cfg, state, image_channels(items), threads, node=node)
        for start in range(0, len(items), batch_size):
            end = min(start + batch_size, len(items))
            batch = {"id": np.arange(start, end), "path": np.array(items.paths[start:end], dtype=object),
                     "class": np.array(items.classes[start:end], dtype=object)}
            if items.images is not None:
                batch["image"] = items.images[start:end]
            yield embedder(decode_batch(batch, cfg))
    finally:
        torch.set_num_threads(before)


_SCHEMA_COLUMNS = ("id", "path", "class", "sha256", "vector")


def write_embeddings(batches: Iterable[dict[str, np.ndarray]], folder: Path) -> Iterator[dict[str, np.ndarray]]:
    """Write the good rows of embedded ``batches`` to ``folder/part-NNNNN.parquet`` (id, path,
    class, sha256, vector) in shards of :data:`SHARD_ROWS`; yields every batch on (bad rows
    too), so the caller counts them as they pass."""
    folder.mkdir(parents=True, exist_ok=True)
    pending: list[pa.Table] = []
    rows, part = 0, 0

    def flush() -> None:
        nonlocal pending, rows, part
        if pending:
            pq.write_table(pa.concat_tables(pending), folder / f"part-{part:05d}.parquet")
            pending, rows, part = [], 0, part + 1

    for batch in batches:
        yield batch
        keep = np.asarray(batch["ok"], dtype=bool)
        if not keep.any():
            continue
        vectors = np.asarray(batch["vector"], dtype=np.float32)[keep]
        table = pa.table({
            "id": pa.array(np.asarray(batch["id"], dtype=np.int64)[keep]),
            "path": pa.array([str(p) for p in np.asarray(batch["path"])[keep]]),
            "class": pa.array([str(c) for c in np.asarray(batch["class"])[keep]]),
            "sha256": pa.array([str(s) for s in np.asarray(batch["sha256"])[keep]]),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1]),
        })
        pending.append(table)
        rows += len(table)
        if rows >= SHARD_ROWS:
            flush()
    flush()


def read_embeddings(folder: Path, *, vectors: bool = True) -> Iterator[tuple[np.ndarray, np.ndarray | None, pa.Table]]:
    """Per Parquet file of ``folder``, in order: (ids (n,), vectors (n, d) float32 or None, the
    table's other columns). One file in memory at a time."""
    for path in sorted(Path(folder).glob("part-*.parquet")):
        columns = list(_SCHEMA_COLUMNS if vectors else _SCHEMA_COLUMNS[:-1])
        table = pq.read_table(path, columns=columns)
        ids = table.column("id").to_numpy()
        vecs = None
        if vectors:
            col = table.column("vector").combine_chunks()
            vecs = col.values.to_numpy().reshape(len(col), -1).astype(np.float32, copy=False)
            table = table.drop(["vector"])
        yield ids, vecs, table


def image_channels(items: GalleryItems) -> int:
    """Channels the model reads: the in-memory images' own, else RGB (files decode to RGB)."""
    return int(items.images.shape[1]) if items.images is not None else 3

