"""Record a digits run on W gloo workers (no Ray): per-epoch losses and metrics, and a sha256
of every tensor of the final checkpoint, so that a refactor of the train loop can be shown
bit-identical on the same machine.

Run from the repo root: ``python tests/benchmarks/record_digits_run.py --workers 1 2 --out rec.json``;
compare two recordings with ``--compare before.json after.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a plain script

from pipelines.config import load_config  # noqa: E402
from pipelines.tracking import LocalReporter  # noqa: E402
from pipelines.train import TIMING_METRICS, run  # noqa: E402

OVERRIDES = ["train.epochs=3", "train.max_steps_per_epoch=5", "data.batch_size=32", "model.width=8"]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run(load_config("digits", [*OVERRIDES, f"scaling.num_workers={world}"]), LocalReporter(Path(out)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def record(world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        torch.multiprocessing.spawn(_worker, args=(world, str(Path(tmp) / "store"), str(out)), nprocs=world)
        last = sorted(out.glob("checkpoint_*"))[-1]
        tensors = {}
        for f in sorted(last.glob("*.pt")):
            state = torch.load(f, weights_only=False)
            for key, value in _flatten(state, f.name):
                if "/rng/numpy/" in key:  # numpy's global stream is never seeded nor drawn from: it differs run to run
                    continue
                tensors[key] = hashlib.sha256(value.contiguous().numpy().tobytes()).hexdigest()[:16]
        history = json.loads((last / "trainer_state.json").read_text())["history"]
        history = [{k: v for k, v in row.items() if k not in TIMING_METRICS} for row in history]
    return {"history": history, "tensors": tensors}


def _flatten(obj: object, prefix: str):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj.detach().cpu()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}/{i}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        same = before == after
        for w in before:
            diff = [k for k in before[w]["tensors"] if before[w]["tensors"][k] != after.get(w, {}).get("tensors", {}).get(k)]
            print(f"W={w}: history {'same' if before[w]['history'] == after[w]['history'] else 'DIFFERS'}, "
                  f"{len(before[w]['tensors']) - len(diff)}/{len(before[w]['tensors'])} tensors bit-identical")
        sys.exit(0 if same else 1)
    rec = {str(w): record(w) for w in args.workers}
    for w, r in rec.items():
        print(f"W={w}: final loss {r['history'][-1]['loss']:.10f}, map_at_r {r['history'][-1].get('map_at_r')}, "
              f"{len(r['tensors'])} tensors")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
