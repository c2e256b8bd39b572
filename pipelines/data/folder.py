"""Generic image folders: ``root/train/<class>/*`` (seen classes) and ``root/test/<class>/*``."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision import datasets

from pipelines.config import DataConfig
from pipelines.data.transforms import eval_transform, load_image, train_transform
from pipelines.data.types import DataError


class ImageFolderDataset(datasets.ImageFolder):
    """torchvision's ImageFolder yielding ``(image, label, index)``; errors name the file."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        path, label = self.samples[index]
        image = load_image(Path(path))  # RGB; DataError naming the file if it cannot be decoded
        if self.transform is not None:
            image = self.transform(image)
        return image, label, index


def image_folder(cfg: DataConfig) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    root = Path(cfg.root)
    if not cfg.root:
        raise DataError("data.root must name the image folder for data.name=folder")
    out = []
    for part in ("train", "test"):
        # Recipe transforms (random crop/flip for training, resize + centre crop to evaluate);
        # image_size 0 keeps the files' own size.
        size = cfg.image_size
        tf = train_transform(cfg, size) if part == "train" else eval_transform(cfg, size)
        folder = root / part
        if not folder.is_dir():
            raise DataError(f"image folder {folder} does not exist")
        try:
            out.append(ImageFolderDataset(str(folder), transform=tf))
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise DataError(f"image folder {folder}: {exc}") from exc
    return out[0], out[1]
