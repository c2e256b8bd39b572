"""Evaluation that runs only the trainable top of a partly frozen model.

With ``model.frozen_stages=N`` the first N backbone stages map each evaluation image to the
same activations every epoch: their weights and BatchNorm statistics never change, and the
evaluation transform is deterministic. :class:`FrozenFeatureCache` keeps those activations
(per rank, for the rank's own chunks of the evaluation set) after the first evaluation, so
the later ones skip image decoding and the frozen stages. The embeddings are computed by the
same operations on the same batches, so they are bit-identical to the uncached path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pipelines.evaluate import embed, eval_autocast


def frozen_fingerprint(model: nn.Module, frozen: list[nn.Module], dataset: Dataset) -> str:
    """What the cached activations depend on: the frozen stages' weights and statistics,
    the evaluation transform and the items. A change to any of them means a new cache."""
    h = hashlib.sha256()
    for m in frozen:
        for name, t in sorted(m.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update(repr(getattr(dataset, "transform", None)).encode())
    h.update(repr(getattr(getattr(dataset, "dataset", None), "transform", None)).encode())
    h.update(repr(getattr(dataset, "indices", None)).encode())
    h.update(str(len(dataset)).encode())  # type: ignore[arg-type]
    return h.hexdigest()


@dataclass
class FrozenFeatureCache:
    """The frozen stages' outputs of one rank's evaluation batches, kept in memory.

    ``max_bytes`` bounds it (``data.eval_cache_mb``): a set whose activations would not fit
    is embedded the plain way every time, with one note.
    """

    max_bytes: int
    key: str = ""
    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    too_large: bool = False
    hits: int = 0  # evaluations served from the cache (tests, benchmarks)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a, _ in self.batches)


@torch.no_grad()
def embed_frozen_cached(
    model: nn.Module, dataset: Dataset, batch_size: int, device: torch.device | str, workers: int,
    cache: FrozenFeatureCache | None, precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`pipelines.evaluate.embed`: (N, d) float32 embeddings and (N,) labels on the CPU.

    ``model`` is an ``EmbeddingModel``; without frozen stages or a cache this is ``embed``.
    Under bf16 autocast (``precision``) the cache keeps the bf16 activations the frozen stages
    return, so ``model(x) == from_frozen(frozen_features(x))`` still holds to the bit.
    """
    depth = getattr(model, "frozen_depth", 0)
    if cache is None or not depth or cache.max_bytes <= 0 or cache.too_large:
        return embed(model, dataset, batch_size, device, workers, precision)
    was_training = model.training
    model.eval()
    try:
        # the precision changes the activations (bf16 autocast), so it is part of the key
        key = frozen_fingerprint(model, model._frozen, dataset) + precision  # type: ignore[arg-type]
        if cache.key == key and cache.batches:
            cache.hits += 1
            embs = []
            for acts, _ in cache.batches:
                with eval_autocast(precision, device):
                    out = model.from_frozen(acts)  # type: ignore[operator]
                embs.append(out.float().cpu())
            return torch.cat(embs), torch.cat([y for _, y in cache.batches])
        cache.key, cache.batches = key, []
        embs, labels = [], []
        for images, y, *_ in DataLoader(dataset, batch_size=batch_size, num_workers=workers):
            with eval_autocast(precision, device):
                acts = model.frozen_features(images.to(device))  # type: ignore[operator]
                out = model.from_frozen(acts)  # type: ignore[operator]
            embs.append(out.float().cpu())
            labels.append(torch.as_tensor(y).long())
            if not cache.too_large:
                cache.batches.append((acts, labels[-1]))
                if cache.nbytes() * len(dataset) / max(1, sum(len(b) for b, _ in cache.batches)) > cache.max_bytes:  # type: ignore[arg-type]
                    print(f"note: frozen-stage activations of {len(dataset)} evaluation items exceed "  # type: ignore[arg-type]
                          f"data.eval_cache_mb={cache.max_bytes // 2**20}; evaluating without the cache", flush=True)
                    cache.too_large, cache.batches = True, []
        if not embs:
            raise ValueError("embed: the dataset is empty")
        return torch.cat(embs), torch.cat(labels)
    finally:
        if was_training:
            model.train()
