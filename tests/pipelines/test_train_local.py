"""The train loop in one process (no Ray): checkpoint contents and an exact resume."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.checkpoint import CHECKPOINT_FILES
from pipelines.config import load_config
from pipelines.tracking import LocalReporter
from pipelines.train import TIMING_METRICS, evaluate_checkpoint, run

OVERRIDES = ["train.max_steps_per_epoch=5", "scaling.num_workers=1", "model.width=8"]


@pytest.mark.parametrize("loss", ["proxy_anchor", "norm_softmax", "proxy_isa"])
def test_resume_continues_exactly_where_it_stopped(tmp_path, loss):
    extra = [f"loss.name={loss}", "loss.memory_start_epoch=1"] if loss == "proxy_isa" else [f"loss.name={loss}"]
    straight = LocalReporter(tmp_path / "straight")
    run(load_config("digits", [*OVERRIDES, *extra, "train.epochs=3"]), straight)

    split = LocalReporter(tmp_path / "split")
    run(load_config("digits", [*OVERRIDES, *extra, "train.epochs=2"]), split)
    run(load_config("digits", [*OVERRIDES, *extra, "train.epochs=3"]), split)

    assert [h["epoch"] for h in split.history] == [1, 2, 3]
    # Bit-identical on CPU: data order, augmentation seeds, optimiser and every RNG restored.
    for a, b in zip(straight.history, split.history):
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == {
            k: v for k, v in b.items() if k not in TIMING_METRICS}
    last = "checkpoint_000003"
    for name in ("model.pt", "loss.pt"):
        want = torch.load(tmp_path / "straight" / last / name, weights_only=True)
        got = torch.load(tmp_path / "split" / last / name, weights_only=True)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), (name, key)


def test_checkpoint_holds_everything_and_evaluates(tmp_path):
    rep = LocalReporter(tmp_path)
    metrics = run(load_config("digits", [*OVERRIDES, "train.epochs=1"]), rep)
    ckpt = sorted(tmp_path.glob("checkpoint_*"))[-1]
    assert {p.name for p in ckpt.iterdir()} == set(CHECKPOINT_FILES)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["epoch"] == 1 and len(state["history"]) == 1
    loss_state = torch.load(ckpt / "loss.pt", weights_only=True)
    assert loss_state["proxies"].shape == (5, 64)
    again = evaluate_checkpoint(ckpt)
    for key in ("recall_at_1", "map_at_r", "r_precision", "precision_at_1"):
        assert again[key] == metrics[key], key  # the same chunks through the same model: exact


def test_eval_every_scores_every_nth_and_the_last_epoch_and_trains_the_same(tmp_path):
    every = LocalReporter(tmp_path / "every")
    run(load_config("digits", [*OVERRIDES, "train.epochs=3"]), every)
    sparse = LocalReporter(tmp_path / "sparse")
    cfg = load_config("digits", [*OVERRIDES, "train.epochs=3", "train.eval_every=2"])
    assert cfg.run_name() == load_config("digits", [*OVERRIDES, "train.epochs=3"]).run_name()
    run(cfg, sparse)
    assert ["map_at_r" in h for h in sparse.history] == [False, True, True]  # epoch 2, and the last
    for a, b in zip(every.history, sparse.history):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)  # looking less does not change training
    assert sparse.history[-1]["map_at_r"] == pytest.approx(every.history[-1]["map_at_r"], abs=1e-6)


def test_validation_split_trains_fewer_proxies_and_the_checkpoint_scores_the_test_classes(tmp_path):
    # Choose settings on 2 held-out seen digits, then score the same model on the unseen 5-9.
    rep = LocalReporter(tmp_path)
    val = run(load_config("digits", [*OVERRIDES, "train.epochs=1", "data.val_classes=2", "data.batch_size=48"]), rep)
    ckpt = sorted(tmp_path.glob("checkpoint_*"))[-1]
    assert torch.load(ckpt / "loss.pt", weights_only=True)["proxies"].shape == (3, 64)
    assert evaluate_checkpoint(ckpt)["map_at_r"] == pytest.approx(val["map_at_r"], abs=1e-6)
    test = evaluate_checkpoint(ckpt, ["data.val_classes=0"])
    # 2 held-out digits x ~180 images vs 5 unseen digits x ~180: different sets, different scores.
    assert test["map_at_r"] != pytest.approx(val["map_at_r"], abs=1e-3)
    assert 0.0 < test["recall_at_1"] <= 1.0
