"""Generic image folders: ``root/train/<class>/*`` (seen classes) and ``root/test/<class>/*``."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision import datasets, transforms

from pipelines.config import DataConfig


class ImageFolderDataset(datasets.ImageFolder):
    """torchvision's ImageFolder yielding ``(image, label, index)``; errors name the file."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        path, label = self.samples[index]
        try:
            image = self.loader(path)
        except Exception as exc:  # PIL raises several types for a bad file
            from pipelines.data import DataError

            raise DataError(f"cannot decode image {path}: {exc}") from exc
        if self.transform is not None:
            image = self.transform(image)
        return image, label, index


def image_folder(cfg: DataConfig) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    from pipelines.data import DataError

    root = Path(cfg.root)
    if not cfg.root:
        raise DataError("data.root must name the image folder for data.name=folder")
    steps = [transforms.Resize((cfg.image_size, cfg.image_size))] if cfg.image_size else []
    tf = transforms.Compose([*steps, transforms.ToTensor()])
    out = []
    for part in ("train", "test"):
        folder = root / part
        if not folder.is_dir():
            raise DataError(f"image folder {folder} does not exist")
        try:
            out.append(ImageFolderDataset(str(folder), transform=tf))
        except (FileNotFoundError, PermissionError) as exc:
            raise DataError(f"image folder {folder}: {exc}") from exc
    return out[0], out[1]
