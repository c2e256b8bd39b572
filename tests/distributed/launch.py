"""Start the W worker processes of a torch-only distributed test (gloo over loopback, no Ray).

The children are forked from one forkserver that imported torch and the worker modules
once, rather than spawned, where each child imports them again: the 4-worker class-sharding
run measured 51 busy CPU-s spawned against 34 forked from the server. A fork gives the child
the modules, not a started thread pool (the server only imports), so the computation is the
one a spawned child runs.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

# Imported once by the server, before its first fork (ignored if a server already runs).
PRELOAD = ["torch", "pipelines.train", "tests.distributed.sharded_workers", "tests.distributed.whole_run_workers"]


def launch(fn: Callable[..., None], world: int, args: tuple[Any, ...]) -> None:
    """Run ``fn(rank, *args)`` for ranks 0..world-1 and wait for all; a child's exception is
    raised here (torch's ProcessRaisedException, with the child's traceback)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    torch.multiprocessing.start_processes(fn, args=args, nprocs=world, join=True, start_method="forkserver")
