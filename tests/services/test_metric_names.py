"""The retrieval metric keys services check and show come from pipelines.evaluate's one list."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.evaluate import is_retrieval_metric, metric_names, retrieval_metrics
from services import report, retrain


@pytest.mark.parametrize("ks, nmi", [((1, 2, 4, 8), False), ((1, 5), True)])
def test_metric_names_are_the_keys_retrieval_metrics_reports(ks, nmi):
    rng = np.random.default_rng(0)
    emb, labels = rng.normal(size=(40, 8)).astype(np.float32), np.repeat(np.arange(4), 10)
    reported = retrieval_metrics(emb, labels, recall_ks=ks, nmi=nmi)
    assert tuple(reported) == metric_names(ks, nmi=nmi)
    assert all(is_retrieval_metric(k, nmi=True) for k in reported)
    assert [k for k in reported if is_retrieval_metric(k)] == [k for k in reported if k != "nmi"]


def test_selection_metrics_and_report_order():
    for key in ("map_at_r", "r_precision", "precision_at_1", "recall_at_1", "recall_at_16"):
        assert is_retrieval_metric(key)
        retrain.check_metric(key)
    for key in ("nmi", "loss", "recall_at_", "recall_at_x", "xgroup_recall_at_1"):
        assert not is_retrieval_metric(key)
        with pytest.raises(retrain.RetrainError, match="not a reported retrieval metric"):
            retrain.check_metric(key)
    assert report._METRIC_ORDER == (*metric_names((1, 2, 4, 8), nmi=True), "loss")
