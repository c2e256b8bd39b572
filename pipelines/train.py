"""The training recipe run by every worker: one explicit loop, no trainer framework.

Per step: embed the local slice of the global batch, all-gather the embeddings with gradient,
compute the proxy loss on the global batch, step. Per epoch: embed the unseen classes,
compute retrieval metrics, report them with a checkpoint, log them (rank 0).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from pipelines import distributed as D
from pipelines.config import Config
from pipelines.data import DataSplit, build_batch_sampler, build_datasets, dataset_labels
from pipelines.evaluate import retrieval_metrics
from pipelines.models import EmbeddingModel
from pipelines.plots import record_isa_state, write_dashboard
from pipelines.tracking import NullTracker, Reporter, Tracker
from proxies import build_loss
from proxies.sharding import gather_replicated

CHECKPOINT_FILES = ("model.pt", "loss.pt", "optimizer.pt", "trainer_state.json", "config.yaml")


def build_loss_module(cfg: Config, num_classes: int, generator: torch.Generator) -> nn.Module:
    spec: dict[str, Any] = {"name": cfg.loss.name, **cfg.loss.hyper_parameters()}
    if cfg.synthesis.enabled:
        spec["synthesis"] = {"enabled": True, "alpha": cfg.synthesis.alpha, "mu": cfg.synthesis.mu}
    return build_loss(spec, num_classes, cfg.model.embedding_dim, generator=generator)


def build_optimizer(cfg: Config, model: EmbeddingModel, loss_fn: nn.Module) -> torch.optim.Optimizer:
    """Three groups: backbone, head (+norm), proxies at ``proxy_lr_multiplier`` x lr."""
    o = cfg.optim
    groups = [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad], "name": "backbone"},
        {"params": list(model.head.parameters()), "name": "head"},
        {
            "params": [p for p in loss_fn.parameters() if p.requires_grad],
            "name": "proxies",
            "lr": o.lr * o.proxy_lr_multiplier,
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


def set_loss_epoch(loss_fn: nn.Module, epoch: int, cfg: Config) -> None:
    """Switch epoch-dependent loss phases (Proxy-ISA memory and filter)."""
    for m in loss_fn.modules():
        if hasattr(m, "set_epoch"):
            m.set_epoch(epoch, memory_start_epoch=cfg.loss.memory_start_epoch)


@torch.no_grad()
def embed(
    model: nn.Module, dataset: Dataset, batch_size: int, dev: torch.device, workers: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embed a dataset in eval mode -> (N, d) float32 embeddings, (N,) labels, (N,) indices."""
    was_training = model.training
    model.eval()
    embs, labels, indices = [], [], []
    for images, y, idx in DataLoader(dataset, batch_size=batch_size, num_workers=workers):
        embs.append(model(images.to(dev)).float().cpu())
        labels.append(y)
        indices.append(idx)
    model.train(was_training)
    return torch.cat(embs), torch.cat(labels), torch.cat(indices)


def evaluate(model: nn.Module, split: DataSplit, cfg: Config, dev: torch.device) -> dict[str, float] | None:
    """Each rank embeds every W-th evaluation item; rank 0 computes the metrics.

    With a query/gallery split (In-Shop) queries are searched in the gallery; otherwise every
    item queries all the others.
    """
    positions = list(range(D.rank(), len(split.test), D.world_size()))
    emb, labels, _ = embed(D.unwrap(model), Subset(split.test, positions), cfg.data.eval_batch_size, dev,
                           cfg.data.loader_workers)
    order = torch.tensor(positions, dtype=torch.long)
    emb, labels, order = (D.gather_rows(t.to(dev)).cpu() for t in (emb, labels, order))
    if D.rank() != 0:
        return None
    # Back to dataset order, whatever the number of ranks.
    perm = torch.argsort(order)
    emb, labels = emb[perm], labels[perm]
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
        metrics.update({f"xgroup_{k}": v for k, v in cross.items()})
    return metrics


def save_checkpoint(
    directory: Path, cfg: Config, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, generator: torch.Generator, state: dict[str, Any],
) -> None:
    """Everything needed to resume exactly; written to a fresh folder, never in place."""
    torch.save(D.unwrap(model).state_dict(), directory / "model.pt")
    torch.save(loss_fn.state_dict(), directory / "loss.pt")
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "generator": generator.get_state()},
        directory / "optimizer.pt",
    )
    (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
    (directory / "config.yaml").write_text(cfg.to_yaml())


def load_checkpoint(
    directory: Path, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, generator: torch.Generator | None = None,
) -> dict[str, Any]:
    missing = [f for f in CHECKPOINT_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
    loss_fn.load_state_dict(torch.load(directory / "loss.pt", map_location="cpu", weights_only=True))
    if optimizer is not None:
        opt = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(opt["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(opt["scheduler"])
        if generator is not None:
            generator.set_state(opt["generator"])
    return json.loads((directory / "trainer_state.json").read_text())


def run(
    cfg: Config, reporter: Reporter, tracker: Tracker | None = None, extra_state: dict[str, Any] | None = None
) -> dict[str, float]:
    """Train ``cfg`` on this worker. Returns the last epoch's metrics (rank 0; {} elsewhere).

    ``extra_state`` (e.g. the MLflow run id) is stored in every checkpoint's trainer_state.json.
    """
    tracker = tracker if (tracker is not None and D.rank() == 0) else NullTracker()
    dev = D.device()
    rank, world = D.rank(), D.world_size()
    torch.manual_seed(cfg.train.seed)  # identical init on every rank (DDP also broadcasts)

    split = build_datasets(cfg.data)
    in_channels = split.train[0][0].shape[0]
    model = EmbeddingModel(cfg.model, in_channels).to(dev)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    loss_fn = build_loss_module(cfg, split.num_classes, generator).to(dev)
    optimizer = build_optimizer(cfg, model, loss_fn)
    scheduler = build_scheduler(cfg, optimizer)

    start_epoch, history, resumes = 0, [], 0
    with reporter.latest_checkpoint() as ckpt:
        if ckpt is not None:
            state = load_checkpoint(Path(ckpt), model, loss_fn, optimizer, scheduler, generator)
            start_epoch, history = state["epoch"], state.get("history", [])
            resumes = state.get("resumes", 0) + 1  # restarts after failures count here too
            D.print0(f"resumed from {ckpt} after epoch {start_epoch}")

    ddp_model = D.wrap_ddp(model, dev)
    sampler = build_batch_sampler(
        dataset_labels(split.train), cfg.data, rank=rank, world_size=world, seed=cfg.train.seed
    )
    loader = DataLoader(split.train, batch_sampler=sampler, num_workers=cfg.data.loader_workers)
    backbone_params = [p for p in model.backbone.parameters() if p.requires_grad]
    use_bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported()
    metrics: dict[str, float] = {}
    isa_states: list[dict[str, Any]] = []  # Proxy-ISA state per epoch, for the dashboard (rank 0)

    for epoch in range(start_epoch, cfg.train.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        set_loss_epoch(loss_fn, epoch, cfg)
        warmup = epoch < cfg.optim.warmup_epochs
        ddp_model.train()
        total, steps = 0.0, 0
        for step, (images, labels, _) in enumerate(loader):
            if cfg.train.max_steps_per_epoch and step >= cfg.train.max_steps_per_epoch:
                break
            images, labels = images.to(dev, non_blocking=True), labels.to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                local = ddp_model(images)
            embeddings = gather_replicated(local.float())
            all_labels = gather_replicated(labels)
            loss = loss_fn(embeddings, all_labels)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1} step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if warmup:  # backbone frozen: DDP still reduced its grads, the optimiser skips them
                for p in backbone_params:
                    p.grad = None
            if cfg.optim.grad_clip_value:
                params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_value_(params, cfg.optim.grad_clip_value)
            optimizer.step()
            total += loss.item()
            steps += 1
            if cfg.train.log_every and step % cfg.train.log_every == 0:
                D.print0(f"epoch {epoch + 1} step {step} loss {loss.item():.4f}")
        scheduler.step()
        train_time = time.perf_counter() - t0

        evaluated = evaluate(ddp_model, split, cfg, dev)
        metrics = {
            "epoch": epoch + 1,
            "loss": total / max(steps, 1),
            "lr": optimizer.param_groups[1]["lr"],
            "epoch_time_s": train_time,
            **(evaluated or {}),
        }
        if rank == 0:
            history.append({k: float(v) for k, v in metrics.items()})
            summary = " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k not in ("epoch", "lr"))
            D.print0(f"epoch {epoch + 1}/{cfg.train.epochs} {summary}")
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch + 1)
            record_isa_state(loss_fn, epoch + 1, isa_states)
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError("training loss is not finite")
        with tempfile.TemporaryDirectory(prefix="proxydml-ckpt-") as tmp:
            ckpt_dir = None
            if rank == 0:
                ckpt_dir = Path(tmp)
                state = {"epoch": epoch + 1, "run_name": cfg.run_name(), "world_size": world,
                         "resumes": resumes, "history": history, **(extra_state or {})}
                save_checkpoint(ckpt_dir, cfg, model, loss_fn, optimizer, scheduler, generator, state)
            reporter.report(metrics, ckpt_dir)
    if rank == 0:  # plots under plots/ (pipelines/plots.py); nothing with the NullTracker
        write_dashboard(tracker, history, model, split.test, loss_fn, isa_states, dev, cfg.data.eval_batch_size)
    return metrics if rank == 0 else {}


def load_model(checkpoint: Path, overrides: list[str] | None = None) -> tuple[Config, EmbeddingModel, DataSplit]:
    """Rebuild the trained model (and its data split) from a checkpoint folder."""
    from pipelines.config import from_dict, load_yaml, merge, parse_overrides

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
