"""Image transforms per recipe and the file-list dataset every file-based loader uses.

Training: ``RandomResizedCrop(image_size, scale=(crop_scale_min, 1))`` + an optional horizontal
flip (``data.random_flip``; emoji recipes turn it off). Evaluation: resize the short side to
``eval_resize`` (default ``8/7 x image_size``: 256 for 224) + centre crop ``image_size``, both
times ``eval_scale`` (default 1). Both end
in ``ToTensor`` (values in ``[0, 1]``): normalisation belongs to the backbone. Decoding happens
in ``__getitem__``, i.e. in the DataLoader workers (``data.loader_workers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from PIL import Image
from torch.utils.data import Dataset

from pipelines.config import DataConfig
from pipelines.data.types import DataError

Transform = Callable[[Image.Image], torch.Tensor]


def train_transform(cfg: DataConfig, size: int) -> Transform:
    """PIL image -> (3, size, size) float in [0, 1]; ``size`` 0 keeps the native size (no crop)."""
    # Imported here: torchvision pulls in torch._dynamo (~2 CPU-s per process on 2 cores), which
    # every Train worker, trial and CLI process would pay although digits never transforms a PIL image.
    from torchvision import transforms as T

    steps: list = []
    if size:
        steps.append(T.RandomResizedCrop(size, scale=(cfg.crop_scale_min, 1.0), antialias=True))
    if cfg.random_flip:
        steps.append(T.RandomHorizontalFlip())
    return T.Compose([*steps, T.ToTensor()])


def eval_size(cfg: DataConfig, size: int) -> int:
    """The evaluation crop for training crop ``size``: ``size x data.eval_scale`` (0 stays native)."""
    return round(size * cfg.eval_scale)


def eval_transform(cfg: DataConfig, size: int) -> Transform:
    """PIL image -> (3, s, s) float in [0, 1], s = ``eval_size(cfg, size)``: resize short side, centre crop."""
    from torchvision import transforms as T  # start-up cost, as in train_transform

    if not size:
        return T.Compose([T.ToTensor()])
    crop = eval_size(cfg, size)
    resize = round(cfg.eval_resize * cfg.eval_scale) if cfg.eval_resize else round(crop * 8 / 7)
    return T.Compose([T.Resize(resize, antialias=True), T.CenterCrop(crop), T.ToTensor()])


class ImageListDataset(Dataset):
    """Images listed as ``(path, label)``; yields ``(image (3, H, W), label, index)``.

    Every listed file must exist when the dataset is built (one ``stat`` each): a missing
    file is an error naming it, never a silently shorter dataset. A file that cannot be
    decoded raises DataError naming it when it is read.
    """

    def __init__(
        self,
        samples: Sequence[tuple[Path, int]],
        transform: Transform,
        name: str,
        classes: Sequence[str] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.samples = [(Path(p), int(y)) for p, y in samples]
        self.transform = transform
        self.name = name
        self.classes = list(classes) if classes is not None else sorted({str(y) for _, y in self.samples})
        # What a person reads for label y (e.g. an emoji's name where ``classes`` holds code points).
        self.names = list(names) if names is not None else self.classes
        missing = [p for p, _ in self.samples if not p.is_file()]
        if missing:
            raise DataError(
                f"{name}: {len(missing)} of {len(self.samples)} listed image(s) are missing, e.g. {missing[0]}"
            )

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def targets(self) -> list[int]:
        return [y for _, y in self.samples]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        path, label = self.samples[index]
        return self.transform(load_image(path)), label, index


def load_image(source: Path | BinaryIO, name: str | None = None) -> Image.Image:
    """Decode an image file (a path, or its bytes as a file object called ``name``) to RGB;
    DataError naming the file if it cannot be."""
    try:
        with Image.open(source) as im:
            return im.convert("RGB")  # convert() also forces the full decode inside the try
    except Exception as exc:  # PIL raises several types for a bad file
        detail = str(exc).replace(str(source), "it") if name else exc  # not a BytesIO's repr
        raise DataError(f"cannot decode image {name or source}: {detail}") from exc
