"""The training recipe run by every worker: one explicit loop, no trainer framework.

Per step: embed the local slice of the global batch, all-gather the embeddings with gradient,
compute the loss terms of this rank's proxy shard on the global batch (tiny all-reduces
combine them into the loss of the global batch, see ``proxies/sharding.py``), step. Per
epoch: embed the unseen classes, compute retrieval metrics, report them with a checkpoint
(every rank writes its proxy shard), log them (rank 0).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from pipelines import distributed as D
from pipelines.checkpoint import load_checkpoint, save_checkpoint
from pipelines.config import Config, from_dict, load_yaml, merge, parse_overrides
from pipelines.data import (
    DataSplit,
    SeededBatches,
    SeededSamples,
    build_batch_sampler,
    build_datasets,
    dataset_labels,
)
from pipelines.eval_cache import FrozenFeatureCache, embed_frozen_cached
from pipelines.evaluate import CROSS_GROUP_PREFIX, native_bf16, retrieval_metrics
from pipelines.models import EmbeddingModel
from pipelines.plots import isa_snapshot, write_dashboard
from pipelines.tracking import NullProgress, NullTracker, Reporter, Tracker
from proxies import ShardContext, build_loss

# Wall-clock metrics: they differ between otherwise identical runs (equivalence tests skip them).
TIMING_METRICS = ("epoch_time_s", "eval_time_s")


def build_loss_module(
    cfg: Config, num_classes: int, generator: torch.Generator, shard: ShardContext | None = None
) -> nn.Module:
    """The loss of ``cfg`` (its proxies: this rank's class shard when ``shard`` is given)."""
    spec: dict[str, Any] = {"name": cfg.loss.name, **cfg.loss.hyper_parameters()}
    if cfg.synthesis.enabled:
        spec["synthesis"] = {"enabled": True, "alpha": cfg.synthesis.alpha, "mu": cfg.synthesis.mu}
    return build_loss(spec, num_classes, cfg.model.embedding_dim, generator=generator, shard=shard)


def group_learning_rates(cfg: Config) -> dict[str, float]:
    """The base learning rate of each optimiser group: proxies at ``proxy_lr_multiplier`` x lr."""
    o = cfg.optim
    return {"backbone": o.lr, "head": o.lr, "proxies": o.lr * o.proxy_lr_multiplier}


def build_optimizer(cfg: Config, model: EmbeddingModel, loss_fn: nn.Module) -> torch.optim.Optimizer:
    """Three groups: backbone, head (+norm), proxies at ``proxy_lr_multiplier`` x lr.

    The proxies are this rank's shard (not DDP parameters): their group holds the local rows
    and their optimiser state (Adam moments) is local too.
    """
    o = cfg.optim
    lrs = group_learning_rates(cfg)
    groups = [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad], "name": "backbone", "lr": lrs["backbone"]},
        {"params": list(model.head.parameters()), "name": "head", "lr": lrs["head"]},
        {
            "params": [p for p in loss_fn.parameters() if p.requires_grad],
            "name": "proxies",
            "lr": lrs["proxies"],
            "weight_decay": o.proxy_weight_decay,
        },
    ]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.9, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=o.lr, weight_decay=o.weight_decay, eps=o.eps)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    o = cfg.optim
    if o.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs)
    if o.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=o.step_size, gamma=o.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def retarget_learning_rates(cfg: Config, optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler) -> list[str]:
    """After loading a checkpoint trained with other learning rates (a population-based
    training exploit: this trial goes on from another's weights with its own perturbed
    ``optim.lr`` / ``optim.proxy_lr_multiplier``), move each group to ``cfg``'s base rate at
    the same point of its schedule. Groups whose base rate is unchanged are left bit for bit
    as loaded (a plain resume). Returns the names of the groups moved."""
    moved, bases = [], list(scheduler.base_lrs)  # a new list: a loaded state may share the old one
    for i, (group, new) in enumerate(zip(optimizer.param_groups, group_learning_rates(cfg).values(), strict=True)):
        old = bases[i]
        if new == old:
            continue
        group["lr"] = new * (group["lr"] / old) if old else new
        group["initial_lr"] = bases[i] = new
        moved.append(group["name"])
    scheduler.base_lrs = bases
    return moved


def set_loss_epoch(loss_fn: nn.Module, epoch: int, cfg: Config) -> None:
    """Switch epoch-dependent loss phases (Proxy-ISA memory and filter)."""
    for m in loss_fn.modules():
        if hasattr(m, "set_epoch"):
            m.set_epoch(epoch, memory_start_epoch=cfg.loss.memory_start_epoch)


def eval_positions(n: int, batch_size: int, rank: int, world: int) -> list[int]:
    """The evaluation items rank ``rank`` of ``world`` embeds: every ``world``-th chunk of
    ``batch_size`` consecutive items, starting at chunk ``rank``.

    One process embeds the same chunks in the same order, so every embedding is computed from
    the same batch whatever the number of ranks: the metrics logged by a W-worker run are
    those ``proxydml eval`` computes from its checkpoint, to the last bit on CPU.
    """
    chunks = range(rank * batch_size, n, world * batch_size)
    return [i for start in chunks for i in range(start, min(start + batch_size, n))]


def embed_eval_set(model: nn.Module, split: DataSplit, cfg: Config, dev: torch.device,
                   cache: FrozenFeatureCache | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each rank embeds its chunks of the evaluation set (:func:`eval_positions`); rank 0 gets
    (N, d) float32 embeddings and (N,) labels of ``split.test`` in dataset order, other ranks None.

    Every rank holds the same model (DDP parameters; BatchNorm statistics synchronised or
    averaged), so the embeddings are those of the checkpointed model. ``cache`` keeps the frozen
    stages' outputs across calls (same embeddings, to the bit).
    """
    positions = eval_positions(len(split.test), cfg.data.eval_batch_size, D.rank(), D.world_size())
    emb, labels = embed_frozen_cached(D.unwrap(model), Subset(split.test, positions), cfg.data.eval_batch_size,
                                      dev, cfg.data.loader_workers, cache, cfg.train.eval_precision)
    order = torch.tensor(positions, dtype=torch.long)
    emb, labels, order = (D.gather_rows(t.to(dev)).cpu() for t in (emb, labels, order))
    if D.rank() != 0:
        return None
    # Back to dataset order, whatever the number of ranks.
    perm = torch.argsort(order)
    return emb[perm], labels[perm]


def score(split: DataSplit, emb: torch.Tensor, labels: torch.Tensor, cfg: Config) -> dict[str, float]:
    """Retrieval metrics of ``split.test``'s embeddings (N, d) and labels (N,), dataset order.

    With a query/gallery split (In-Shop) queries are searched in the gallery; otherwise every
    item queries all the others.
    """
    ks = tuple(cfg.train.recall_ks)
    if split.query_indices is not None and split.gallery_indices is not None:
        q, g = torch.tensor(split.query_indices), torch.tensor(split.gallery_indices)
        return retrieval_metrics(emb[g], labels[g], query_embeddings=emb[q], query_labels=labels[q],
                                 recall_ks=ks, nmi=cfg.train.nmi)
    metrics = retrieval_metrics(emb, labels, recall_ks=ks, nmi=cfg.train.nmi)
    if split.test_groups is not None:
        # Designs of one family (e.g. OpenMoji colour and black line art) share their drawing:
        # the cross-family score leaves the query's own family out of its gallery.
        cross = retrieval_metrics(emb, labels, recall_ks=ks[:1],
                                  exclude_same_group=(torch.as_tensor(split.test_groups), None))
        metrics.update({f"{CROSS_GROUP_PREFIX}{k}": v for k, v in cross.items()})
    return metrics


def evaluate(model: nn.Module, split: DataSplit, cfg: Config, dev: torch.device,
             cache: FrozenFeatureCache | None = None) -> dict[str, float] | None:
    """:func:`embed_eval_set` then :func:`score`: the metrics on rank 0, None elsewhere."""
    embedded = embed_eval_set(model, split, cfg, dev, cache)
    return None if embedded is None else score(split, *embedded, cfg)


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float]) -> str:
    """The console's line for one epoch: loss, R@1 and MAP@R when evaluated, and seconds of
    training and evaluation. Every other metric goes to MLflow and the log file only."""
    parts = [f"epoch {epoch}/{epochs}", f"loss {metrics['loss']:.4f}"]
    for key, label in (("recall_at_1", "R@1"), ("map_at_r", "MAP@R")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.4f}")
    parts.append(f"train {metrics['epoch_time_s']:.1f}s")
    if "eval_time_s" in metrics:
        parts.append(f"eval {metrics['eval_time_s']:.1f}s")
    return " ".join(parts)


def whole_isa_snapshot(loss_fn: nn.Module, epoch: int) -> dict[str, Any] | None:
    """:func:`pipelines.plots.isa_snapshot` of every class: each rank's per-class tensors
    (C_local,) gathered in rank order, which is class order. A collective: every rank calls
    it; None (on every rank) for losses without Proxy-ISA state."""
    snap = isa_snapshot(loss_fn, epoch)
    if snap is None:
        return None
    dev = D.device()  # nccl gathers device tensors only; the snapshot is a CPU copy
    return {k: D.gather_rows(v.to(dev)).cpu() if isinstance(v, torch.Tensor) else v for k, v in snap.items()}


@dataclass
class Session:
    """What one worker's run holds from epoch to epoch (built by :func:`_build`)."""

    cfg: Config
    dev: torch.device
    split: DataSplit
    model: EmbeddingModel
    loss_fn: nn.Module
    shard: ShardContext
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    start_epoch: int = 0
    resumes: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    embedded: tuple[torch.Tensor, torch.Tensor] | None = None  # the last evaluation's (rank 0)
    isa_states: list[dict[str, Any]] = field(default_factory=list)  # per epoch, for the dashboard (rank 0)
    # Set by _prepare_loop, once the checkpoint is loaded (DDP broadcasts rank 0's weights).
    ddp_model: nn.Module | None = None
    sampler: SeededBatches | None = None
    loader: DataLoader | None = None


def _build(cfg: Config) -> Session:
    """Data, model, this rank's proxy shard, optimiser and scheduler, seeded alike on every rank."""
    dev = D.device()
    torch.manual_seed(cfg.train.seed)  # identical init on every rank (DDP also broadcasts)
    if cfg.train.eval_precision == "bf16" and not native_bf16(dev):
        D.print0(f"note: train.eval_precision=bf16, but this {dev.type} has no native bfloat16: evaluating in fp32")
    split = build_datasets(cfg.data)
    model = EmbeddingModel(cfg.model, split.train[0][0].shape[0]).to(dev)
    if D.world_size() > 1 and cfg.model.sync_bn:
        # BatchNorm over the global batch: the W-worker forward is the one-worker forward.
        D.sync_batch_norm(model, dev)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    # This rank's contiguous class range of the proxies (all of them with one worker).
    shard = ShardContext.from_process_group(split.num_classes)
    loss_fn = build_loss_module(cfg, split.num_classes, generator, shard).to(dev)
    optimizer = build_optimizer(cfg, model, loss_fn)
    return Session(cfg, dev, split, model, loss_fn, shard, optimizer, build_scheduler(cfg, optimizer), generator)


def _resume(s: Session, reporter: Reporter, tracker: Tracker) -> None:
    """Load the reporter's latest checkpoint, if any (resharded to this worker count), tag a
    change of worker count, and replay the checkpoint's history to the tracker."""
    world, previous_world = D.world_size(), None
    with reporter.latest_checkpoint() as ckpt:
        if ckpt is not None:
            state = load_checkpoint(Path(ckpt), s.model, s.loss_fn, s.optimizer, s.scheduler, s.generator)
            moved = retarget_learning_rates(s.cfg, s.optimizer, s.scheduler)
            if moved:
                D.print0(f"learning rates of {', '.join(moved)} set to this config's (the checkpoint had others)")
            s.start_epoch, s.history = state["epoch"], state.get("history", [])
            s.resumes = state.get("resumes", 0) + 1  # restarts after failures count here too
            previous_world = state.get("world_size")
            D.print0(f"resumed from {ckpt} after epoch {s.start_epoch}")
    if previous_world != world and s.start_epoch < s.cfg.train.epochs:
        # The worker count from this epoch on (an elastic run resized after a lost node or when
        # capacity returned; the proxies were resharded above): tags workers.epoch_<first epoch>.
        # torch_threads: what each worker computes with (scaling.cpus_per_worker, see services).
        tracker.set_tags({f"workers.epoch_{s.start_epoch + 1}": str(world),
                          "torch_threads": str(torch.get_num_threads())})
        if previous_world is not None:
            D.print0(f"resized: {previous_world} -> {world} workers from epoch {s.start_epoch + 1}, "
                     "proxies resharded")
    for past in s.history:
        # The checkpoint's history is the record: a rank 0 lost with its node may have died
        # before its tracker delivered the last epochs. Steps the run holds are not sent again.
        tracker.log_metrics({k: v for k, v in past.items() if k != "epoch"}, step=int(past["epoch"]))


def _prepare_loop(s: Session) -> None:
    """DDP around the (loaded) model, and the loader of this rank's slice of every global batch."""
    s.ddp_model = D.wrap_ddp(s.model, s.dev)
    # Items are (index, augmentation seed from the global position): crops and flips are the
    # same for any W and any number of loader processes (pipelines/data/samplers.py). The
    # loader's own generator only seeds its worker processes, which draw nothing: a private
    # one keeps it off the global stream.
    s.sampler = SeededBatches(build_batch_sampler(
        dataset_labels(s.split.train), s.cfg.data, rank=D.rank(), world_size=D.world_size(), seed=s.cfg.train.seed
    ))
    s.loader = DataLoader(SeededSamples(s.split.train), batch_sampler=s.sampler,
                          num_workers=s.cfg.data.loader_workers, generator=torch.Generator().manual_seed(s.cfg.train.seed))


def _train_epoch(s: Session, epoch: int, reporter: Reporter) -> tuple[float, float]:
    """One epoch of steps; returns (mean loss, seconds)."""
    assert s.ddp_model is not None and s.sampler is not None and s.loader is not None
    cfg, dev, t0 = s.cfg, s.dev, time.perf_counter()
    s.sampler.set_epoch(epoch)
    set_loss_epoch(s.loss_fn, epoch, cfg)
    warmup = epoch < cfg.optim.warmup_epochs
    backbone_params = [p for p in s.model.backbone.parameters() if p.requires_grad]
    # bf16 training on GPUs only: on CPUs, even with AMX, it measured slower than fp32 (docs/benchmarks.md)
    use_bf16 = dev.type == "cuda" and native_bf16(dev)
    s.ddp_model.train()
    total, steps = 0.0, 0
    n_steps = min(len(s.loader), cfg.train.max_steps_per_epoch or len(s.loader))
    bar = reporter.progress(n_steps, f"epoch {epoch + 1}/{cfg.train.epochs}") if D.rank() == 0 else NullProgress()
    for step, (images, labels, _) in enumerate(s.loader):
        if step >= n_steps:
            break
        images, labels = images.to(dev, non_blocking=True), labels.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
            local = s.ddp_model(images)
        # The loss runs outside autocast in float32 (its GEMMs too): the margins and
        # alpha = 32 need it. The gather's backward sums every rank's partial gradient.
        loss = s.loss_fn(s.shard.gather_embeddings(local.float()), s.shard.all_gather(labels))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1} step {step}")
        s.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if warmup:  # backbone frozen: DDP still reduced its grads, the optimiser skips them
            for p in backbone_params:
                p.grad = None
        if cfg.optim.grad_clip_value:
            params = [p for g in s.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_value_(params, cfg.optim.grad_clip_value)
        s.optimizer.step()
        total += loss.item()
        steps += 1
        bar.update()
        if cfg.train.log_every and step % cfg.train.log_every == 0:
            D.print0(f"epoch {epoch + 1} step {step} loss {loss.item():.4f}")
    bar.close()
    s.scheduler.step()
    if not cfg.model.sync_bn:
        D.average_buffers(s.model)  # one BatchNorm state on every rank to evaluate and save
    return total / max(steps, 1), time.perf_counter() - t0


def _evaluate_if_due(s: Session, epoch: int, eval_cache: FrozenFeatureCache) -> dict[str, float]:
    """Retrieval metrics and ``eval_time_s`` on rank 0 when this epoch is scored ({} otherwise).

    Embedding every unseen image costs about a tenth of an epoch's training on CPU; long runs
    can look less often (``train.eval_every``), but the last epoch is always scored.
    """
    if not (epoch + 1 == s.cfg.train.epochs or (epoch + 1) % s.cfg.train.eval_every == 0):
        return {}
    t_eval = time.perf_counter()
    s.embedded = embed_eval_set(s.ddp_model, s.split, s.cfg, s.dev, eval_cache)
    if s.embedded is None:  # ranks other than 0
        return {}
    scores = score(s.split, *s.embedded, s.cfg)
    return {"eval_time_s": time.perf_counter() - t_eval, **scores}


def _record_epoch(s: Session, epoch: int, metrics: dict[str, float], tracker: Tracker) -> None:
    """Rank 0: the history, the console line, the tracker; every rank: the ISA state (a collective)."""
    isa_state = whole_isa_snapshot(s.loss_fn, epoch + 1)
    if D.rank() == 0:
        s.history.append({k: float(v) for k, v in metrics.items()})
        D.print0(epoch_line(epoch + 1, s.cfg.train.epochs, metrics))
        tracker.log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch + 1)
        if isa_state is not None:
            s.isa_states.append(isa_state)
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError("training loss is not finite")


def _checkpoint(s: Session, epoch: int, metrics: dict[str, float], reporter: Reporter,
                extra_state: dict[str, Any] | None) -> None:
    """Every rank writes its part of the epoch's checkpoint (its proxy shard; rank 0 the rest)
    into a fresh folder and reports it with the metrics."""
    with tempfile.TemporaryDirectory(prefix="proxydml-ckpt-") as tmp:
        state = {"epoch": epoch + 1, "run_name": s.cfg.run_name(), "world_size": D.world_size(),
                 "resumes": s.resumes, "history": s.history, **(extra_state or {})}
        save_checkpoint(Path(tmp), s.cfg, s.model, s.loss_fn, s.optimizer, s.scheduler, s.generator, state)
        reporter.report(metrics, Path(tmp))


def _dashboard(s: Session, tracker: Tracker) -> None:
    """The run's plots (rank 0), over every class whatever the worker count."""
    # The shards, contiguous class ranges in rank order, are gathered into the whole bank
    # (a collective: every rank calls it).
    proxies = getattr(s.loss_fn, "proxies", None)
    bank = D.gather_rows(proxies.detach()).cpu() if isinstance(proxies, torch.Tensor) else None
    if D.rank() == 0:  # plots under plots/ (pipelines/plots.py); nothing with the NullTracker
        # The last epoch is always evaluated: its embeddings are the dashboard's (embedding the
        # unseen set again on rank 0 alone would cost a full uncached fp32 pass).
        write_dashboard(tracker, s.history, s.model, s.split.test, bank, s.isa_states, s.dev,
                        s.cfg.data.eval_batch_size, embedded=s.embedded)


def run(
    cfg: Config, reporter: Reporter, tracker: Tracker | None = None, extra_state: dict[str, Any] | None = None,
    dashboard: bool = True,
) -> dict[str, float]:
    """Train ``cfg`` on this worker. Returns the last epoch's metrics (rank 0; {} elsewhere).

    ``extra_state`` (e.g. the MLflow run id) is stored in every checkpoint's trainer_state.json.
    ``dashboard``: write the run's plots at the end (a sweep's trials do without: the plots
    took 2.2 s of an emoji trial's 7.8 s of fixed cost, and the sweep has its own page).
    """
    tracker = tracker if (tracker is not None and D.rank() == 0) else NullTracker()
    s = _build(cfg)
    _resume(s, reporter, tracker)
    _prepare_loop(s)
    # The frozen stages' outputs for this rank's evaluation chunks, computed once per run.
    eval_cache = FrozenFeatureCache(cfg.data.eval_cache_mb * 2**20)
    metrics: dict[str, float] = {}
    for epoch in range(s.start_epoch, cfg.train.epochs):
        loss, train_time = _train_epoch(s, epoch, reporter)
        evaluated = _evaluate_if_due(s, epoch, eval_cache)
        metrics = {"epoch": epoch + 1, "loss": loss, "lr": s.optimizer.param_groups[1]["lr"],
                   "epoch_time_s": train_time, **evaluated}
        _record_epoch(s, epoch, metrics, tracker)
        _checkpoint(s, epoch, metrics, reporter, extra_state)
    if dashboard:
        _dashboard(s, tracker)
    return metrics if D.rank() == 0 else {}


def load_model(checkpoint: Path, overrides: list[str] | None = None) -> tuple[Config, EmbeddingModel, DataSplit]:
    """Rebuild the trained model (and its data split) from a checkpoint folder."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint folder {checkpoint} does not exist")
    if not (checkpoint / "config.yaml").is_file() or not (checkpoint / "model.pt").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a ProxyDML checkpoint (no config.yaml/model.pt)")
    cfg = from_dict(merge(load_yaml(checkpoint / "config.yaml"), parse_overrides(overrides or [])))
    split = build_datasets(cfg.data)
    model = EmbeddingModel(cfg.model, split.test[0][0].shape[0])
    model.load_state_dict(torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True))
    return cfg, model.eval(), split


def evaluate_checkpoint(checkpoint: Path, overrides: list[str] | None = None) -> dict[str, float]:
    """Single-process evaluation of a saved model on the unseen classes."""
    cfg, model, split = load_model(checkpoint, overrides)
    metrics = evaluate(model, split, cfg, torch.device("cpu"))
    assert metrics is not None  # single process = rank 0
    return metrics
