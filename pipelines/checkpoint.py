"""Checkpoints of a training run: what each rank writes, how any number of ranks reads it
back, and the global random streams stored with it.

A checkpoint folder merges the files of every rank (their names differ): rank r writes its
proxy shard ``loss.rank{r}.pt`` (``loss.pt`` for rank 0), rank 0 also the model, the
optimiser and scheduler, the generators and the run's state and config. Shards carry their
global class range, so a checkpoint resumes on any number of workers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipelines import distributed as D
from pipelines.config import Config
from proxies import load_shard_states, shard_state_dict

# The files every checkpoint has (rank 0 writes them). Rank r > 0 adds its proxy shard as
# loss.rank{r}.pt (loss_shard_file): loss.pt is rank 0's shard, so a one-worker checkpoint
# is exactly these files.
CHECKPOINT_FILES = ("model.pt", "loss.pt", "optimizer.pt", "trainer_state.json", "config.yaml")


def loss_shard_file(rank: int) -> str:
    """File name of rank ``rank``'s loss shard in a checkpoint folder."""
    return "loss.pt" if rank == 0 else f"loss.rank{rank}.pt"



def _loss_param_indices(optimizer: torch.optim.Optimizer, loss_fn: nn.Module) -> dict[int, str]:
    """Index in ``optimizer.state_dict()["state"]`` -> name in ``loss_fn`` of each loss parameter
    (the state dict numbers the parameters of all groups in order)."""
    names = {id(p): n for n, p in loss_fn.named_parameters()}
    found, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in names:
                found[i] = names[id(p)]
            i += 1
    return found


def rng_state() -> dict[str, Any]:
    """Every global random stream the run may draw from (torch CPU and CUDA, numpy, Python)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),  # (version, 625 ints, gauss_next): plain Python values
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["python"])


def save_checkpoint(
    directory: Path, cfg: Config, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, generator: torch.Generator, state: dict[str, Any],
) -> list[str]:
    """This rank's part of a checkpoint; written to a fresh folder, never in place.

    Every rank writes its loss shard (:func:`loss_shard_file`: proxies, per-class Proxy-ISA
    state and the proxies' optimiser state, with the global class range; rank 0's also
    holds the replicated state: ISA memory queue and phases, Proxy Synthesis generator).
    Rank 0 also writes the model, the rest of the optimiser state (replicated: DDP keeps
    the model identical on every rank), the scheduler, the data generator, the trainer
    state and the config. The file names differ per rank, so the folders of all ranks merge
    into one checkpoint (Ray Train V2 uploads every rank's folder into the same one).
    Returns the names of the files written.
    """
    rank = loss_fn.shard.rank
    shard_file = loss_shard_file(rank)
    torch.save(shard_state_dict(loss_fn, optimizer), directory / shard_file)
    if rank != 0:
        return [shard_file]
    torch.save(D.unwrap(model).state_dict(), directory / "model.pt")
    opt_state = optimizer.state_dict()
    # The proxies' moments live in the loss shards (per class, resharded on load).
    proxy_indices = _loss_param_indices(optimizer, loss_fn)
    opt_state["state"] = {k: v for k, v in opt_state["state"].items() if k not in proxy_indices}
    torch.save(
        {"optimizer": opt_state, "scheduler": scheduler.state_dict(), "generator": generator.get_state(),
         "rng": rng_state()},
        directory / "optimizer.pt",
    )
    (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
    (directory / "config.yaml").write_text(cfg.to_yaml())
    return [shard_file, "model.pt", "optimizer.pt", "trainer_state.json", "config.yaml"]


def load_checkpoint(
    directory: Path, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by any number of ranks into this rank's modules.

    The loss shards are resharded to this rank's class range (``proxies.load_shard_states``);
    they are memory-mapped, so a rank reads only the rows it owns.
    """
    missing = [f for f in CHECKPOINT_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
    shard_files = [directory / "loss.pt", *sorted(directory.glob("loss.rank*.pt"))]
    shards = [torch.load(f, map_location="cpu", weights_only=True, mmap=True) for f in shard_files]
    proxy_optim = load_shard_states(loss_fn, shards)
    if optimizer is not None:
        opt = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
        opt_state = opt["optimizer"]
        for index, name in _loss_param_indices(optimizer, loss_fn).items():
            if name in proxy_optim:
                opt_state["state"][index] = proxy_optim[name]
        optimizer.load_state_dict(opt_state)
        if scheduler is not None:
            scheduler.load_state_dict(opt["scheduler"])
        if generator is not None:
            generator.set_state(opt["generator"])
            if "rng" in opt:  # a checkpoint written without the global streams resumes without them
                set_rng_state(opt["rng"])
    return json.loads((directory / "trainer_state.json").read_text())
