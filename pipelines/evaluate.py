"""Retrieval evaluation for deep metric learning embeddings.

``embed`` turns a dataset into embeddings (the one place that loops over one for inference).
Implements the metrics of ``docs/losses.md`` ("Retrieval metrics"): Recall@K, MAP@R,
R-Precision, Precision@1 and (optionally) NMI, with cosine kNN over L2-normalised
embeddings. The nearest-neighbour search runs in faiss (exact ``IndexFlatIP``, float32, on
a GPU when faiss has one); the metrics themselves are computed vectorised in numpy.

Only torch, numpy and faiss are imported, so this module can run inside any worker.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import faiss
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["RANK_METRICS", "embed", "eval_autocast", "format_metrics", "is_retrieval_metric", "metric_names",
           "faiss_gpus", "l2_normalise", "native_bf16", "retrieval_metrics"]

ArrayLike = torch.Tensor | np.ndarray

# The keys ``retrieval_metrics`` reports, the one list of them: ``recall_at_{k}`` per K, then
# the ranking metrics, then ``nmi`` when asked. The CLI, the sweep and retrain metric checks
# and the report's row order derive theirs from here.
RECALL_PREFIX = "recall_at_"
# Prefix of the same metrics scored with the query's own design family left out of its
# gallery (data sets with groups, such as the emoji set's vendors): ``xgroup_recall_at_1``.
CROSS_GROUP_PREFIX = "xgroup_"
RANK_METRICS = ("map_at_r", "r_precision", "precision_at_1")
NMI = "nmi"
DEFAULT_RECALL_KS = (1, 2, 4, 8)

# Upper bound on (queries in one search chunk) x (neighbours per query). faiss returns
# float32 distances + int64 ids and the metric code builds ~8 (chunk, k) temporaries of
# 8 bytes, so 4M elements keeps one chunk near 256 MiB even when a class has 10^5 items.
_MAX_CHUNK_ELEMENTS = 1 << 22
# faiss GPU k-selection is limited to k <= 2048 (without cuVS); above it search on CPU.
_GPU_MAX_K = 2048
_KMEANS_SEED = 1234
_KMEANS_NITER = 20


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA GPU that supports it, or a CPU
    with AMX tiles or AVX512-BF16 (elsewhere bf16 is emulated and slower than fp32)."""
    return _native_bf16(torch.device(device))


@functools.cache  # hardware does not change: probe once per device, not per evaluation batch
def _native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # private probes (torch.cpu), hence getattr: a torch without them counts as "no"
        return any(getattr(torch.cpu, probe, lambda: False)()
                   for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return False


def eval_autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context an evaluation forward pass runs in (``train.eval_precision``): bfloat16
    autocast for ``"bf16"`` where the device computes it natively, else nothing (fp32)."""
    device = torch.device(device)
    if precision == "bf16" and native_bf16(device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def embed(
    model: Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    workers: int = 0,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed every ``(image, label, index)`` item of ``dataset`` in order, in eval mode.

    Returns (N, d) float32 embeddings and (N,) long labels on the CPU. ``model`` may be an
    ``nn.Module`` (put in eval mode, then back in its previous mode) or any callable, e.g. an
    exported MLflow pt2 program, which has no train/eval switch. ``precision``: see
    :func:`eval_autocast`.
    """
    was_training = bool(getattr(model, "training", False))
    try:
        model.eval()  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError, RuntimeError):
        was_training = False  # exported programs refuse .eval()/.train(): already in inference form
    embs, labels = [], []
    try:
        for images, y, *_ in DataLoader(dataset, batch_size=batch_size, num_workers=workers):
            with eval_autocast(precision, device):
                out = model(images.to(device))
            embs.append(out.float().cpu())
            labels.append(torch.as_tensor(y).long())
    finally:
        if was_training:
            model.train()  # type: ignore[attr-defined]
    if not embs:
        raise ValueError("embed: the dataset is empty")
    return torch.cat(embs), torch.cat(labels)


def retrieval_metrics(
    embeddings: ArrayLike,
    labels: ArrayLike,
    *,
    query_embeddings: ArrayLike | None = None,
    query_labels: ArrayLike | None = None,
    recall_ks: Sequence[int] = DEFAULT_RECALL_KS,
    nmi: bool = False,
    exclude_same_group: tuple[ArrayLike, ArrayLike | None] | None = None,
) -> dict[str, float]:
    """Retrieval metrics of a query set against a gallery, by cosine kNN.

    Args:
        embeddings: gallery embeddings, shape ``(N, D)``, torch tensor or numpy array (any
            float dtype / device; copied to CPU float32). They are L2-normalised here.
        labels: gallery class labels, shape ``(N,)``, any values ``np.unique`` can sort.
        query_embeddings: query embeddings, shape ``(M, D)``. ``None`` (default) means the
            gallery is its own query set (CUB / Cars / SOP protocol): each query is then
            excluded from its own neighbours by *index*, so an exact duplicate of a
            query still counts as a neighbour.
        query_labels: query labels, shape ``(M,)``; given iff ``query_embeddings`` is.
        recall_ks: the K of Recall@K; each must be ``<=`` the number of candidates
            (``N``, or ``N - 1`` when the gallery is its own query set).
        nmi: also compute NMI of faiss k-means (seeded, 20 iterations, as many clusters as
            there are query classes) on the normalised *query* embeddings against the query
            labels, with arithmetic-mean normalisation ``MI / ((H(y) + H(c)) / 2)``
            (= sklearn ``normalized_mutual_info_score(average_method="arithmetic")``).
        exclude_same_group: optional ``(groups_gallery, groups_query)`` with shapes ``(N,)``
            and ``(M,)``; gallery items whose group equals the query's group are removed
            from that query's candidates (e.g. other photos of the same product design),
            and not counted in its ``R_q``. ``groups_query`` may be ``None`` when the
            gallery is its own query set (then ``groups_gallery`` is used).

    Returns:
        ``{"recall_at_{k}" for k in recall_ks, "map_at_r", "r_precision",
        "precision_at_1"}`` plus ``"nmi"`` iff ``nmi=True``, all Python floats.

        ``R_q`` is the number of gallery items of the query's class (less itself when
        query = gallery, less its group's items when ``exclude_same_group``). Recall@K is
        over ALL queries: a query with ``R_q = 0`` (no other member of its class) counts as
        a miss, as the papers' evaluation code does (Proxy-Anchor's ``calc_recall_at_k``,
        ProxyNCA++). P@1, R-Precision and MAP@R exclude such queries (pytorch-metric-learning's
        convention).
        ``R-Precision = (#relevant in top R_q) / R_q``,
        ``MAP@R = (1/R_q) sum_{k <= R_q} P@k * rel_k``. Matches pytorch-metric-learning's
        ``AccuracyCalculator(k="max_bin_count")`` on normalised inputs. NMI is not
        affected by the ``R_q = 0`` exclusion nor by groups.

    Raises:
        ValueError: embeddings not 2-D, labels not 1-D, mismatched lengths or dimensions,
            NaN/inf embeddings, only one of ``query_embeddings``/``query_labels`` given,
            fewer than 2 classes in the gallery, a recall K below 1 or above the number of
            candidates, an empty query set, or no query with any relevant gallery item.
    """
    gallery, queries, g_cls, q_cls, recall_ks = _checked_inputs(
        embeddings, labels, query_embeddings, query_labels, recall_ks)
    self_query = query_embeddings is None
    r_q, g_grp, q_grp, extra = _relevant_counts(g_cls, q_cls, self_query, exclude_same_group)
    valid = np.flatnonzero(r_q > 0)
    if len(valid) == 0:
        raise ValueError("no query has a relevant gallery item (every R_q is 0)")

    gallery = l2_normalise(gallery)
    queries = gallery if self_query else l2_normalise(queries)
    index = _FlatIP(gallery)
    per_query = _search_in_chunks(index, queries, valid, r_q, q_cls, g_cls, recall_ks, extra, self_query, g_grp, q_grp)

    # Columns: recall hits per K, then P@1, R-Precision, MAP@R; mean over valid queries,
    # except Recall@K, whose denominator counts the queries with R_q = 0 as misses.
    means = per_query.mean(axis=0)
    n_r = len(recall_ks)
    hits = per_query[:, :n_r].sum(axis=0)
    out = {f"{RECALL_PREFIX}{k}": float(hits[i] / len(queries)) for i, k in enumerate(recall_ks)}
    map_at_r, r_precision, precision_at_1 = RANK_METRICS
    out[map_at_r] = float(means[n_r + 2])
    out[r_precision] = float(means[n_r + 1])
    out[precision_at_1] = float(means[n_r])
    if nmi:
        out[NMI] = _kmeans_nmi(queries, q_cls, index.use_gpu)
    return out


def _checked_inputs(
    embeddings: ArrayLike, labels: ArrayLike, query_embeddings: ArrayLike | None, query_labels: ArrayLike | None,
    recall_ks: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """(gallery (N, D), queries (M, D), gallery class ids (N,), query class ids (M,), recall
    Ks), with every check of :func:`retrieval_metrics`' Raises. Labels of any dtype become
    dense ids shared by gallery and queries, so classes are counted with bincount."""
    if (query_embeddings is None) != (query_labels is None):
        raise ValueError("give both query_embeddings and query_labels, or neither")
    self_query = query_embeddings is None
    gallery = _as_embeddings(embeddings, "embeddings")
    gallery_labels = _as_labels(labels, "labels", len(gallery))
    if self_query:
        queries, q_labels = gallery, gallery_labels
    else:
        queries = _as_embeddings(query_embeddings, "query_embeddings")
        q_labels = _as_labels(query_labels, "query_labels", len(queries))
        if queries.shape[1] != gallery.shape[1]:
            raise ValueError(
                f"query_embeddings have dimension {queries.shape[1]}, embeddings have {gallery.shape[1]}"
            )
    if len(queries) == 0:
        raise ValueError("the query set is empty")
    _, ids = np.unique(np.concatenate([gallery_labels, q_labels]), return_inverse=True)
    ids = ids.reshape(-1)
    g_cls, q_cls = ids[: len(gallery)], ids[len(gallery) :]
    if len(np.unique(g_cls)) < 2:
        raise ValueError("the gallery needs at least 2 classes")
    n_candidates = len(gallery) - int(self_query)
    ks = tuple(int(k) for k in recall_ks)
    for k in ks:
        if not 1 <= k <= n_candidates:
            raise ValueError(
                f"recall k={k} must be in [1, {n_candidates}] (the number of candidates per query)"
            )
    return gallery, queries, g_cls, q_cls, ks


def _relevant_counts(
    g_cls: np.ndarray, q_cls: np.ndarray, self_query: bool,
    exclude_same_group: tuple[ArrayLike, ArrayLike | None] | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """(R_q (M,), gallery groups, query groups, extra search depth): R_q counts the gallery
    items of the query's class, less itself and less its own group's items; ``extra`` is how
    many more neighbours a search needs to still have K after dropping them."""
    n_classes = int(max(g_cls.max(), q_cls.max())) + 1
    r_q = np.bincount(g_cls, minlength=n_classes)[q_cls]
    groups = _as_groups(exclude_same_group, self_query, len(g_cls), len(q_cls))
    if groups is None:
        return r_q - int(self_query), None, None, int(self_query)
    g_grp, q_grp = groups
    # Count (class, group) pairs in the gallery to subtract the query's own group.
    # In the self-query case the query is in its own group, so this removes it too.
    n_groups = int(max(g_grp.max(), q_grp.max())) + 1
    pair_counts = np.bincount(g_cls * n_groups + g_grp, minlength=n_classes * n_groups)
    r_q = r_q - pair_counts[q_cls * n_groups + q_grp]
    group_sizes = np.bincount(g_grp, minlength=n_groups)
    return r_q, g_grp, q_grp, int(group_sizes[q_grp].max()) + int(self_query)


def _search_in_chunks(
    index: _FlatIP, queries: np.ndarray, valid: np.ndarray, r_q: np.ndarray, q_cls: np.ndarray,
    g_cls: np.ndarray, recall_ks: tuple[int, ...], extra: int, self_query: bool,
    g_grp: np.ndarray | None, q_grp: np.ndarray | None,
) -> np.ndarray:
    """Per-query metric rows of the ``valid`` queries (see :func:`_per_query_metrics`).

    The queries are sorted by R_q so each chunk searches only as deep as its own largest R_q
    (one huge class does not force a deep search for every query), and a chunk holds at most
    ``_MAX_CHUNK_ELEMENTS`` neighbour ids.
    """
    order = valid[np.argsort(r_q[valid], kind="stable")]
    max_recall_k = max(recall_ks, default=1)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(order):
        stop = len(order)
        while True:  # shrink the chunk until (size x depth) fits the element budget
            k_search = min(max(max_recall_k, int(r_q[order[stop - 1]])) + extra, index.ntotal)
            size = max(1, _MAX_CHUNK_ELEMENTS // k_search)
            if stop - start <= size:
                break
            stop = start + size
        q_idx = order[start:stop]
        neighbours = index.search(queries[q_idx], k_search)
        parts.append(_per_query_metrics(
            neighbours, q_idx, r_q[q_idx], q_cls[q_idx], g_cls, recall_ks, self_query=self_query,
            g_grp=g_grp, q_grp=None if q_grp is None else q_grp[q_idx],
        ))
        start = stop
    return np.concatenate(parts)


def metric_names(recall_ks: Sequence[int] = DEFAULT_RECALL_KS, nmi: bool = False) -> tuple[str, ...]:
    """The keys of ``retrieval_metrics(..., recall_ks=recall_ks, nmi=nmi)``, in its order."""
    return (*(f"{RECALL_PREFIX}{k}" for k in recall_ks), *RANK_METRICS, *((NMI,) if nmi else ()))


def is_retrieval_metric(key: str, nmi: bool = False) -> bool:
    """Whether ``retrieval_metrics`` reports ``key`` for some recall K (``nmi``: NMI counts too).

    All of them are higher-is-better. ``nmi=False`` gives the metrics a sweep or a retrain
    can select on (NMI is optional, so not every run has it).
    """
    return key in RANK_METRICS or (nmi and key == NMI) or re.fullmatch(rf"{RECALL_PREFIX}\d+", key) is not None


def format_metrics(metrics: Mapping[str, float]) -> str:
    """One line such as ``"recall_at_1=0.6123 recall_at_2=0.7301 map_at_r=0.2210"``."""
    return " ".join(f"{name}={value:.4f}" for name, value in metrics.items())


def _per_query_metrics(
    neighbours: np.ndarray,
    q_idx: np.ndarray,
    r_q: np.ndarray,
    q_cls: np.ndarray,
    g_cls: np.ndarray,
    recall_ks: tuple[int, ...],
    *,
    self_query: bool,
    g_grp: np.ndarray | None,
    q_grp: np.ndarray | None,
) -> np.ndarray:
    """Per-query metric rows for one chunk.

    Args:
        neighbours: gallery ids ``(C, k_search)`` by decreasing similarity, ``-1`` = none.
        q_idx, r_q, q_cls: the chunk's query indices, R_q and class ids, ``(C,)``.
        g_cls: gallery class ids ``(N,)``.
        g_grp, q_grp: gallery ``(N,)`` and chunk-query ``(C,)`` group ids, or ``None``.

    Returns:
        float64 ``(C, len(recall_ks) + 3)``: a 0/1 hit per K, P@1, R-Precision, MAP@R.
    """
    missing = neighbours < 0
    safe = np.where(missing, 0, neighbours)
    excluded = missing
    if self_query:
        excluded = excluded | (neighbours == q_idx[:, None])
    if g_grp is not None:
        excluded = excluded | (g_grp[safe] == q_grp[:, None])
    k = max(max(recall_ks, default=1), int(r_q.max()))
    if excluded.any():
        # Stable sort on the mask moves excluded ids to the back and keeps the similarity
        # order of the rest; the search went `extra` deeper, so k real candidates remain
        # (or all of them, when the gallery is smaller: trailing ones stay excluded).
        keep = np.argsort(excluded, axis=1, kind="stable")[:, :k]
        safe = np.take_along_axis(safe, keep, axis=1)
        excluded = np.take_along_axis(excluded, keep, axis=1)
    else:
        safe, excluded = safe[:, :k], excluded[:, :k]

    rel = (g_cls[safe] == q_cls[:, None]) & ~excluded  # (C, k)
    hits = np.cumsum(rel, axis=1, dtype=np.int64)  # relevant items in top 1..k
    rank = np.arange(1, k + 1)
    rows = np.arange(len(r_q))
    cols = [hits[:, kk - 1] > 0 for kk in recall_ks]
    cols.append(rel[:, 0])
    cols.append(hits[rows, r_q - 1] / r_q)
    within_r = rank[None, :] <= r_q[:, None]
    cols.append((rel * within_r * (hits / rank)).sum(axis=1) / r_q)
    return np.stack(cols, axis=1).astype(np.float64)


class _FlatIP:
    """Exact inner-product index on the gallery, on a GPU when faiss has one."""

    def __init__(self, gallery: np.ndarray) -> None:
        self.cpu = faiss.IndexFlatIP(gallery.shape[1])
        self.cpu.add(gallery)
        self.gpu = None
        self.use_gpu = faiss_gpus() > 0
        if self.use_gpu:
            self._res = faiss.StandardGpuResources()
            self.gpu = faiss.index_cpu_to_gpu(self._res, 0, self.cpu)

    @property
    def ntotal(self) -> int:
        """The number of gallery vectors."""
        return int(self.cpu.ntotal)

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Ids ``(len(queries), k)`` of the k most similar gallery items, best first."""
        index = self.gpu if self.gpu is not None and k <= _GPU_MAX_K else self.cpu
        _, ids = index.search(np.ascontiguousarray(queries), k)
        return ids


def _kmeans_nmi(x: np.ndarray, cls: np.ndarray, use_gpu: bool) -> float:
    """NMI (arithmetic mean) between class ids ``(M,)`` and k-means clusters of x ``(M, D)``."""
    _, cls = np.unique(cls, return_inverse=True)
    n_clusters = int(cls.max()) + 1
    # min_points_per_centroid=1 silences faiss' "please provide at least ..." warning:
    # evaluation sets routinely have ~10 items per class.
    kmeans = faiss.Kmeans(
        x.shape[1],
        n_clusters,
        niter=_KMEANS_NITER,
        seed=_KMEANS_SEED,
        gpu=use_gpu,
        min_points_per_centroid=1,
        max_points_per_centroid=max(256, len(x)),
    )
    kmeans.train(x)
    _, assign = kmeans.index.search(x, 1)
    return _nmi_arithmetic(cls, assign.reshape(-1))


def _nmi_arithmetic(a: np.ndarray, b: np.ndarray) -> float:
    """NMI of two labelings ``(M,)`` of non-negative ints, normalised by the mean entropy."""
    _, a = np.unique(a, return_inverse=True)
    _, b = np.unique(b, return_inverse=True)
    a, b = a.reshape(-1), b.reshape(-1)
    if a.max() == 0 and b.max() == 0:
        return 1.0  # both labelings are a single cluster: identical (sklearn's convention)
    n = len(a)
    pair, counts = np.unique(a * (int(b.max()) + 1) + b, return_counts=True)
    p_ab = counts / n
    p_a = np.bincount(a) / n
    p_b = np.bincount(b) / n
    ia, ib = pair // (int(b.max()) + 1), pair % (int(b.max()) + 1)
    mi = float(np.sum(p_ab * np.log(p_ab / (p_a[ia] * p_b[ib]))))
    h_a = float(-np.sum(p_a * np.log(p_a)))
    h_b = float(-np.sum(p_b * np.log(p_b)))
    denom = (h_a + h_b) / 2
    return max(mi, 0.0) / denom if denom > 0 else 1.0


def _as_embeddings(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, dim), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or inf")
    return x


def _as_labels(y: Any, name: str, n: int) -> np.ndarray:
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name} has {len(y)} entries for {n} embeddings")
    return y


def _as_groups(
    groups: tuple[Any, Any] | None, self_query: bool, n_gallery: int, n_query: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Dense group ids ``(gallery (N,), query (M,))`` shared by both sides, or None."""
    if groups is None:
        return None
    if not isinstance(groups, tuple | list) or len(groups) != 2:
        raise ValueError("exclude_same_group must be a (groups_gallery, groups_query) pair")
    g_grp = _as_labels(groups[0], "exclude_same_group[0]", n_gallery)
    if groups[1] is None:
        if not self_query:
            raise ValueError("exclude_same_group needs groups_query when queries are given")
        q_grp = g_grp
    else:
        q_grp = _as_labels(groups[1], "exclude_same_group[1]", n_query)
    _, ids = np.unique(np.concatenate([g_grp, q_grp]), return_inverse=True)
    ids = ids.reshape(-1)
    return ids[:n_gallery], ids[n_gallery:]


def faiss_gpus() -> int:
    """GPUs faiss can use here (0 with faiss-cpu): every faiss search picks its device from this."""
    return int(getattr(faiss, "get_num_gpus", lambda: 0)())


def l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` (N, D) scaled to unit length, as contiguous float32 (N, D)."""
    # Same eps as torch.nn.functional.normalize: a zero vector stays zero.
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)
