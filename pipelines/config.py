"""One typed configuration for a ProxyDML run.

The same dotted names (``loss.temperature``, ``optim.lr`` ...) are used everywhere: CLI
overrides, Ray Tune search spaces, MLflow params and the ``config.yaml`` stored with every
checkpoint. YAML recipes hold only what differs from these defaults.

Validation happens here, before any worker starts, and every error names the dotted key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.backbones import BACKBONES
from pipelines.data import DATASETS
from proxies import LOSSES, HyperParameterError, NormSoftmaxLoss, ProxySynthesis, build_loss
from proxies.synthesis import DEFAULT_ALPHA, DEFAULT_MU

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
EVAL_PRECISIONS = ("fp32", "bf16")  # train.eval_precision; pipelines.evaluate.eval_autocast runs them


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted key."""


def doc(text: str, default: Any = dataclasses.MISSING, *, loss_argument: bool = True) -> Any:
    """A dataclass field carrying its documentation (shown by ``proxydml config show``).

    ``loss_argument=False`` marks a ``loss.*`` field that is not a constructor argument of the
    loss (see :meth:`LossConfig.hyper_parameters`).
    """
    metadata = {"doc": text, "loss_argument": loss_argument}
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class DataConfig:
    name: str = doc("dataset: " + " | ".join(DATASETS), "digits")
    root: str = doc(
        "dataset folder (file-based datasets); empty = ./data/<data.name>, e.g. ./data/emoji; or "
        "s3://bucket/prefix (uploaded with `proxydml data push`): each node downloads it once into "
        "its cache ($PROXYDML_CACHE, default ~/.cache/proxydml), verified against its manifest", ""
    )
    batch_size: int = doc("global batch size (split evenly over the workers)", 64)
    samples_per_class: int = doc(
        "class-balanced sampling: n samples per class per batch (0 = plain shuffling)", 16
    )
    image_size: int = doc(
        "training crop / eval centre-crop side in pixels, e.g. 224, 227, 256 (0 = native: the built "
        "size for emoji, 224 for cub/cars/sop/inshop, the files' own size for folder)", 0
    )
    loader_workers: int = doc("DataLoader decoding processes per training worker", 0)
    # 64, not larger: a Lite0 batch of 256 at 160 px spills its activations out of the CPU caches
    # (the trainable top of the emoji recipe: 33 s per evaluation at 256, 14 s at 64, the same
    # embeddings to the bit; README, evaluation cost).
    eval_batch_size: int = doc("batch size when embedding the evaluation set", 64)
    random_flip: bool = doc(
        "training: random horizontal flips (off for emoji: a flip turns directional emoji into other classes)",
        True,
    )
    crop_scale_min: float = doc("training: RandomResizedCrop smallest area fraction (1.0 = no crop)", 0.08)
    eval_resize: int = doc(
        "evaluation: resize the short side to this, then centre-crop image_size (0 = 8/7 x image_size)", 0
    )
    eval_scale: float = doc(
        "evaluation images at this multiple of the training size (both eval_resize and the crop); "
        "a little above 1 undoes RandomResizedCrop's zoom, as objects look larger in training crops "
        "(FixRes, Touvron et al. 2019)", 1.0
    )
    val_classes: int = doc(
        "hold out this many seen classes (one fixed seeded draw, the same for every run) and evaluate "
        "on them instead of the unseen classes: choose hyper-parameters without looking at the test "
        "classes, then retrain with 0 to report (0 = evaluate on the unseen classes)", 0
    )
    eval_cache_mb: int = doc(
        "with model.frozen_stages, keep the frozen stages' outputs for the evaluation images in memory "
        "(at most this many MiB per worker) so later evaluations run only the trainable top; same "
        "scores (0 = off)", 2048
    )

    def __post_init__(self) -> None:
        _choice("data.name", self.name, DATASETS)
        if "://" in self.root and not self.root.startswith("s3://"):
            raise ConfigError(f"data.root: a local folder or s3://bucket/prefix, got {self.root!r}")
        _positive("data.batch_size", self.batch_size)
        _non_negative("data.eval_resize", self.eval_resize)
        if not 0 < self.crop_scale_min <= 1:
            raise ConfigError(f"data.crop_scale_min must be in (0, 1], got {self.crop_scale_min}")
        if not 0 < self.eval_scale <= 4:
            raise ConfigError(f"data.eval_scale must be in (0, 4], got {self.eval_scale}")
        if self.eval_resize and self.image_size and self.eval_resize < self.image_size:
            raise ConfigError(
                f"data.eval_resize ({self.eval_resize}) must be >= data.image_size ({self.image_size})"
            )
        _positive("data.eval_batch_size", self.eval_batch_size)
        _non_negative("data.samples_per_class", self.samples_per_class)
        _non_negative("data.image_size", self.image_size)
        _non_negative("data.loader_workers", self.loader_workers)
        _non_negative("data.val_classes", self.val_classes)
        _non_negative("data.eval_cache_mb", self.eval_cache_mb)
        if self.samples_per_class == 1:
            raise ConfigError("data.samples_per_class: 1 gives no positives; use 0 or >= 2")
        if self.samples_per_class and self.batch_size % self.samples_per_class:
            raise ConfigError(
                f"data.batch_size ({self.batch_size}) must be a multiple of "
                f"data.samples_per_class ({self.samples_per_class})"
            )


@dataclass
class ModelConfig:
    backbone: str = doc("backbone: " + " | ".join(BACKBONES), "convnet")
    weights: str = doc("path to backbone weights ('' = packaged/none)", "")
    width: int = doc("channel width of the small convnet backbone", 32)
    pooling: str = doc("global pooling: avg | max | avg+max", "avg")
    layer_norm: bool = doc("LayerNorm without affine on the pooled features (ProxyNCA++)", False)
    embedding_dim: int = doc("embedding size", 64)
    frozen_bn: bool = doc("keep BatchNorm statistics and affine frozen", False)
    sync_bn: bool = doc(
        "with more than one worker, trainable BatchNorm layers normalise with the statistics of the "
        "global batch (SyncBatchNorm), so W workers train the one-worker model; false: each rank's "
        "own batch, running statistics averaged over the ranks after every epoch",
        True,
    )
    frozen_stages: int = doc(
        "freeze the backbone's first N stages, the stem counting as the first (0 = train all): "
        "no gradients and BatchNorm statistics fixed there, which also skips their backward",
        0,
    )
    channels_last: bool = doc(
        "run the backbone in NHWC memory layout (about 2x faster for Lite0 on CPU; only float "
        "rounding differs, so it is not part of the run hash)",
        True,
    )

    def __post_init__(self) -> None:
        _choice("model.backbone", self.backbone, BACKBONES)
        _non_negative("model.frozen_stages", self.frozen_stages)
        _choice("model.pooling", self.pooling, ("avg", "max", "avg+max"))
        _positive("model.embedding_dim", self.embedding_dim)
        _positive("model.width", self.width)


@dataclass
class LossConfig:
    """The loss and its hyper-parameters: every field but the ones marked ``loss_argument=False``
    is a constructor argument of the loss (``proxies/``), None meaning the loss's own default.
    Each value's rule is the constructor's own check, run here on a toy size, so a value the
    loss refuses fails at ``config show`` and preflight, never inside a worker."""

    name: str = doc(
        "loss: norm_softmax | proxy_nca | proxy_nca_pp | proxy_anchor | proxy_isa", "proxy_anchor",
        loss_argument=False,
    )
    temperature: float | None = doc("softmax temperature T > 0 (Norm-Softmax, ProxyNCA, ProxyNCA++)", None)
    alpha: float | None = doc("Proxy-Anchor/ISA scale alpha > 0", None)
    delta: float | None = doc("Proxy-Anchor/ISA margin delta >= 0", None)
    V: float | None = doc("Proxy-ISA effective-number ceiling V > 1", None)
    k: float | None = doc("Proxy-ISA search-length slope k >= 0", None)
    lam: float | None = doc("Proxy-ISA search-length offset lambda >= 0", None)
    h: float | None = doc("Proxy-ISA learned-similarity factor h > 0", None)
    tau: float | None = doc("Proxy-ISA decay offset tau > 0", None)
    memory_size: int | None = doc("Proxy-ISA memory queue size (>= 1)", None)
    memory_start_epoch: int = doc(
        "Proxy-ISA: epoch (0-based) the memory starts; filter one later", 2, loss_argument=False
    )

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ConfigError(f"loss.name: unknown loss {self.name!r}; known: {', '.join(LOSSES)}")
        # A key the loss does not take is refused too (HyperParameterError naming it).
        _build_toy("loss", lambda: build_loss({"name": self.name, **self.hyper_parameters()}, *TOY_SIZE))
        _non_negative("loss.memory_start_epoch", self.memory_start_epoch)

    def hyper_parameters(self) -> dict[str, Any]:
        """The loss's constructor arguments that are set (None = the loss's own default)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["loss_argument"] and getattr(self, f.name) is not None
        }


@dataclass
class SynthesisConfig:
    enabled: bool = doc("wrap the loss in Proxy Synthesis", False)
    alpha: float = doc("Beta(alpha, alpha) for the mixing coefficient lambda (> 0)", DEFAULT_ALPHA)
    mu: float = doc("ratio of synthetic samples per batch (>= 0)", DEFAULT_MU)

    def __post_init__(self) -> None:
        # Checked also when disabled: a recipe that turns it on later must not fail then.
        _build_toy("synthesis", lambda: ProxySynthesis(NormSoftmaxLoss(*TOY_SIZE), alpha=self.alpha, mu=self.mu))


@dataclass
class OptimConfig:
    name: str = doc("optimiser: adamw | adam | sgd", "adamw")
    lr: float = doc("learning rate of backbone and head", 1e-3)
    weight_decay: float = doc("weight decay", 1e-4)
    eps: float = doc("Adam epsilon (ProxyNCA++ uses 1.0)", 1e-8)
    proxy_lr_multiplier: float = doc("proxy lr = lr * this (fast-moving proxies)", 100.0)
    proxy_weight_decay: float = doc("weight decay on the proxies", 0.0)
    grad_clip_value: float = doc("clip gradients by value (0 = off)", 0.0)
    warmup_epochs: int = doc("epochs with the backbone frozen (head and proxies train)", 0)
    scheduler: str = doc("lr schedule: none | cosine | step", "none")
    step_size: int = doc("step schedule: epochs between decays", 10)
    gamma: float = doc("step schedule: decay factor", 0.5)

    def __post_init__(self) -> None:
        _choice("optim.name", self.name, ("adamw", "adam", "sgd"))
        _choice("optim.scheduler", self.scheduler, ("none", "cosine", "step"))
        _positive("optim.lr", self.lr)
        _non_negative("optim.weight_decay", self.weight_decay)
        _positive("optim.eps", self.eps)
        _positive("optim.proxy_lr_multiplier", self.proxy_lr_multiplier)
        _non_negative("optim.proxy_weight_decay", self.proxy_weight_decay)
        _non_negative("optim.grad_clip_value", self.grad_clip_value)
        _non_negative("optim.warmup_epochs", self.warmup_epochs)
        _positive("optim.step_size", self.step_size)
        _positive("optim.gamma", self.gamma)


@dataclass
class TrainConfig:
    epochs: int = doc("number of epochs", 4)
    seed: int = doc("seed of every random choice (data order, init, Proxy Synthesis)", 0)
    max_steps_per_epoch: int = doc("cap on steps per epoch (0 = a full pass)", 0)
    recall_ks: list[int] = doc("Recall@K values reported", [1, 2, 4, 8])
    nmi: bool = doc("also compute NMI (k-means) at evaluation", False)
    log_every: int = doc("print the running loss every N steps (0 = per epoch only)", 0)
    eval_every: int = doc("evaluate on the unseen classes every N epochs and always after the last one "
                          "(Tune's schedulers need 1: they compare trials epoch by epoch)", 1)
    eval_precision: str = doc(
        "fp32 | bf16: the evaluation forward pass in bfloat16 autocast (embeddings and metrics stay "
        "float32); 2.4x faster on CPUs with AMX (README, evaluation cost), on hardware without native "
        "bfloat16 it runs in fp32 with a note. Retrain's champion-vs-candidate scoring is always fp32", "fp32"
    )

    def __post_init__(self) -> None:
        _positive("train.epochs", self.epochs)
        _positive("train.eval_every", self.eval_every)
        _choice("train.eval_precision", self.eval_precision, EVAL_PRECISIONS)
        _non_negative("train.seed", self.seed)
        _non_negative("train.max_steps_per_epoch", self.max_steps_per_epoch)
        _non_negative("train.log_every", self.log_every)
        if not self.recall_ks or any(not isinstance(k, int) or k < 1 for k in self.recall_ks):
            raise ConfigError(f"train.recall_ks must be positive integers, got {self.recall_ks}")


@dataclass
class ScalingConfig:
    num_workers: int | str = doc(
        "Ray Train workers (data-parallel ranks): N, or MIN-MAX (e.g. 2-4) for an elastic run that "
        "continues on the workers left when a node is lost and grows back when capacity returns "
        "(proxies resharded from the last checkpoint; needs scaling.max_failures >= 1)", 2
    )
    use_gpu: str = doc("auto | true | false: one GPU per worker when true", "auto")
    cpus_per_worker: float = doc(
        "logical CPUs reserved per worker, also its torch thread count; 0 = this machine's cores / "
        "workers (at least 1), or 1 in a sweep, where trials share the machine", 0.0
    )
    max_failures: int = doc("worker failures tolerated (restart from the last checkpoint)", 0)

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, str):
            low, sep, high = self.num_workers.partition("-")
            if not (low.strip().isdigit() and (not sep or high.strip().isdigit())):
                raise ConfigError(f"scaling.num_workers must be N or MIN-MAX (e.g. 2-4), got {self.num_workers!r}")
            # "4" is the fixed count 4, "4-4" too; only a true range stays a string.
            if not sep or int(low) == int(high):
                self.num_workers = int(low)
            else:
                self.num_workers = f"{int(low)}-{int(high)}"
        _positive("scaling.num_workers", self.min_workers)
        if self.min_workers > self.max_workers:
            raise ConfigError(f"scaling.num_workers={self.num_workers}: MIN must be <= MAX")
        _choice("scaling.use_gpu", self.use_gpu, ("auto", "true", "false"))
        if self.cpus_per_worker < 0:
            raise ConfigError(f"scaling.cpus_per_worker must be >= 0 (0 = automatic), got {self.cpus_per_worker}")
        _non_negative("scaling.max_failures", self.max_failures)
        if self.elastic and self.max_failures < 1:
            # Ray counts a lost node as a worker-group failure: with 0 the run would end there.
            raise ConfigError(f"scaling.num_workers={self.num_workers} is elastic: set scaling.max_failures >= 1 "
                              "(Ray counts each lost node as one failure)")

    @property
    def elastic(self) -> bool:
        """A MIN-MAX worker range (Ray's elastic ScalingConfig)."""
        return isinstance(self.num_workers, str)

    @property
    def min_workers(self) -> int:
        return int(str(self.num_workers).partition("-")[0])

    @property
    def max_workers(self) -> int:
        low, _, high = str(self.num_workers).partition("-")
        return int(high or low)

    def resolved(self, cores: int, *, sweep: bool = False) -> ScalingConfig:
        """This config with ``cpus_per_worker=0`` (automatic) made concrete.

        One run gets the machine: ``cores // max_workers`` CPUs (so threads) per worker, at least
        one, so one worker on two cores trains with two threads. A sweep's trials run side by
        side on the machine, so there each worker gets one CPU and the trial count decides.
        """
        if self.cpus_per_worker > 0:
            return self
        cpus = 1 if sweep else max(1, cores // self.max_workers)
        return dataclasses.replace(self, cpus_per_worker=float(cpus))

    @property
    def threads(self) -> int:
        """Torch threads of one worker: the CPUs reserved for it (a resolved config), at least one."""
        return max(1, int(self.cpus_per_worker))

    def worker_counts(self) -> range:
        """Every number of workers the run may train on."""
        return range(self.min_workers, self.max_workers + 1)


@dataclass
class TrackingConfig:
    tracking_uri: str = doc("MLflow tracking URI ('' = $MLFLOW_TRACKING_URI or ./mlruns sqlite)", "")
    experiment: str = doc("MLflow experiment ('' = proxydml-<dataset>)", "")
    storage_path: str = doc("Ray Train storage ('' = ./runs): a folder or s3://bucket/prefix", "")
    shared_storage: bool = doc(
        "declare the local folders in tracking.storage_path and data.root mounted at the same path on "
        "every node (NFS): without it a run on a multi-node cluster refuses them, since each node would "
        "keep its own checkpoints and need its own data", False
    )
    run_name: str = doc("run name ('' = derived from the config hash)", "")

    def __post_init__(self) -> None:
        if "://" in self.storage_path and not self.storage_path.startswith(("s3://", "file://")):
            raise ConfigError(f"tracking.storage_path: unsupported scheme in {self.storage_path!r}")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    synthesis: SynthesisConfig = field(default_factory=SynthesisConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        # The global batch is the same on any number of workers (an elastic run resized keeps
        # training the same model): it must split evenly over every worker count it may run on.
        uneven = [w for w in self.scaling.worker_counts() if self.data.batch_size % w]
        if uneven:
            counts = f" (the range includes {', '.join(map(str, uneven))})" if self.scaling.elastic else ""
            raise ConfigError(
                f"data.batch_size ({self.data.batch_size}) must be divisible by "
                f"scaling.num_workers ({self.scaling.num_workers}){counts}"
            )

    # -- conversions ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted ``section.key -> value`` (MLflow params, Tune keys)."""
        return {
            f"{section}.{key}": value
            for section, values in self.to_dict().items()
            for key, value in values.items()
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self, *, keep_epochs: bool = False, ignore: tuple[str, ...] = ()) -> str:
        """10 hex digits of what defines the trained model: the config minus where and on how
        many workers it runs (:data:`RUNTIME_SECTIONS`), minus what only changes how it is
        evaluated (:data:`EVAL_ONLY_FIELDS`), minus the epoch count unless ``keep_epochs``,
        minus the dotted keys in ``ignore``."""
        d = self.to_dict()
        for section in RUNTIME_SECTIONS:
            d.pop(section)
        for key in (*EVAL_ONLY_FIELDS, *(() if keep_epochs else ("train.epochs",)), *ignore):
            section, _, name = key.partition(".")
            d[section].pop(name)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    def experiment_hash(self) -> str:
        """The run name's hash: the same run resumes on another worker count, and starting it
        again with more epochs extends it (the epoch count is not part of it)."""
        return self.config_hash()

    def run_name(self) -> str:
        """Deterministic run name: Ray resumes a run by this name, so never a timestamp."""
        if self.tracking.run_name:
            return self.tracking.run_name
        ps = "-ps" if self.synthesis.enabled else ""
        return f"{self.data.name}-{self.loss.name}{ps}-s{self.train.seed}-{self.experiment_hash()}"

    def experiment_name(self) -> str:
        return self.tracking.experiment or f"proxydml-{self.data.name}"


# Where and on how many workers a run executes: never part of what it trains.
RUNTIME_SECTIONS = ("scaling", "tracking")
# What only changes how a model is evaluated, never what is trained, the one list of them:
# how often we look, the memory layout (float rounding only), the evaluation cache (bit for
# bit the uncached scores), the evaluation batch and precision.
EVAL_ONLY_FIELDS = ("train.eval_every", "model.channels_last", "data.eval_cache_mb", "data.eval_batch_size",
                    "train.eval_precision")

_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig, "model": ModelConfig, "loss": LossConfig, "synthesis": SynthesisConfig,
    "optim": OptimConfig, "train": TrainConfig, "scaling": ScalingConfig,
    "tracking": TrackingConfig,
}


# -- validation helpers -------------------------------------------------------------------
def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key} must be >= 0, got {value}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


# Classes and embedding size of the loss built to check a config (2: classic ProxyNCA's least).
TOY_SIZE = (2, 2)


def _build_toy(section: str, build: Callable[[], object]) -> None:
    """Run ``build``, which constructs a loss on :data:`TOY_SIZE`: the loss's constructor holds
    each hyper-parameter's only rule, its refusal becomes a ConfigError naming ``section.key``."""
    try:
        build()
    except HyperParameterError as exc:
        raise ConfigError(f"{section}.{exc}") from exc


# -- building ------------------------------------------------------------------------------
def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to the field's type, or raise naming the key."""
    hint = annotation
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:  # e.g. int | str: the first type the value converts to
            for option in options:
                with contextlib.suppress(ConfigError):
                    return _coerce(key, value, option)
            raise ConfigError(f"{key}: expected {' or '.join(o.__name__ for o in options)}, got {value!r}")
        hint = options[0]
        origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(key, v, item) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML read `scaling.use_gpu=true` as a bool: keep YAML's spelling
            return "true" if value else "false"
        return "" if value is None else str(value)
    raise ConfigError(f"{key}: unsupported type {hint}")


def _section_hints(section_type: type) -> dict[str, Any]:
    return typing.get_type_hints(section_type)


def from_dict(values: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested dict holding only non-default values."""
    if not isinstance(values, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(values).__name__}")
    sections: dict[str, Any] = {}
    for section, section_values in values.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown config section {section!r}; known: {', '.join(_SECTION_TYPES)}")
        if section_values is None:
            continue
        if not isinstance(section_values, dict):
            raise ConfigError(f"{section}: expected a mapping, got {section_values!r}")
        cls = _SECTION_TYPES[section]
        hints = _section_hints(cls)
        kwargs = {}
        for key, value in section_values.items():
            if key not in hints:
                raise ConfigError(f"unknown config key {section}.{key}")
            kwargs[key] = _coerce(f"{section}.{key}", value, hints[key])
        sections[section] = cls(**kwargs)
    return Config(**sections)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["loss.alpha=16", "train.epochs=3"]`` -> nested dict (values kept as strings/YAML)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override key {key!r} must look like section.key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        nested.setdefault(parts[0], {})[parts[1]] = value
    return nested


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def find_yaml(name: str | Path, folder: Path, what: str, listing: str) -> Path:
    """``name`` as a YAML path, else the file ``name[.yaml]`` shipped in ``folder``."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (folder / f"{name}.yaml", folder / str(name)):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise ConfigError(f"{what} {str(name)!r} not found ({listing}: {known})")


def resolve_recipe(recipe: str | Path) -> Path:
    """A recipe is a YAML path or the name of a file under ``pipelines/configs``."""
    return find_yaml(recipe, CONFIG_DIR, "config file", "recipes")


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


BASE_KEY = "base"  # a recipe's parent: "as that recipe, except what this file says"


def load_recipe(recipe: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The sections of a recipe with its ``base:`` chain resolved: the base's values, then
    this file's on top, section by section (a key this file sets replaces the base's; a
    section whose ``name`` differs from the base's, another loss say, is not inherited).

    ``base`` names a shipped recipe or a YAML path, relative to the recipe's own folder.
    """
    path = resolve_recipe(recipe).resolve()
    if path in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path))
        raise ConfigError(f"{BASE_KEY}: recipes inherit in a circle ({chain})")
    values = load_yaml(path)
    base = values.pop(BASE_KEY, None)
    if base is None:
        return values
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: {BASE_KEY} must name a recipe, got {base!r}")
    local = path.parent / base
    parent = local if local.suffix in (".yaml", ".yml") and local.is_file() else base
    inherited = load_recipe(parent, (*_seen, path))
    for section, mine in values.items():
        theirs = inherited.get(section)
        # A section that names another loss (optimiser, data set) starts afresh: the base's
        # hyper-parameters of a different loss mean nothing to this one.
        if isinstance(mine, dict) and isinstance(theirs, dict) and mine.get("name", theirs.get("name")) != theirs.get("name"):
            inherited.pop(section)
    return merge(inherited, values)


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Recipe (optional, its ``base:`` chain resolved) + dotted overrides -> a validated Config."""
    values: dict[str, Any] = load_recipe(recipe) if recipe else {}
    values = merge(values, parse_overrides(overrides or []))
    return from_dict(values)


def describe() -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every field, for help output."""
    rows = []
    for section, cls in _SECTION_TYPES.items():
        hints = _section_hints(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", str(hints[f.name]), f.metadata.get("doc", "")))
    return rows
