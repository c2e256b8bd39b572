"""The evaluation cache of frozen-stage activations gives the uncached scores, to the bit."""

from __future__ import annotations

import pytest
import torch

from pipelines.config import ConfigError, load_config
from pipelines.data import build_datasets
from pipelines.eval_cache import FrozenFeatureCache
from pipelines.evaluate import embed, native_bf16
from pipelines.models import EmbeddingModel
from pipelines.train import evaluate


def _setup(*extra: str):
    cfg = load_config("digits", ["model.width=8", "model.frozen_stages=2", "data.eval_batch_size=100", *extra])
    split = build_datasets(cfg.data)
    torch.manual_seed(0)
    return cfg, split, EmbeddingModel(cfg.model, in_channels=1)


def test_cached_evaluation_equals_uncached_and_skips_the_frozen_stages(monkeypatch):
    cfg, split, model = _setup()
    cache = FrozenFeatureCache(2**30)
    first = evaluate(model, split, cfg, torch.device("cpu"), cache)
    assert cache.batches and cache.hits == 0
    calls = []
    real = model.frozen_features
    monkeypatch.setattr(model, "frozen_features", lambda x: calls.append(len(x)) or real(x))
    # The trainable top moves between evaluations; the cache must follow it, not freeze the scores.
    with torch.no_grad():
        model.head.weight.mul_(-1.5).add_(0.1)
        model.backbone[6].weight.mul_(0.5)  # the third conv block: trainable (frozen_stages=2)
    cached = evaluate(model, split, cfg, torch.device("cpu"), cache)
    assert cache.hits == 1 and calls == []  # no image and no frozen stage was run again
    plain = evaluate(model, split, cfg, torch.device("cpu"), None)
    assert cached == plain  # every metric, exactly
    assert cached != first


def test_a_change_to_the_frozen_stages_rebuilds_the_cache():
    cfg, split, model = _setup()
    cache = FrozenFeatureCache(2**30)
    evaluate(model, split, cfg, torch.device("cpu"), cache)
    with torch.no_grad():
        model.backbone[0].weight.mul_(-1)  # a frozen conv (e.g. a checkpoint of another run)
    again = evaluate(model, split, cfg, torch.device("cpu"), cache)
    assert cache.hits == 0
    assert again == evaluate(model, split, cfg, torch.device("cpu"), None)


def test_a_set_too_large_for_the_budget_is_evaluated_without_the_cache(capsys):
    cfg, split, model = _setup()
    cache = FrozenFeatureCache(1000)  # bytes: far below one batch's activations
    small = evaluate(model, split, cfg, torch.device("cpu"), cache)
    assert cache.too_large and not cache.batches
    assert "exceed data.eval_cache_mb" in capsys.readouterr().out
    assert small == evaluate(model, split, cfg, torch.device("cpu"), None)


def test_bf16_evaluation_is_cached_to_the_bit_and_runs_in_bf16_where_native():
    cfg, split, model = _setup("train.eval_precision=bf16")
    cache = FrozenFeatureCache(2**30)
    filled = evaluate(model, split, cfg, torch.device("cpu"), cache)
    cached = evaluate(model, split, cfg, torch.device("cpu"), cache)
    assert cache.hits == 1
    assert filled == cached == evaluate(model, split, cfg, torch.device("cpu"), None)
    ds = split.test
    fp32, _ = embed(model, ds, 100)
    bf16, _ = embed(model, ds, 100, precision="bf16")
    if native_bf16("cpu"):  # AMX / AVX512-BF16: the forward really ran in bfloat16
        assert not torch.equal(fp32, bf16)
        assert torch.nn.functional.cosine_similarity(fp32, bf16).min() > 0.99  # bf16 keeps ~3 digits
    else:  # no native bf16: fp32 (emulated bf16 would be slower than fp32)
        assert torch.equal(fp32, bf16)


def test_the_fp32_cache_is_not_served_to_a_bf16_evaluation():
    cfg, split, model = _setup()
    cache = FrozenFeatureCache(2**30)
    evaluate(model, split, cfg, torch.device("cpu"), cache)
    bf16 = load_config("digits", ["model.width=8", "model.frozen_stages=2", "data.eval_batch_size=100",
                                  "train.eval_precision=bf16"])
    evaluate(model, split, bf16, torch.device("cpu"), cache)
    assert cache.hits == 0  # refilled: bf16 activations are not the fp32 ones


def test_eval_precision_is_checked():
    with pytest.raises(ConfigError, match="train.eval_precision"):
        load_config("digits", ["train.eval_precision=fp16"])
