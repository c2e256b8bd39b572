"""The retrieval index of a gallery: which faiss index, a build in shards, its ANN recall.

Vectors are L2-normalised and compared by inner product (cosine), exactly as the evaluation
compares them (``pipelines/evaluate.py``): an exact index here returns the evaluation's
neighbours. Every index carries the gallery's global ids (``add_with_ids``), so shards can be
added in any number of calls and a search answers gallery ids, never positions.

Which index: exact (``Flat``) up to :data:`EXACT_MAX` vectors; an HNSW graph above it, up to
:data:`HNSW_MAX`; IVF-PQ beyond (trained on a sample). autofaiss would choose for us, but it
pins numpy < 2 (autofaiss 2.18), outside our pins, so the rule is written here, and the search
depth of an ANN index is tuned on held-out gallery queries until it reaches the target recall.

Only numpy and faiss are imported, so this module runs inside any worker.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from pipelines.evaluate import faiss_gpus, l2_normalise

__all__ = ["EXACT_MAX", "HNSW_MAX", "IndexSpecError", "Tuned", "add_shard", "check_factory",
           "default_factory", "drop_self", "exact_top_k", "new_index", "read_index", "recall_at_k", "search", "train_sample_size",
           "tune_search", "write_index"]

# Exact search up to here: 20k x 512-d is 40 MB and a query scans it in about a millisecond.
EXACT_MAX = 20_000
# HNSW32 keeps the vectors plus 64 level-0 links (~ 4 d + 270 bytes per vector); beyond two
# million vectors IVF-PQ's codes (d / 2 bytes) fit where the graph does not.
HNSW_MAX = 2_000_000
HNSW_M = 32
# Search depths tried, smallest first, until the held-out recall reaches the target.
EF_SEARCH = (16, 32, 64, 128, 256, 512)
NPROBE = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class IndexSpecError(ValueError):
    """A factory string faiss refuses, or vectors an index cannot take; the message says which."""


def default_factory(n: int, dim: int) -> str:
    """The faiss factory string for ``n`` gallery vectors of dimension ``dim``."""
    if n <= EXACT_MAX:
        return "Flat"
    if n <= HNSW_MAX:
        return f"HNSW{HNSW_M},Flat"
    nlist = 1 << max(10, round(math.log2(4 * math.sqrt(n))))  # ~ 4 sqrt(n) lists, a power of two
    m = next(m for m in (dim // 2, dim // 4, dim // 8, 8, 4, 2, 1) if m >= 1 and dim % m == 0)
    return f"IVF{nlist},PQ{m}"


def new_index(factory: str, dim: int) -> faiss.Index:
    """An empty inner-product index of ``factory`` that takes global ids (IDMap2 where the
    index itself cannot). Raises IndexSpecError naming the string when faiss rejects it."""
    try:
        index = faiss.index_factory(int(dim), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:  # faiss' own message is a C++ trace: keep its first line
        last = (str(exc).strip().splitlines() or ["rejected"])[-1]
        first = re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", last)
        raise IndexSpecError(f"--factory {factory!r}: faiss rejects it ({first})") from exc
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2, faiss.IndexIVF)):
        return index
    return faiss.IndexIDMap2(index)


def check_factory(factory: str, dim: int = 8) -> None:
    """Raise IndexSpecError now, before any embedding, when faiss cannot build ``factory``."""
    new_index(factory, dim)


def train_sample_size(index: faiss.Index) -> int:
    """Vectors to train ``index`` on (0 when it needs no training): 64 per IVF list, which
    faiss' k-means asks for at least 39 of."""
    if index.is_trained:
        return 0
    ivf = faiss.try_extract_index_ivf(index)
    return 64 * int(ivf.nlist) if ivf is not None else 50_000


def add_shard(index: faiss.Index, ids: np.ndarray, vectors: np.ndarray) -> None:
    """Add one shard: ``ids`` (n,) int64 global ids, ``vectors`` (n, d) (normalised here)."""
    if vectors.ndim != 2 or vectors.shape[1] != index.d or len(ids) != len(vectors):
        raise IndexSpecError(f"a shard of {vectors.shape} vectors and {len(ids)} ids does not fit a {index.d}-d index")
    index.add_with_ids(l2_normalise(vectors), np.ascontiguousarray(ids, dtype=np.int64))


def _on_device(index: faiss.Index) -> tuple[faiss.Index, object | None]:
    """``index`` on the GPU when faiss has one and the index has a GPU form (flat, IVF)."""
    if faiss_gpus() == 0:
        return index, None
    try:
        res = faiss.StandardGpuResources()
        return faiss.index_cpu_to_gpu(res, 0, index), res
    except RuntimeError:  # HNSW has no GPU form: it searches on the CPU
        return index, None


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores (m, k) float32, gallery ids (m, k) int64) of the ``k`` nearest, best first;
    id -1 where the gallery has fewer than ``k`` items."""
    device_index, _res = _on_device(index)
    scores, ids = device_index.search(l2_normalise(queries), int(k))
    return scores, ids


def exact_top_k(queries: np.ndarray, shards: Iterable[tuple[np.ndarray, np.ndarray]], k: int,
                self_ids: np.ndarray | None = None) -> np.ndarray:
    """Exact top-``k`` gallery ids (m, k) of ``queries`` (m, d), streaming ``(ids, vectors)``
    shards: one shard in memory at a time, the running top-k merged after each. ``self_ids``
    (m,): each query is that gallery item, left out of its own neighbours."""
    if self_ids is not None:
        return drop_self(exact_top_k(queries, shards, k + 1), self_ids, k)
    q = l2_normalise(queries)
    best_s = np.full((len(q), 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((len(q), 0), dtype=np.int64)
    for ids, vectors in shards:
        flat = faiss.IndexFlatIP(q.shape[1])
        flat.add(l2_normalise(vectors))
        s, pos = flat.search(q, min(k, len(ids)))
        s_all = np.concatenate([best_s, s], axis=1)
        i_all = np.concatenate([best_i, np.asarray(ids, dtype=np.int64)[pos]], axis=1)
        order = np.argsort(-s_all, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(s_all, order, 1), np.take_along_axis(i_all, order, 1)
    return best_i


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean fraction of each query's exact top-k ids (m, k) that ``found`` (m, >= k) holds."""
    k = exact.shape[1]
    hits = [len(set(f[:k].tolist()) & set(e.tolist())) for f, e in zip(found, exact)]
    return float(np.mean(hits) / k)


@dataclass(frozen=True)
class Tuned:
    recall: float
    parameter: str  # "efSearch=64", "nprobe=16" or "" (exact)


def _depths(index: faiss.Index) -> Iterator[str]:
    inner = faiss.downcast_index(index.index) if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)) else index
    if isinstance(inner, faiss.IndexHNSW):
        for ef in EF_SEARCH:
            inner.hnsw.efSearch = ef
            yield f"efSearch={ef}"
    elif (ivf := faiss.try_extract_index_ivf(index)) is not None:
        for nprobe in NPROBE:
            if nprobe > ivf.nlist:
                break
            ivf.nprobe = nprobe
            yield f"nprobe={nprobe}"
    else:
        yield ""


def drop_self(ids: np.ndarray, self_ids: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` ids (m, k) of each row of ``ids`` (m, >= k + 1) that are not its query's own."""
    return np.stack([row[row != own][:k] for row, own in zip(ids, self_ids)])


def tune_search(index: faiss.Index, queries: np.ndarray, exact: np.ndarray, target: float,
                self_ids: np.ndarray | None = None) -> Tuned:
    """Set the smallest search depth (HNSW efSearch, IVF nprobe) whose recall@k of ``queries``
    against their ``exact`` top-k (m, k) reaches ``target``; else the deepest tried. The depth
    is stored in the index itself (``write_index`` keeps it). ``self_ids``: the queries are these
    gallery items, left out of their own neighbours (as ``exact`` was built): a query then has
    no exact copy of itself to find, as a new image would not."""
    k = exact.shape[1]
    tuned = Tuned(0.0, "")
    for parameter in _depths(index):
        _, found = index.search(l2_normalise(queries), k + (self_ids is not None))
        if self_ids is not None:
            found = drop_self(found, self_ids, k)
        tuned = Tuned(recall_at_k(found, exact), parameter)
        if tuned.recall >= target:
            break
    return tuned


def write_index(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


def read_index(path: Path) -> faiss.Index:
    return faiss.read_index(str(path))
