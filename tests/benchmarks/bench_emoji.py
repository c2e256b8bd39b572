"""Emoji benchmark: every loss, with and without Proxy Synthesis, on the unseen half of the classes.

Not collected by pytest (a script). Builds the data set if needed, trains each
``pipelines/configs/emoji_<loss>[_ps].yaml`` recipe single-process, and prints a table of
R@1, MAP@R and R-Precision on the unseen classes, plus:

- ``xR@1``: R@1 with the query's own design family excluded from its gallery (OpenMoji colour
  and black share line art, so the plain all-vs-all score is inflated by that pair);
- ``G->T R@1``: Google queries against a Twitter-only gallery;
- reference rows: raw pixels and the frozen ImageNet EfficientNet-Lite0 (avg-pooled 1280-d).

Usage (full: ~1 h on 2 CPU cores; ``--epochs 1 --max-steps 20`` for a quick look)::

    .venv/bin/python tests/benchmarks/bench_emoji.py --root data/emoji --out bench_emoji.json
    .venv/bin/python tests/benchmarks/bench_emoji.py --losses proxy_anchor norm_softmax --epochs 2
    .venv/bin/python tests/benchmarks/bench_emoji.py --recipes emoji_proxy_nca_pp_long --no-baselines
    # choose on 300 held-out seen classes instead of the unseen half, try two scoring sizes
    .venv/bin/python tests/benchmarks/bench_emoji.py --losses proxy_nca_pp --no-ps --no-baselines \
        --set data.val_classes=300 --eval-scales 1.0 1.5
    # per-epoch evaluation time against training time, with and without the frozen-stage cache
    .venv/bin/python tests/benchmarks/bench_emoji.py --recipes emoji_proxy_nca_pp --eval-cost 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Subset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipelines.config import load_config  # noqa: E402
from pipelines.data import DataSplit, build_datasets  # noqa: E402
from pipelines.data.emoji_build import ensure_built  # noqa: E402
from pipelines.evaluate import embed, retrieval_metrics  # noqa: E402

LOSSES = ("norm_softmax", "proxy_nca", "proxy_nca_pp", "proxy_anchor", "proxy_isa")


def report(emb: torch.Tensor, labels: torch.Tensor, split: DataSplit) -> dict[str, float]:
    """All-vs-all metrics, the cross-family R@1 and Google->Twitter R@1 of test embeddings (N, d)."""
    out = retrieval_metrics(emb, labels, recall_ks=(1,))
    row = {"R@1": out["recall_at_1"], "MAP@R": out["map_at_r"], "RP": out["r_precision"]}
    cross = retrieval_metrics(emb, labels, recall_ks=(1,), exclude_same_group=(split.test_groups, None))
    row["xR@1"] = cross["recall_at_1"]
    q, g = _design_rows(split, "google"), _design_rows(split, "twitter")
    if len(q) and len(g):
        row["G->T R@1"] = _query_gallery_r1(emb[q], labels[q], emb[g], labels[g])
    return row


def _design_rows(split: DataSplit, design: str) -> torch.Tensor:
    return torch.tensor([i for i, (p, _) in enumerate(split.test.samples) if p.stem == design], dtype=torch.long)


def _query_gallery_r1(qe: torch.Tensor, ql: torch.Tensor, ge: torch.Tensor, gl: torch.Tensor) -> float:
    return retrieval_metrics(ge, gl, query_embeddings=qe, query_labels=ql, recall_ks=(1,))["recall_at_1"]


def google_to_twitter(model: torch.nn.Module, split: DataSplit) -> dict[str, float]:
    """Google->Twitter R@1, embedding only those two designs (2 of the 5 per class)."""
    q, g = _design_rows(split, "google"), _design_rows(split, "twitter")
    if not (len(q) and len(g)):
        return {}
    emb, labels = embed(model, Subset(split.test, torch.cat([q, g]).tolist()), workers=1)
    n = len(q)
    return {"G->T R@1": _query_gallery_r1(emb[:n], labels[:n], emb[n:], labels[n:])}


def baselines(split: DataSplit) -> dict[str, dict[str, float]]:
    from pipelines.backbones import efficientnet_lite0_imagenet

    lite0 = torch.nn.Sequential(efficientnet_lite0_imagenet(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    return {
        "raw pixels": report(*embed(torch.nn.Flatten(), split.test, workers=1), split),
        "frozen Lite0 (ImageNet)": report(*embed(lite0, split.test, workers=1), split),
    }


def train_one(recipe: str, overrides: list[str], rescore: Sequence[str] = ()) -> tuple[dict[str, float], float]:
    """Train ``recipe``; its row, plus R@1 and MAP@R of the same checkpoint scored again with
    each override of ``rescore`` (e.g. ``data.eval_scale=1.5``, ``train.eval_precision=fp32``)."""
    from pipelines.tracking import LocalReporter
    from pipelines.train import evaluate_checkpoint, load_model, run

    class EchoReporter(LocalReporter):
        """Prints each epoch's metrics: a full recipe runs for minutes."""

        def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
            keys = ("epoch", "loss", "recall_at_1", "map_at_r", "xgroup_recall_at_1")
            print(f"  {recipe}: " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics), flush=True)
            super().report(metrics, checkpoint_dir)

    cfg = load_config(recipe, overrides)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-emoji-") as tmp:
        # The last epoch is always scored: reuse its metrics rather than embedding the test
        # set again; only the Google->Twitter figure needs the model afterwards.
        m = run(cfg, EchoReporter(Path(tmp)))
        row = {"R@1": m["recall_at_1"], "MAP@R": m["map_at_r"], "RP": m["r_precision"],
               "xR@1": m["xgroup_recall_at_1"]}
        ckpt = sorted(Path(tmp).glob("checkpoint_*"))[-1]
        _, model, split = load_model(ckpt)
        row.update(google_to_twitter(model, split))
        for override in rescore:
            m = evaluate_checkpoint(ckpt, [override])
            row[f"R@1 with {override}"], row[f"MAP@R with {override}"] = m["recall_at_1"], m["map_at_r"]
    return row, time.perf_counter() - t0


def eval_cost(recipe: str, overrides: list[str], epochs: int) -> list[dict[str, float]]:
    """Train ``recipe`` for ``epochs`` epochs scoring every epoch, once with the evaluation cache
    (``data.eval_cache_mb``) and once without; per epoch: training and evaluation seconds of
    both, and whether every score agrees exactly (the cache must not change a digit)."""
    from pipelines.tracking import LocalReporter
    from pipelines.train import TIMING_METRICS, run

    histories = {}
    for cached in (True, False):
        cfg = load_config(recipe, [*overrides, f"train.epochs={epochs}", "train.eval_every=1",
                                   f"data.eval_cache_mb={2048 if cached else 0}"])
        with tempfile.TemporaryDirectory(prefix="bench-emoji-cost-") as tmp:
            reporter = LocalReporter(Path(tmp), show_progress=False)
            run(cfg, reporter)
            histories[cached] = reporter.history
    rows = []
    for c, u in zip(histories[True], histories[False], strict=True):
        same = {k: v for k, v in c.items() if k not in TIMING_METRICS} == {
            k: v for k, v in u.items() if k not in TIMING_METRICS}
        rows.append({"epoch": c["epoch"], "train_s": c["epoch_time_s"], "eval_cached_s": c["eval_time_s"],
                     "eval_uncached_s": u["eval_time_s"], "cached_over_train": c["eval_time_s"] / c["epoch_time_s"],
                     "uncached_over_train": u["eval_time_s"] / u["epoch_time_s"], "scores_equal": float(same),
                     "recall_at_1": c["recall_at_1"]})
        print(f"  {recipe} epoch {int(c['epoch'])}: train {c['epoch_time_s']:.1f} s | eval cached "
              f"{c['eval_time_s']:.1f} s ({100 * rows[-1]['cached_over_train']:.0f}% of training) | uncached "
              f"{u['eval_time_s']:.1f} s ({100 * rows[-1]['uncached_over_train']:.0f}%) | scores "
              f"{'identical' if same else 'DIFFER'} (R@1 {c['recall_at_1']:.4f})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT / "data" / "emoji"), help="built emoji folder (built if missing)")
    ap.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    ap.add_argument("--recipes", nargs="+", default=[], metavar="RECIPE",
                    help="train these recipes instead of emoji_<loss>[_ps] (e.g. emoji_proxy_nca_pp_long)")
    ps = ap.add_mutually_exclusive_group()
    ps.add_argument("--no-ps", action="store_true", help="skip the Proxy Synthesis variants")
    ps.add_argument("--only-ps", action="store_true", help="only the Proxy Synthesis variants")
    ap.add_argument("--epochs", type=int, default=0, help="override train.epochs (0 = the recipe's)")
    ap.add_argument("--max-steps", type=int, default=0, help="train.max_steps_per_epoch (0 = full epochs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra dotted config overrides for every recipe, e.g. data.image_size=128")
    ap.add_argument("--no-baselines", action="store_true", help="skip the raw-pixel and frozen rows")
    ap.add_argument("--eval-scales", nargs="*", type=float, default=[], metavar="S",
                    help="also score each trained model at these data.eval_scale values (no retraining)")
    ap.add_argument("--rescore", nargs="*", default=[], metavar="KEY=VALUE",
                    help="also score each trained model with each of these overrides, e.g. train.eval_precision=fp32")
    ap.add_argument("--eval-cost", type=int, default=0, metavar="EPOCHS",
                    help="instead of the table: per-epoch evaluation time against training time over this "
                         "many epochs, with and without the frozen-stage evaluation cache")
    ap.add_argument("--out", default="", help="write the table as JSON here")
    args = ap.parse_args(argv)

    root = ensure_built(args.root)
    # Scored once, after the last epoch: per-epoch evaluation of ~4k images would cost a fifth of the run.
    overrides = [f"data.root={root}", "scaling.num_workers=1", f"train.seed={args.seed}", "train.recall_ks=[1]",
                 "train.eval_every=1000"]
    if args.epochs:
        overrides.append(f"train.epochs={args.epochs}")
    if args.max_steps:
        overrides.append(f"train.max_steps_per_epoch={args.max_steps}")
    overrides += args.set

    if args.eval_cost:
        recipes = args.recipes or [f"emoji_{loss}" for loss in args.losses]
        costs = {r: eval_cost(r, overrides, args.eval_cost) for r in recipes}
        if args.out:
            Path(args.out).write_text(json.dumps(costs, indent=2) + "\n")
        return 0 if all(row["scores_equal"] for rows in costs.values() for row in rows) else 1

    split = build_datasets(load_config("emoji_proxy_anchor", overrides).data)
    print(f"emoji: {len(split.train)} train images ({split.num_classes} classes), {len(split.test)} test images")
    rows: dict[str, dict[str, float]] = {} if args.no_baselines else baselines(split)
    _print(rows)
    # Every loss without PS first, then with it: a partial run still gives the loss ordering.
    variants = (False,) if args.no_ps else (True,) if args.only_ps else (False, True)
    recipes = args.recipes or [f"emoji_{loss}{'_ps' if ps else ''}" for ps in variants for loss in args.losses]
    for recipe in recipes:
        rescore = [*(f"data.eval_scale={s:g}" for s in args.eval_scales), *args.rescore]
        row, seconds = train_one(recipe, overrides, rescore)
        rows[recipe] = {**row, "minutes": seconds / 60}
        _print({recipe: rows[recipe]}, header=False)
        for key in (k for k in row if " with " in k):
            print(f"  {key}: {row[key]:.4f}")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print()
    _print(rows)
    return 0


def _print(rows: dict[str, dict[str, float]], header: bool = True) -> None:
    cols = ["R@1", "MAP@R", "RP", "xR@1", "G->T R@1", "minutes"]
    if header:
        print(f"| {'model':26s} | " + " | ".join(f"{c:>8s}" for c in cols) + " |")
        print("|" + "-" * 28 + "|" + "|".join("-" * 10 for _ in cols) + "|")
    for name, row in rows.items():
        cells = [f"{row[c]:8.4f}" if c in row else f"{'':8s}" for c in cols]
        print(f"| {name:26s} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
