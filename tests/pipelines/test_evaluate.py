"""Tests for pipelines.evaluate: hand-computed cases, a loop reference, PML parity, NMI."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipelines import evaluate
from pipelines.evaluate import format_metrics, retrieval_metrics


def _circle(degrees: list[float], scales: list[float] | None = None) -> np.ndarray:
    """2-D points at the given angles: cosine order = angular distance order."""
    rad = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    pts = np.stack([np.cos(rad), np.sin(rad)], axis=1)
    if scales is not None:  # norms must not matter: the metric is cosine
        pts = pts * np.asarray(scales)[:, None]
    return pts.astype(np.float32)


# Six points, classes A=0 / B=1. Neighbour orders (angular distance, self excluded):
#   q0 A   0: 1A 2B 3A 4B 5B    q1 A  10: 0A 2B 3A 4B 5B    q2 B  25: 1A 3A 0A 4B 5B
#   q3 A  48: 2B 1A 4B 0A 5B    q4 B  90: 5B 3A 2B 1A 0A    q5 B 100: 4B 3A 2B 1A 0A
# Every R_q = 2. Per query (P@1, R-Prec, MAP@R): q0 (1, 1/2, 1/2), q1 (1, 1/2, 1/2),
# q2 (0, 0, 0), q3 (0, 1/2, 1/4), q4 (1, 1/2, 1/2), q5 (1, 1/2, 1/2).
# Recall@1: q0 q1 q4 q5; Recall@2: all but q2; Recall@4: all (q2 finds 4B at rank 4).
HAND_DEG = [0, 10, 25, 48, 90, 100]
HAND_LABELS = [0, 0, 1, 0, 1, 1]
HAND_SCALES = [1.0, 3.0, 0.5, 5.0, 1.0, 2.0]
HAND_EXPECTED = {
    "recall_at_1": 4 / 6,
    "recall_at_2": 5 / 6,
    "recall_at_4": 1.0,
    "map_at_r": (0.5 + 0.5 + 0 + 0.25 + 0.5 + 0.5) / 6,
    "r_precision": (0.5 + 0.5 + 0 + 0.5 + 0.5 + 0.5) / 6,
    "precision_at_1": 4 / 6,
}


def _assert_close(got: dict[str, float], want: dict[str, float], tol: float = 1e-9) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=tol), key


def test_hand_built_self_query() -> None:
    emb = _circle(HAND_DEG, HAND_SCALES)
    got = retrieval_metrics(emb, np.array(HAND_LABELS), recall_ks=(1, 2, 4))
    _assert_close(got, HAND_EXPECTED)


def test_lone_class_query_is_a_recall_miss_and_skipped_elsewhere() -> None:
    # Item 6 (class 2, alone) at 250 deg: R_q = 0. Recall@K counts it as a miss (the papers'
    # convention: 7 queries, the same hits); P@1, R-Precision and MAP@R skip it. As a gallery
    # item it is farther than every top-4 neighbour of the six others.
    emb = _circle([*HAND_DEG, 250], [*HAND_SCALES, 1.0])
    got = retrieval_metrics(emb, np.array([*HAND_LABELS, 2]), recall_ks=(1, 2, 4))
    want = {**HAND_EXPECTED, "recall_at_1": 4 / 7, "recall_at_2": 5 / 7, "recall_at_4": 6 / 7}
    _assert_close(got, want)


def test_query_gallery_split() -> None:
    # Gallery: 0A 30B 60A 90B 180C. Queries:
    #   A  10 -> 0A 30B 60A ...: R=2, P@1 1, R-Prec 1/2, MAP 1/2, hit@1, hit@2
    #   B  50 -> 60A 30B 90B ..: R=2, P@1 0, R-Prec 1/2, MAP (0 + 1/2)/2 = 1/4, hit@2 only
    #   C 170 -> 180C ...      : R=1, P@1 1, R-Prec 1,   MAP 1, hit@1, hit@2
    #   D  45 -> no class D in the gallery: R=0, a miss for Recall@K, skipped elsewhere.
    gallery = _circle([0, 30, 60, 90, 180])
    g_labels = np.array([0, 1, 0, 1, 2])
    queries = _circle([10, 50, 170, 45], [2.0, 1.0, 0.1, 1.0])
    q_labels = np.array([0, 1, 2, 3])
    got = retrieval_metrics(
        gallery, g_labels, query_embeddings=queries, query_labels=q_labels, recall_ks=(1, 2, 4)
    )
    _assert_close(
        got,
        {
            "recall_at_1": 2 / 4,
            "recall_at_2": 3 / 4,
            "recall_at_4": 3 / 4,
            "map_at_r": (0.5 + 0.25 + 1.0) / 3,
            "r_precision": (0.5 + 0.5 + 1.0) / 3,
            "precision_at_1": 2 / 3,
        },
    )


def test_query_gallery_split_does_not_exclude_identical_gallery_item() -> None:
    # A query equal to a gallery vector is not "itself" when the sets are distinct.
    gallery = _circle([0, 90, 5, 95])
    labels = np.array([0, 1, 0, 1])
    got = retrieval_metrics(
        gallery, labels, query_embeddings=gallery[:2], query_labels=labels[:2], recall_ks=(1,)
    )
    # R_q = 2 each; top 2 are the identical item and its same-class neighbour.
    assert got == {"recall_at_1": 1.0, "map_at_r": 1.0, "r_precision": 1.0, "precision_at_1": 1.0}


def test_identical_duplicates_count_as_neighbours() -> None:
    # Self exclusion is by index: the duplicate (same vector, same class) must be the
    # first neighbour. A "drop similarity 1" rule would drop it and give 0.
    emb = np.array([[1, 0], [1, 0], [0, 1], [0, 1], [0, 1]], dtype=np.float32)
    labels = np.array([0, 0, 1, 1, 1])
    got = retrieval_metrics(emb, labels, recall_ks=(1, 2))
    _assert_close(
        got,
        {
            "recall_at_1": 1.0,
            "recall_at_2": 1.0,
            "map_at_r": 1.0,
            "r_precision": 1.0,
            "precision_at_1": 1.0,
        },
    )


def test_group_exclusion_hand_built() -> None:
    # HAND points with groups [0, 0, 1, 2, 3, 3]: q0/q1 lose each other, q4/q5 likewise.
    #   q0 A: candidates 2B 3A 4B 5B, R=1 -> P@1 0, R-Prec 0, MAP 0, hit@2, hit@4
    #   q1 A: same.  q4 B: 3A 2B 1A 0A, R=1 -> 0, 0, 0, hit@2.  q5 B: same.
    #   q2, q3: groups of one, unchanged: q2 (0, 0, 0, hit@4 only), q3 (0, 1/2, 1/4, hit@2).
    emb = _circle(HAND_DEG, HAND_SCALES)
    groups = np.array([0, 0, 1, 2, 3, 3])
    got = retrieval_metrics(
        emb, np.array(HAND_LABELS), recall_ks=(1, 2, 4), exclude_same_group=(groups, None)
    )
    _assert_close(
        got,
        {
            "recall_at_1": 0.0,
            "recall_at_2": 5 / 6,
            "recall_at_4": 1.0,
            "map_at_r": 0.25 / 6,
            "r_precision": 0.5 / 6,
            "precision_at_1": 0.0,
        },
    )
    # Passing the query groups explicitly is the same thing.
    again = retrieval_metrics(
        emb, np.array(HAND_LABELS), recall_ks=(1, 2, 4), exclude_same_group=(groups, groups)
    )
    assert again == got


def test_torch_and_numpy_inputs_agree() -> None:
    emb, labels = _clustered(np.random.default_rng(0), n_classes=12, dim=8)
    from_numpy = retrieval_metrics(emb, labels, nmi=True)
    from_torch = retrieval_metrics(torch.from_numpy(emb).double(), torch.from_numpy(labels), nmi=True)
    assert from_numpy == from_torch


def test_exact_key_set_and_order() -> None:
    emb, labels = _clustered(np.random.default_rng(1), n_classes=10, dim=8)
    assert list(retrieval_metrics(emb, labels)) == [
        "recall_at_1",
        "recall_at_2",
        "recall_at_4",
        "recall_at_8",
        "map_at_r",
        "r_precision",
        "precision_at_1",
    ]
    got = retrieval_metrics(emb, labels, recall_ks=(1, 10), nmi=True)
    assert list(got) == [
        "recall_at_1",
        "recall_at_10",
        "map_at_r",
        "r_precision",
        "precision_at_1",
        "nmi",
    ]
    assert all(isinstance(v, float) for v in got.values())


def test_format_metrics_is_one_line() -> None:
    line = format_metrics({"recall_at_1": 0.5, "map_at_r": 0.123456})
    assert line == "recall_at_1=0.5000 map_at_r=0.1235"


# ---------------------------------------------------------------- random data references


def _clustered(
    rng: np.random.Generator, n_classes: int, dim: int, max_size: int = 8, noise: float = 0.7
) -> tuple[np.ndarray, np.ndarray]:
    """Noisy clusters of 1..max_size items each (so some classes are lone)."""
    sizes = rng.integers(1, max_size + 1, size=n_classes)
    labels = np.repeat(np.arange(n_classes), sizes)
    centres = rng.standard_normal((n_classes, dim))
    emb = centres[labels] + noise * rng.standard_normal((len(labels), dim))
    perm = rng.permutation(len(labels))
    return emb[perm].astype(np.float32), labels[perm] * 7 + 3  # non-contiguous label values


def _loop_reference(
    gallery: np.ndarray,
    g_labels: np.ndarray,
    queries: np.ndarray | None,
    q_labels: np.ndarray | None,
    recall_ks: tuple[int, ...],
    g_groups: np.ndarray | None = None,
    q_groups: np.ndarray | None = None,
) -> dict[str, float]:
    """Straight per-query loop over a full float64 cosine ranking: the definitions."""
    self_query = queries is None
    if self_query:
        queries, q_labels, q_groups = gallery, g_labels, g_groups
    g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    sims = q.astype(np.float64) @ g.astype(np.float64).T
    rows, hit_rows = [], []
    for i in range(len(q)):
        cand = [
            j
            for j in np.argsort(-sims[i], kind="stable")
            if not (self_query and j == i) and not (g_groups is not None and g_groups[j] == q_groups[i])
        ]
        rel = [g_labels[j] == q_labels[i] for j in cand]
        r = sum(rel)
        hits = [any(rel[:k]) for k in recall_ks]
        hit_rows.append(hits)  # every query, a lone one as a miss
        if r == 0:
            continue
        map_r = sum(sum(rel[: k + 1]) / (k + 1) for k in range(r) if rel[k]) / r
        rows.append([*hits, rel[0], sum(rel[:r]) / r, map_r])
    m = np.mean(np.asarray(rows, dtype=np.float64), axis=0)
    recall = np.mean(np.asarray(hit_rows, dtype=np.float64), axis=0)
    out = {f"recall_at_{k}": recall[i] for i, k in enumerate(recall_ks)}
    n = len(recall_ks)
    out.update(map_at_r=m[n + 2], r_precision=m[n + 1], precision_at_1=m[n])
    return out


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("with_groups", [False, True])
def test_matches_loop_reference(split: bool, with_groups: bool) -> None:
    rng = np.random.default_rng(10 + split + 2 * with_groups)
    emb, labels = _clustered(rng, n_classes=40, dim=6, noise=1.0)
    groups = rng.integers(0, 60, size=len(labels)) if with_groups else None
    ks = (1, 3, 5)
    if split:
        n_q = len(emb) // 3
        q, ql, g, gl = emb[:n_q], labels[:n_q], emb[n_q:], labels[n_q:]
        qg, gg = (groups[:n_q], groups[n_q:]) if with_groups else (None, None)
        got = retrieval_metrics(
            g,
            gl,
            query_embeddings=q,
            query_labels=ql,
            recall_ks=ks,
            exclude_same_group=(gg, qg) if with_groups else None,
        )
        want = _loop_reference(g, gl, q, ql, ks, gg, qg)
    else:
        got = retrieval_metrics(
            emb, labels, recall_ks=ks, exclude_same_group=(groups, None) if with_groups else None
        )
        want = _loop_reference(emb, labels, None, None, ks, groups, groups)
    _assert_close(got, want, tol=1e-9)


def test_chunked_search_matches_single_search(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    emb, labels = _clustered(rng, n_classes=30, dim=8, max_size=20)
    groups = rng.integers(0, 50, size=len(labels))
    whole = retrieval_metrics(emb, labels, exclude_same_group=(groups, None))
    monkeypatch.setattr(evaluate, "_MAX_CHUNK_ELEMENTS", 50)  # a few queries per chunk
    chunked = retrieval_metrics(emb, labels, exclude_same_group=(groups, None))
    _assert_close(chunked, whole, tol=1e-12)


@pytest.mark.parametrize("split", [False, True])
def test_parity_with_pytorch_metric_learning(split: bool) -> None:
    acc_mod = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    rng = np.random.default_rng(20 + split)
    emb, labels = _clustered(rng, n_classes=60, dim=16, max_size=12, noise=1.2)
    emb_t = torch.nn.functional.normalize(torch.from_numpy(emb), dim=1)  # PML: L2 on these
    labels_t = torch.from_numpy(labels)
    calc = acc_mod.AccuracyCalculator(
        include=("mean_average_precision_at_r", "r_precision", "precision_at_1"),
        k="max_bin_count",
    )
    if split:
        n_q = len(emb) // 3
        pml = calc.get_accuracy(emb_t[:n_q], labels_t[:n_q], emb_t[n_q:], labels_t[n_q:], False)
        ours = retrieval_metrics(
            emb[n_q:],
            labels[n_q:],
            query_embeddings=emb[:n_q],
            query_labels=labels[:n_q],
            recall_ks=(1,),
        )
    else:
        pml = calc.get_accuracy(emb_t, labels_t, emb_t, labels_t, True)
        ours = retrieval_metrics(emb, labels, recall_ks=(1,))
    counts = np.bincount(labels)[labels] - (0 if split else 1)
    if split:  # gallery members of each query's class
        counts = np.array([(labels[n_q:] == y).sum() for y in labels[:n_q]])
    assert (counts == 0).any()  # lone queries exist: the two conventions differ here
    assert ours["map_at_r"] == pytest.approx(pml["mean_average_precision_at_r"], abs=1e-6)
    assert ours["r_precision"] == pytest.approx(pml["r_precision"], abs=1e-6)
    assert ours["precision_at_1"] == pytest.approx(pml["precision_at_1"], abs=1e-6)
    # Recall@1 is P@1 over every query (PML averages P@1 over the queries with R_q > 0).
    valid = (counts > 0).mean()
    assert ours["recall_at_1"] == pytest.approx(pml["precision_at_1"] * valid, abs=1e-6)


# ----------------------------------------------------------------------------------- NMI


def test_nmi_perfect_clustering_is_one() -> None:
    # Four tight clusters on orthogonal axes: k-means recovers them exactly.
    rng = np.random.default_rng(4)
    labels = np.repeat(np.arange(4), 25)
    emb = np.eye(8, dtype=np.float32)[labels] + 0.01 * rng.standard_normal((100, 8))
    got = retrieval_metrics(emb, labels, nmi=True)
    assert got["nmi"] == pytest.approx(1.0, abs=1e-6)


def test_nmi_random_labels_is_low() -> None:
    rng = np.random.default_rng(5)
    emb = rng.standard_normal((400, 16)).astype(np.float32)
    labels = rng.integers(0, 10, size=400)
    assert retrieval_metrics(emb, labels, nmi=True)["nmi"] < 0.15


def test_nmi_formula_matches_sklearn() -> None:
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(6)
    for _ in range(5):
        a = rng.integers(0, 7, size=200)
        b = np.where(rng.random(200) < 0.5, a, rng.integers(0, 9, size=200))
        want = metrics.normalized_mutual_info_score(a, b, average_method="arithmetic")
        assert evaluate._nmi_arithmetic(a, b) == pytest.approx(want, abs=1e-12)
    assert evaluate._nmi_arithmetic(np.zeros(5, int), np.zeros(5, int)) == 1.0
    assert evaluate._nmi_arithmetic(np.zeros(4, int), np.array([0, 1, 0, 1])) == 0.0


# --------------------------------------------------------------------------- bad inputs

_EMB = _circle(HAND_DEG)
_LAB = np.array(HAND_LABELS)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embeddings": _EMB, "labels": _LAB[:5]}, "5 entries for 6"),
        ({"embeddings": _EMB[:, 0], "labels": _LAB}, "must be 2-D"),
        ({"embeddings": _EMB[None], "labels": _LAB}, "must be 2-D"),
        ({"embeddings": _EMB, "labels": _LAB[:, None]}, "must be 1-D"),
        ({"embeddings": _EMB, "labels": np.zeros(6, int)}, "at least 2 classes"),
        ({"embeddings": np.where(_EMB == _EMB[2, 0], math.nan, _EMB), "labels": _LAB}, "NaN"),
        ({"embeddings": _EMB * np.array([[1], [1], [np.inf], [1], [1], [1]]), "labels": _LAB}, "NaN or inf"),
        ({"embeddings": _EMB, "labels": _LAB, "query_embeddings": _EMB}, "both"),
        ({"embeddings": _EMB, "labels": _LAB, "query_labels": _LAB}, "both"),
        ({"embeddings": _EMB, "labels": _LAB, "recall_ks": (1, 6)}, r"k=6 must be in \[1, 5\]"),
        ({"embeddings": _EMB, "labels": _LAB, "recall_ks": (0,)}, "k=0"),
        (
            {
                "embeddings": _EMB,
                "labels": _LAB,
                "query_embeddings": _EMB[:2],
                "query_labels": _LAB[:2],
                "recall_ks": (7,),
            },
            r"k=7 must be in \[1, 6\]",
        ),
        (
            {
                "embeddings": _EMB,
                "labels": _LAB,
                "query_embeddings": np.ones((2, 3)),
                "query_labels": _LAB[:2],
            },
            "dimension 3",
        ),
        (
            {
                "embeddings": _EMB,
                "labels": _LAB,
                "query_embeddings": np.ones((0, 2)),
                "query_labels": _LAB[:0],
            },
            "empty",
        ),
        ({"embeddings": _EMB, "labels": np.arange(6)}, "every R_q is 0"),
        ({"embeddings": _EMB, "labels": _LAB, "exclude_same_group": (np.arange(5), None)}, "5 entries for 6"),
        ({"embeddings": _EMB, "labels": _LAB, "exclude_same_group": np.arange(6)}, "pair"),
        (
            {
                "embeddings": _EMB,
                "labels": _LAB,
                "query_embeddings": _EMB[:2],
                "query_labels": _LAB[:2],
                "exclude_same_group": (np.arange(6), None),
            },
            "needs groups_query",
        ),
    ],
)
def test_bad_input_raises(kwargs: dict, match: str) -> None:
    kwargs = {"recall_ks": (1,), **kwargs}  # the default K=8 exceeds this 6-item gallery
    emb, labels = kwargs.pop("embeddings"), kwargs.pop("labels")
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(emb, labels, **kwargs)


# -- embed: the one inference loop (train's evaluation, the dashboard, retrain, the benchmarks) --
def test_embed_keeps_dataset_order_and_restores_the_mode():
    from torch import nn
    from torch.utils.data import Subset

    from pipelines.data import TensorImageDataset
    from pipelines.evaluate import embed

    images = torch.arange(10 * 3 * 2 * 2, dtype=torch.float32).reshape(10, 3, 2, 2)
    data = TensorImageDataset(images, torch.arange(10) % 3)
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.9))  # dropout: only eval mode is deterministic
    model.train()
    emb, labels = embed(model, Subset(data, [7, 2, 5]), batch_size=2)
    assert torch.equal(emb, images[[7, 2, 5]].flatten(1)) and labels.tolist() == [1, 2, 2]
    assert model.training and emb.dtype == torch.float32 and not emb.requires_grad
    model.eval()
    embed(model, data)
    assert not model.training

    class Exported:  # an MLflow pt2 program: callable, refuses .eval()/.train()
        training = True

        def eval(self):
            raise NotImplementedError("exported programs have no eval()")

        def train(self, mode: bool = True):
            raise NotImplementedError("exported programs have no train()")

        def __call__(self, x):
            return x.flatten(1)[:, :2]

    assert embed(Exported(), data)[0].shape == (10, 2)
    with pytest.raises(ValueError, match="dataset is empty"):
        embed(model, Subset(data, []))
