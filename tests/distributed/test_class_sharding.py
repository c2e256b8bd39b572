"""Class-sharded proxies on W gloo workers (CPU) give the numbers of one worker.

For every loss of the registry, alone and wrapped in Proxy Synthesis: for the same global
batch, W = 2 and W = 4 give the W = 1 loss, embedding and proxy gradients and Proxy-ISA
state/queue (float64: 1e-9; float32 with a bf16-autocast embedder: 1e-5), and after 5
optimiser steps (DDP embedder + sharded proxies, Adam) every parameter matches. A checkpoint
written by 2 workers resumes on 1 and on 3 workers with the same losses as an uninterrupted
run. One launch per world size runs all the losses (the workers are in sharded_workers.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import sharded_workers as workers
from tests.distributed.launch import launch

pytestmark = pytest.mark.multiprocess


def _spawn(fn, world: int, tmp_path: Path, *args) -> None:
    store = tmp_path / f"store-{fn.__name__}-w{world}"
    launch(fn, world, (world, str(store), *args))


@pytest.mark.parametrize("world", [2, 4])
def test_every_loss_sharded_matches_one_worker(world, tmp_path):
    _spawn(workers.equivalence_worker, world, tmp_path)


def test_checkpoint_of_two_workers_resumes_on_one_and_three(tmp_path):
    root = tmp_path / "ckpt"
    _spawn(workers.save_worker, 2, tmp_path, str(root))
    for name in workers.RESUME_SPECS:
        folder = root / name
        assert {p.name for p in folder.glob("loss*.pt")} == {"loss.pt", "loss.rank1.pt"}
        shards = [torch.load(folder / f, weights_only=True) for f in ("loss.pt", "loss.rank1.pt")]
        assert [(s["_shard"]["class_start"], s["_shard"]["class_end"]) for s in shards] == [(0, 6), (6, 11)]
        assert [s["_shard"]["replicated"] for s in shards] == [True, False]
        # Adam moments of the proxies travel with the shard, not in optimizer.pt.
        assert shards[1]["_proxy_optimizer"]
    # W = 1 in this process (no process group), then W = 3.
    losses_w1 = workers.resume(str(root), lambda: None)
    _spawn(workers.resume_worker, 3, tmp_path, str(root))
    losses_w3 = json.loads((root / "resumed_w3.json").read_text())
    for name in workers.RESUME_SPECS:
        assert losses_w3[name] == pytest.approx(losses_w1[name], abs=1e-9)
