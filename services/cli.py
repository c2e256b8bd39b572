"""``proxydml`` command line: train, eval, config show.

Every user error (bad config key or value, missing file, unusable data) ends with one line
``error: ...`` on stderr and exit code 2, before anything is started or written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.config import ConfigError, describe, load_config
from pipelines.data import DataError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError)


def _cmd_config_show(args: argparse.Namespace) -> int:
    if args.keys:
        for key, typ, text in describe():
            print(f"{key:32s} {typ:18s} {text}")
        return 0
    cfg = load_config(args.recipe, args.overrides)
    print(f"# run name: {cfg.run_name()}")
    print(cfg.to_yaml(), end="")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from services import training

    print(f"proxydml train: run {cfg.run_name()} on {cfg.scaling.num_workers} worker(s)", flush=True)
    out = training.train(cfg, address=args.address)
    keys = [k for k in out.metrics if k.startswith(("recall_at", "map_at_r", "r_precision", "precision_at", "nmi"))]
    print("\nunseen-class retrieval (last epoch)")
    print(f"{'metric':16s} value")
    for k in keys:
        print(f"{k:16s} {out.metrics[k]:.4f}")
    print(f"\nMLflow run  : {out.mlflow_run_id} ({out.tracking_uri})")
    print(f"checkpoint  : {out.checkpoint_path}")
    print(f"run name    : {out.run_name}{' (resumed)' if out.resumed else ''}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pipelines.evaluate import format_metrics
    from pipelines.train import evaluate_checkpoint

    metrics = evaluate_checkpoint(Path(args.checkpoint), args.overrides)
    print(format_metrics(metrics))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proxydml", description="Proxy-based deep metric learning on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    cfg_p = sub.add_parser("config", help="inspect configurations")
    cfg_sub = cfg_p.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved config of a recipe")
    show.add_argument("recipe", nargs="?", default=None, help="recipe name or YAML path")
    show.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    show.add_argument("--keys", action="store_true", help="list every config key with its doc")
    show.set_defaults(func=_cmd_config_show)

    tr = sub.add_parser("train", help="train on Ray Train workers")
    tr.add_argument("--config", default=None, help="recipe name or YAML path")
    tr.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    tr.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    tr.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval", help="evaluate a saved checkpoint on the unseen classes")
    ev.add_argument("--checkpoint", required=True, help="checkpoint folder")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. data.root=...)")
    ev.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
