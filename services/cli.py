"""``proxydml`` command line: train, eval, config show, data build.

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


def _cmd_stack(args: argparse.Namespace) -> int:
    from services import stack

    try:
        return stack.cli(args.stack_command, args.state_dir, args.s3_port, args.mlflow_port)
    except stack.StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_data_build(args: argparse.Namespace) -> int:
    from pipelines.data.emoji import DEFAULT_ROOT, DESIGNS, build_emoji

    designs = args.designs or list(DESIGNS)
    out = build_emoji(args.out or DEFAULT_ROOT, designs=designs, size=args.size, tiny=args.tiny,
                      seed=args.seed, progress=not args.quiet)
    print(f"built: {out} (train with data.name=emoji data.root={out})")
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

    data_p = sub.add_parser("data", help="build offline data sets")
    data_sub = data_p.add_subparsers(dest="data_command", required=True)
    build = data_sub.add_parser("build", help="fetch (npm) and render a data set into an image folder")
    build.add_argument("dataset", choices=["emoji"], help="the data set to build")
    build.add_argument("--designs", nargs="+", default=None,
                       help="emoji designs (default all: google twitter openmoji_color openmoji_black fluent)")
    build.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    build.add_argument("--tiny", action="store_true", help="64 classes at 32 px, for tests (seconds)")
    build.add_argument("--seed", type=int, default=0, help="seed of the class split (default 0)")
    build.add_argument("--out", default=None, help="output folder (default ./data/emoji)")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=_cmd_data_build)

    st = sub.add_parser("stack", help="local S3-compatible server + MLflow server on 127.0.0.1")
    st_opts = argparse.ArgumentParser(add_help=False)
    st_opts.add_argument("--state-dir", default=None, help="pid files, logs, store (default .proxydml/stack)")
    st_opts.add_argument("--s3-port", type=int, default=None, help="S3 port (default: last used, else 9000)")
    st_opts.add_argument("--mlflow-port", type=int, default=None, help="MLflow port (default: last used, else 5000)")
    st_sub = st.add_subparsers(dest="stack_command", required=True)
    for name, text in (("up", "start the stack (idempotent)"), ("down", "stop the stack"),
                       ("status", "show each service up/down with its URL")):
        st_sub.add_parser(name, help=text, parents=[st_opts]).set_defaults(func=_cmd_stack)
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
