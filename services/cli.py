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


def _cmd_report(args: argparse.Namespace) -> int:
    import os

    from services import report

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per download is noise
    try:
        rep = report.build_report(args.targets, out=args.out, tracking_uri=args.tracking_uri,
                                  log=not args.no_log, max_runs=args.max_runs)
    except report.ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {rep.path} ({len(rep.runs)} run(s))")
    for run_id in rep.logged_to:
        print(f"logged : run {run_id} artifact {report.ARTIFACT_DIR}/{report.ARTIFACT_NAME}")
    return 0


def _cmd_data_build(args: argparse.Namespace) -> int:
    from pipelines.data.emoji import DEFAULT_ROOT, DESIGNS, build_emoji

    designs = args.designs or list(DESIGNS)
    out = build_emoji(args.out or DEFAULT_ROOT, designs=designs, size=args.size, tiny=args.tiny,
                      seed=args.seed, progress=not args.quiet)
    print(f"built: {out} (train with data.name=emoji data.root={out})")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    base = load_config(args.config, args.overrides)
    from services import sweep

    print(f"proxydml tune: {args.samples} trial(s) of {base.scaling.num_workers} worker(s), "
          f"{args.search} search, scheduler {args.scheduler}", flush=True)
    out = sweep.run_sweep(base, args.space, samples=args.samples, scheduler=args.scheduler,
                          search=args.search, max_concurrent=args.max_concurrent, metric=args.metric,
                          address=args.address)
    print(f"\nsweep {out.name}{' (resumed)' if out.resumed else ''}: {len(out.trials)} trial(s)")
    for t in sorted(out.trials, key=lambda t: -(t["metric"] or float("-inf"))):
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        metric = f"{t['metric']:.4f}" if t["metric"] is not None else "n/a"
        print(f"  {t['trial_id']:24s} {args.metric}={metric} epochs={t['epochs']} {shown}")
    print(f"MLflow parent run: {out.parent_run_id}")
    print(f"best config      : proxydml tune best {out.name}")
    return 0


def _cmd_tune_best(args: argparse.Namespace) -> int:
    import os

    from services import sweep

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        from services.mlflow_tracking import local_store

        uri = local_store()[0]
    print(sweep.best_config(args.sweep, uri), end="")
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

    tu = sub.add_parser("tune", help="hyper-parameter sweep on Ray Tune (or: tune best SWEEP)")
    tu.add_argument("--config", default=None, help="recipe name or YAML path")
    tu.add_argument("--space", required=True, help="search-space YAML (or a name under configs/search)")
    tu.add_argument("--samples", type=int, default=8, help="number of trials (default 8)")
    tu.add_argument("--scheduler", default="asha", help="asha | none (default asha)")
    tu.add_argument("--search", default="optuna", help="optuna | random | grid (default optuna)")
    tu.add_argument("--max-concurrent", type=int, default=None, help="default: what the cluster holds")
    tu.add_argument("--metric", default="map_at_r", help="metric to maximise (default map_at_r)")
    tu.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    tu.add_argument("overrides", nargs="*", help="dotted key=value overrides of the base config")
    tu.set_defaults(func=_cmd_tune)

    best = sub.add_parser("tune-best", help=argparse.SUPPRESS)
    best.add_argument("sweep", help="sweep name (printed by proxydml tune)")
    best.add_argument("--tracking-uri", default=None, help="MLflow URI (default: $MLFLOW_TRACKING_URI or ./mlruns)")
    best.set_defaults(func=_cmd_tune_best)

    ev = sub.add_parser("eval", help="evaluate a saved checkpoint on the unseen classes")
    ev.add_argument("--checkpoint", required=True, help="checkpoint folder")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. data.root=...)")
    ev.set_defaults(func=_cmd_eval)

    rep = sub.add_parser("report", help="HTML page comparing runs (params, metrics, plots)")
    rep.add_argument("targets", nargs="+", metavar="RUN_ID|EXPERIMENT",
                     help="run ids and/or experiment names or ids")
    rep.add_argument("--out", default="report.html", help="output HTML file (default report.html)")
    rep.add_argument("--tracking-uri", default=None,
                     help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else ./mlruns sqlite)")
    rep.add_argument("--max-runs", type=int, default=20, help="most recent runs taken per experiment (default 20)")
    rep.add_argument("--no-log", action="store_true",
                     help="only write the file (default: also log report/report.html to the runs, "
                          "or to the experiment's 'report' run)")
    rep.set_defaults(func=_cmd_report)

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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["tune", "best"]:  # `proxydml tune best SWEEP`
        argv = ["tune-best", *argv[2:]]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
