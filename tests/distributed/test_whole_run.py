"""The whole training run on W gloo workers gives the one-worker run: model, BatchNorm,
augmentation, RNG and evaluation, not only the loss.

The real recipe (``pipelines.train.run``) on a small image folder with trainable BatchNorm
(synchronised), random crops and flips, SGD (not scale-invariant: a wrong gradient scale
shows), gradient clipping and a warm-up epoch. W = 1, 2 and 4 after 3 epochs (6 steps) give
the same parameters, BatchNorm buffers, proxies, losses and retrieval metrics; a W = 2 run
stopped after epoch 2 and resumed ends bit-identical to the uninterrupted one, and
``evaluate_checkpoint`` on its final checkpoint gives the logged metrics exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.train import TIMING_METRICS, evaluate_checkpoint
from tests.distributed import whole_run_workers as workers
from tests.distributed.launch import launch

pytestmark = pytest.mark.multiprocess

LAST = "checkpoint_000003"
# Float32 tolerance of W workers against one. The global batch's gradient is summed in
# another order (per rank, then all-reduced), and so are SyncBatchNorm's statistics, so the
# values differ in the last bits after each step and SGD carries that on. Measured over the
# 6 steps: max |diff| 4.8e-6 on parameters, BN buffers and proxies (|proxy| up to 1.7), and
# relative 1e-6 on the epoch losses. A wrong gradient scale, per-rank BatchNorm
# (model.sync_bn=false: 0.5) or per-rank augmentation are off by far more than 2e-5.
STATE_TOL = 2e-5
LOSS_REL = 1e-5
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same run on 1, 2 and 4 workers, and a W = 2 run stopped after epoch 2 and resumed."""
    tmp = tmp_path_factory.mktemp("whole_run")
    data = workers.make_image_folder(tmp / "data")
    out = {}

    def spawn(name: str, world: int, *extra: str, folder: str | None = None) -> None:
        dest = tmp / (folder or name)
        launch(workers.train_worker, world, (world, str(tmp / f"store-{name}"), str(data), str(dest), list(extra)))
        out[folder or name] = dest

    for world in (1, 2, 4):
        spawn(f"w{world}", world)
    spawn("resumed-part1", 2, "train.epochs=2", folder="resumed")
    spawn("resumed-part2", 2, folder="resumed")
    return out


def _state(folder: Path) -> dict[str, torch.Tensor]:
    """Model parameters and buffers, plus the proxies of every shard in class order."""
    ckpt = folder / LAST
    state = dict(torch.load(ckpt / "model.pt", weights_only=True))
    shards = [torch.load(f, weights_only=True) for f in [ckpt / "loss.pt", *sorted(ckpt.glob("loss.rank*.pt"))]]
    state["proxies"] = torch.cat([s["proxies"] for s in shards])
    return state


def _history(folder: Path) -> list[dict[str, float]]:
    hist = json.loads((folder / LAST / "trainer_state.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k not in TIMING_METRICS} for h in hist]


@pytest.mark.parametrize("world", [2, 4])
def test_w_workers_train_the_one_worker_model(runs, world):
    want, got = _state(runs["w1"]), _state(runs[f"w{world}"])
    assert set(got) == set(want)
    bn = [k for k in want if k.endswith(("running_mean", "running_var"))]
    assert bn, "the convnet has trainable BatchNorm"
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, atol=STATE_TOL, rtol=STATE_TOL,
                                       msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(got[key], value), key  # num_batches_tracked
    # Training moved the model: equality is not that of an untouched init.
    init = torch.load(runs["w1"] / "checkpoint_000001" / "model.pt", weights_only=True)
    assert not torch.allclose(init["head.weight"], want["head.weight"], atol=1e-3)
    one, many = _history(runs["w1"]), _history(runs[f"w{world}"])
    assert [h["loss"] for h in many] == pytest.approx([h["loss"] for h in one], rel=LOSS_REL)
    # The final model's retrieval metrics are equal. Earlier epochs compare the loss only: this
    # tiny model's embeddings are barely spread then (cosines within 1e-5 of 1), so rankings
    # hold near-ties at the fp32 resolution (gaps of 6e-8) and one query may flip.
    assert {k: v for k, v in many[-1].items() if k != "loss"} == {k: v for k, v in one[-1].items() if k != "loss"}
    assert 0.5 < one[-1]["recall_at_1"] < 1 and 0.3 < one[-1]["map_at_r"] < 1  # not a trivial score


def test_resume_is_bit_identical_to_the_uninterrupted_run(runs):
    want, got = _state(runs["w2"]), _state(runs["resumed"])
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert _history(runs["resumed"]) == _history(runs["w2"])
    state = json.loads((runs["resumed"] / LAST / "trainer_state.json").read_text())
    assert state["resumes"] == 1


def test_checkpoint_evaluation_reproduces_the_logged_metrics_exactly(runs):
    logged = _history(runs["w2"])[-1]
    again = evaluate_checkpoint(runs["w2"] / LAST)
    for key in ("recall_at_1", "recall_at_2", "map_at_r", "r_precision", "precision_at_1"):
        assert again[key] == logged[key], key


def test_the_proxy_plot_shows_the_whole_bank_on_any_worker_count(runs):
    """The dashboard's proxy-similarity matrix gathers every shard: W = 2 and 4 write the
    one-worker matrix (within STATE_TOL, the proxies' own whole-run tolerance) over all
    classes, and the title counts them all."""
    import numpy as np

    from pipelines.plots import PROXY_SIMILARITY_DATA

    def load(name: str) -> dict:
        with np.load(runs[name] / "artifacts" / "plots" / PROXY_SIMILARITY_DATA) as data:
            return {k: data[k] for k in data.files}

    one = load("w1")
    classes = _state(runs["w1"])["proxies"].shape[0]
    assert int(one["num_classes"]) == classes and len(one["classes"]) == min(classes, 100)
    assert (runs["w1"] / "artifacts" / "plots" / "proxy_similarity.png").stat().st_size > 10_000
    for name in ("w2", "w4"):
        other = load(name)
        assert int(other["num_classes"]) == classes, name
        assert np.array_equal(other["classes"], one["classes"]), name
        np.testing.assert_allclose(other["similarity"], one["similarity"], atol=STATE_TOL, rtol=0)
        assert str(other["title"]).splitlines()[0] == f"proxy similarity of {classes} classes", name
