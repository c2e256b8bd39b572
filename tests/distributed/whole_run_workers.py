"""Worker code of the whole-run equivalence tests, run in forked children (tests/distributed/launch.py).

Each child joins a gloo group over loopback and runs the real training recipe
(``pipelines.train.run``) on a small image folder, writing its checkpoints through a
``LocalReporter`` shared by all ranks (their file names differ, so one checkpoint per epoch
holds every rank's part, as with Ray Train).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from pipelines.config import from_dict, load_config
from pipelines.tracking import LocalReporter
from pipelines.train import run
from tests.distributed.sharded_workers import shutdown_process_group

TRAIN_CLASSES, TEST_CLASSES, PER_CLASS, SIZE = 6, 4, 8, 20


def make_image_folder(root: Path) -> Path:
    """``root/train/<class>`` (6 classes) and ``root/test/<class>`` (4), 8 RGB 20x20 PNGs each.

    Each class is a colour and a stripe orientation plus per-image noise: learnable, and
    asymmetric, so random crops and flips change what the network sees.
    """
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    for part, classes in (("train", range(TRAIN_CLASSES)), ("test", range(TRAIN_CLASSES, TRAIN_CLASSES + TEST_CLASSES))):
        for c in classes:
            folder = root / part / f"class{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = rng.integers(90, 165, 3)
            angle = np.pi * c / (TRAIN_CLASSES + TEST_CLASSES)
            stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 0.9 + xx * 0.05 * c)
            for i in range(PER_CLASS):
                noise = rng.normal(0, 70, (SIZE, SIZE, 3))
                img = colour + 60 * stripes[..., None] + noise
                img[: 4 + i % 5, : 3 + c % 4] = 255  # an off-centre corner mark
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def overrides(data_root: Path, *extra: str) -> list[str]:
    """Trainable BatchNorm, random crops and flips, SGD, clipping and a warm-up epoch."""
    return [
        "data.name=folder", f"data.root={data_root}", "data.image_size=16", "data.crop_scale_min=0.5",
        "data.random_flip=true", "data.batch_size=24", "data.samples_per_class=4", "data.eval_batch_size=7",
        "model.backbone=convnet", "model.width=8", "model.embedding_dim=16", "model.frozen_bn=false",
        "loss.name=proxy_anchor", "optim.name=sgd", "optim.lr=0.05", "optim.proxy_lr_multiplier=10",
        "optim.grad_clip_value=0.05", "optim.warmup_epochs=1", "train.epochs=3", "train.recall_ks=[1,2]",
        *extra,
    ]


class ArtifactFolder:
    """A Tracker keeping only the artifacts, under ``root/<artifact_path>`` (rank 0 uses it)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        shutil.copytree(local_dir, self.root / (artifact_path or ""), dirs_exist_ok=True)


def train_worker(rank: int, world: int, store_file: str, data_root: str, out: str, extra: list[str]) -> None:
    """One rank of a W-worker run; checkpoints under ``out``."""
    cfg = load_config(None, overrides(Path(data_root), f"scaling.num_workers={world}", *extra))
    config_worker(rank, world, store_file, cfg.to_dict(), out)


def config_worker(rank: int, world: int, store_file: str, config: dict, out: str) -> None:
    """One rank of a W-worker run of ``config`` (a resolved ``Config.to_dict()``) on the torch
    threads a Ray Train worker of it gets; checkpoints under ``out``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    cfg = from_dict(config)
    torch.set_num_threads(cfg.scaling.threads)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        run(cfg, LocalReporter(Path(out)), ArtifactFolder(Path(out) / "artifacts"))
        dist.barrier()  # every rank's shard is in the checkpoint before the parent reads it
    finally:
        shutdown_process_group()
