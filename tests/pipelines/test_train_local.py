"""The train loop in one process (no Ray): checkpoint contents and an exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipelines.checkpoint import CHECKPOINT_FILES
from pipelines.config import load_config
from pipelines.tracking import LocalReporter
from pipelines.train import (
    TIMING_METRICS,
    evaluate_checkpoint,
    group_learning_rates,
    retarget_learning_rates,
    run,
)

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


def _optimizer(cfg):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    groups = [{"params": [p], "name": name, "lr": lr} for p, (name, lr) in zip(params, group_learning_rates(cfg).items())]
    optimizer = torch.optim.SGD(groups, lr=cfg.optim.lr)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs)


def test_a_checkpoint_of_other_learning_rates_goes_on_at_this_configs_rates_on_the_same_schedule():
    # A PBT exploit: trial B loads trial A's optimiser (lr 1e-3, proxies x10) two epochs into a
    # cosine schedule and goes on with its own perturbed lr 1.2e-3 and proxy multiplier 8.
    donor = load_config("digits", ["optim.lr=1e-3", "optim.proxy_lr_multiplier=10", "train.epochs=4"])
    opt_a, sched_a = _optimizer(donor)
    for _ in range(2):
        opt_a.step()
        sched_a.step()
    cosine = [g["lr"] / base for g, base in zip(opt_a.param_groups, sched_a.base_lrs)]
    cfg = load_config("digits", ["optim.lr=1.2e-3", "optim.proxy_lr_multiplier=8", "train.epochs=4"])
    opt_b, sched_b = _optimizer(cfg)
    opt_b.load_state_dict(opt_a.state_dict())
    sched_b.load_state_dict(sched_a.state_dict())
    assert retarget_learning_rates(cfg, opt_b, sched_b) == ["backbone", "head", "proxies"]
    want = group_learning_rates(cfg)
    for group, factor in zip(opt_b.param_groups, cosine):
        assert group["lr"] == pytest.approx(want[group["name"]] * factor, rel=1e-12)
    sched_b.step()  # the schedule goes on from the new base rates
    assert opt_b.param_groups[0]["lr"] == pytest.approx(1.2e-3 * (1 + math.cos(math.pi * 3 / 4)) / 2, rel=1e-9)
    # a plain resume (same rates): nothing moves, bit for bit
    opt_c, sched_c = _optimizer(donor)
    opt_c.load_state_dict(opt_a.state_dict())
    sched_c.load_state_dict(sched_a.state_dict())
    assert retarget_learning_rates(donor, opt_c, sched_c) == []
    assert [g["lr"] for g in opt_c.param_groups] == [g["lr"] for g in opt_a.param_groups]
