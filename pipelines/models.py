"""Embedding model: backbone feature map -> global pooling -> optional LayerNorm -> linear head.

Backbones come from the one registry ``pipelines.backbones.BACKBONES`` (name -> builder
returning ``(module, channels)``); the module maps images (N, 3|1, H, W) to feature maps
(N, channels, h, w).
"""

from __future__ import annotations

import torch
from torch import nn

from pipelines.backbones import BACKBONES
from pipelines.config import ConfigError, ModelConfig


class GlobalPool(nn.Module):
    """avg | max | avg+max (the sum, as in Proxy-Anchor's code) over the spatial dims."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, h, w) -> (N, C)
        if self.mode == "avg":
            return x.mean(dim=(2, 3))
        if self.mode == "max":
            return x.amax(dim=(2, 3))
        return x.mean(dim=(2, 3)) + x.amax(dim=(2, 3))


class EmbeddingModel(nn.Module):
    """images (N, C, H, W) -> embeddings (N, embedding_dim), not normalised (losses do it)."""

    def __init__(self, cfg: ModelConfig, in_channels: int = 3) -> None:
        super().__init__()
        if cfg.backbone not in BACKBONES:
            raise ValueError(
                f"model.backbone: {cfg.backbone!r} is not available; known: {', '.join(BACKBONES)}"
            )
        self.backbone, channels = BACKBONES[cfg.backbone](cfg, in_channels)
        self.pool = GlobalPool(cfg.pooling)
        # ProxyNCA++: LayerNorm without affine parameters on the pooled features.
        self.norm = nn.LayerNorm(channels, elementwise_affine=False) if cfg.layer_norm else nn.Identity()
        self.head = nn.Linear(channels, cfg.embedding_dim)
        self.frozen_bn = cfg.frozen_bn
        if cfg.frozen_bn:
            for m in self.backbone.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.requires_grad_(False)
        # A plain list, not a ModuleList: these modules are already registered in the backbone.
        self._frozen: list[nn.Module] = frozen_stage_modules(self.backbone, cfg)
        self.frozen_depth = cfg.frozen_stages  # stages run by frozen_features
        for m in self._frozen:
            # No parameter before the first trainable layer needs a gradient, so autograd
            # records nothing there: the frozen stages' backward is skipped, not just discarded.
            m.requires_grad_(False)
        self.channels_last = cfg.channels_last
        if cfg.channels_last:
            self.backbone.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.from_frozen(self.frozen_features(images))

    def frozen_features(self, images: torch.Tensor) -> torch.Tensor:
        """images (N, C, H, W) -> the output of the frozen stages (``model.frozen_stages``; the
        images themselves when none are frozen). Constant for a given image while training,
        which is what the evaluation cache keeps (pipelines/evaluate.py)."""
        if self.channels_last and images.dim() == 4:
            # NHWC: oneDNN's (CPU) and cuDNN's (tensor cores) fast convolution layout; measured
            # 1.16 s vs 1.72 s for a Lite0 forward + backward at batch 64, 128 px on 2 cores
            # (tests/benchmarks/bench_backbone.py).
            images = images.contiguous(memory_format=torch.channels_last)
        return self.backbone.forward_stages(images, 0, self.frozen_depth) if self.frozen_depth else images

    def from_frozen(self, features: torch.Tensor) -> torch.Tensor:
        """:meth:`frozen_features` output -> embeddings (N, embedding_dim): the trainable rest."""
        x = self.backbone.forward_stages(features, self.frozen_depth) if self.frozen_depth else self.backbone(features)
        return self.head(self.norm(self.pool(x)))

    def train(self, mode: bool = True) -> EmbeddingModel:
        super().train(mode)
        if mode and self.frozen_bn:
            # Frozen BN (Proxy-Anchor recipe): running stats stay, affine stays (see optimiser).
            for m in self.backbone.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        if mode:
            for m in self._frozen:  # frozen stages keep their BatchNorm statistics too
                m.eval()
        return self


def frozen_stage_modules(backbone: nn.Module, cfg: ModelConfig) -> list[nn.Module]:
    """The modules of the backbone's first ``cfg.frozen_stages`` stages (the stem is stage 1)."""
    if not cfg.frozen_stages:
        return []
    stages = getattr(backbone, "stages", None)
    if stages is None:
        raise ConfigError(f"model.frozen_stages: backbone {cfg.backbone} does not define stages")
    found = stages()
    if cfg.frozen_stages > len(found):
        raise ConfigError(
            f"model.frozen_stages={cfg.frozen_stages}, but backbone {cfg.backbone} has {len(found)} stages "
            f"(the stem counts as the first)"
        )
    return [m for stage in found[: cfg.frozen_stages] for m in stage]
