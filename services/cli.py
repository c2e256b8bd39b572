"""``proxydml`` command line: config, train, eval, tune, report, data, stack, retrain, models, index,
search, serve, submit.

Every user error (bad config key or value, missing file, unusable data) ends with one line
``error: ...`` on stderr and exit code 2, before anything is started or written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pipelines.config import ConfigError, describe, load_config
from pipelines.data import DataError
from services import aliases, auth, retrain
from services.cluster import ClusterError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, ClusterError)


def _cmd_config_show(args: argparse.Namespace) -> int:
    if args.keys:
        for key, typ, text in describe():
            print(f"{key:32s} {typ:18s} {text}")
        return 0
    # The recipe as in train (--config RECIPE) or as the first positional argument.
    recipe, overrides = args.config, list(args.items)
    if recipe is None and overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    cfg = load_config(recipe, overrides)
    print(f"# run name: {cfg.run_name()}")
    print(cfg.to_yaml(), end="")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from pipelines.evaluate import is_retrieval_metric
    from services import console, training

    started = time.monotonic()  # wall time from the command's start to the final table
    cfg = training.resolve_for_workers(load_config(args.config, args.overrides))
    with console.run_console(console.log_path_for(cfg.run_name()), discard_on=USER_ERRORS) as log:
        print(f"proxydml train: run {cfg.run_name()} on {cfg.scaling.num_workers} worker(s)", flush=True)
        out = training.train(cfg, address=args.address, show_progress=sys.stderr.isatty() and not args.quiet,
                             log_file=log)
        keys = [k for k in out.metrics if is_retrieval_metric(k, nmi=True)]
        held = cfg.data.val_classes
        title = f"validation retrieval ({held} held-out seen classes)" if held else "unseen-class retrieval"
        print(f"\n{title} (last epoch)")
        print(f"{'metric':16s} value")
        for k in keys:
            print(f"{k:16s} {out.metrics[k]:.4f}")
        print(f"\nMLflow run  : {out.mlflow_run_id} ({out.tracking_uri})")
        print(f"checkpoint  : {out.checkpoint_path}")
        state = " (already finished: nothing trained)" if out.already_finished else " (resumed)" if out.resumed else ""
        print(f"run name    : {out.run_name}{state}")
        print(f"log         : {log} (everything, library output included)")
        print(f"wall time   : {time.monotonic() - started:.0f} s")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pipelines.evaluate import format_metrics
    from pipelines.train import evaluate_checkpoint
    from services.snapshots import install_data_resolver

    install_data_resolver()  # a checkpoint trained on data.root=s3://... reads it from this node's cache

    if args.checkpoint.startswith("s3://"):  # a Ray checkpoint in the bucket (the stack's, say)
        from services.snapshots import SnapshotError, download_folder

        with tempfile.TemporaryDirectory(prefix="proxydml-ckpt-") as tmp:
            try:
                local = download_folder(args.checkpoint, Path(tmp))
            except SnapshotError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            metrics = evaluate_checkpoint(local, args.overrides)
    else:
        metrics = evaluate_checkpoint(Path(args.checkpoint), args.overrides)
    # --json: every digit (a logged metric and its re-evaluation compare exactly).
    print(json.dumps(metrics) if args.json else format_metrics(metrics))
    return 0


def _cmd_stack(args: argparse.Namespace) -> int:
    from services import stack

    try:
        if args.stack_command == "user":  # user add
            return stack.cli_user_add(args.state_dir, args.name, args.role, experiments=args.experiment,
                                      models=args.model, tracking_uri=args.tracking_uri, password_env=args.password_env)
        return stack.cli(args.stack_command, args.state_dir, args.s3_port, args.mlflow_port,
                         auth_on=getattr(args, "auth", False), single_user=getattr(args, "single_user", False),
                         folder=getattr(args, "folder", None))
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


def _cmd_data_push(args: argparse.Namespace) -> int:
    from services.snapshots import SnapshotError, push_dataset

    try:
        manifest = push_dataset(args.folder, args.destination, args.id)
    except SnapshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"pushed: {len(manifest['files'])} files of {manifest['snapshot_id']} to {args.destination} "
          f"(manifest checksum {manifest['checksum'][:16]}); train with data.root={args.destination}")
    return 0


def _cmd_data_manifest(args: argparse.Namespace) -> int:
    from services.snapshots import MANIFEST, write_manifest

    manifest = write_manifest(args.folder, args.id)
    print(f"{Path(args.folder) / MANIFEST}: {len(manifest['files'])} files, checksum {manifest['checksum']}")
    return 0


def _cmd_data_build(args: argparse.Namespace) -> int:
    from pipelines.data.emoji import DEFAULT_ROOT
    from pipelines.data.emoji_build import DESIGNS, build_emoji

    designs = args.designs or list(DESIGNS)
    out = build_emoji(args.out or DEFAULT_ROOT, designs=designs, size=args.size, tiny=args.tiny,
                      seed=args.seed, progress=not args.quiet)
    print(f"built: {out} (train with data.name=emoji data.root={out})")
    return 0


RANKED_TRIALS = 20  # rows of the ranked table `proxydml tune` ends with (failed trials: half as many more)


def _cmd_tune(args: argparse.Namespace) -> int:
    base = load_config(args.config, args.overrides)
    from services import console, sweep

    with console.run_console(console.log_path_for(f"tune-{Path(args.space).stem}"), discard_on=USER_ERRORS) as log:
        print(f"proxydml tune: --samples {args.samples}, {args.search} search, scheduler {args.scheduler}, "
              f"{base.scaling.num_workers} worker(s) a trial", flush=True)
        # Tune's status tables and the trials' own output go to the log; the console gets one line.
        with console.log_only() as show:
            out = sweep.run_sweep(base, args.space, samples=args.samples, scheduler=args.scheduler,
                                  search=args.search, max_concurrent=args.max_concurrent, metric=args.metric,
                                  address=args.address, grace_period=args.grace,
                                  reduction_factor=args.reduction_factor, include_base=args.include_base,
                                  warm_start=args.warm_start, start_from_best=args.start_from_best,
                                  on_progress=console.SweepConsole(show, tty=sys.stdout.isatty()))
        print(f"\nsweep {out.name}{' (resumed)' if out.resumed else ''}: {len(out.trials)} trial(s)")
        ranked = sorted(out.trials, key=lambda t: -(t["metric"] or float("-inf")))
        # The best trials and the failed ones (their errors), the console bounded for any sweep size.
        shown = ranked[:RANKED_TRIALS] + [t for t in ranked[RANKED_TRIALS:] if t["error"]][:RANKED_TRIALS // 2]
        for t in shown:
            values = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
            metric = f"{t['metric']:.4f}" if t["metric"] is not None else "n/a"
            print(f"  {t['trial_id']:24s} {args.metric}={metric} epochs={t['epochs']} {values}")
            if t["error"]:
                print(f"    failed: {t['error'].splitlines()[0][:200]} (full trace in the log)")
        if len(shown) < len(ranked):
            print(f"  ... {len(ranked) - len(shown)} more (every trial: proxydml report {out.parent_run_id})")
        print(f"MLflow parent run: {out.parent_run_id}")
        print(f"best config      : proxydml tune best {out.name}")
        print(f"log              : {log}")
    return 0


def _cmd_tune_best(args: argparse.Namespace) -> int:
    from services import sweep
    from services.mlflow_tracking import resolve_tracking_uri

    print(sweep.best_config(args.sweep, resolve_tracking_uri(args.tracking_uri)), end="")
    return 0


# -- retrain / models / submit ------------------------------------------------------------------
def _cmd_retrain(args: argparse.Namespace) -> int:
    from services import registry

    req = retrain.RetrainRequest(
        model=args.model, data=args.data, config=args.config, from_champion=args.from_champion,
        from_sweep=args.from_sweep, overrides=args.overrides, margin=args.margin, metric=args.metric,
        tracking_uri=args.tracking_uri, address=args.address,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None, lock_ttl_s=args.lock_ttl,
        gallery=args.gallery, min_recall=args.min_recall,
    )
    try:
        result = retrain.retrain(req, log=lambda msg: print(msg, flush=True))
    except registry.LockHeld as exc:
        print(f"error: another retrain of model {args.model!r} is running: {exc}", file=sys.stderr)
        return retrain.EXIT_LOCKED
    except (retrain.RetrainError, registry.RegistryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in result.lines():
        print(line)
    print(f"({result.seconds:.1f} s)")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from services import registry
    from services.mlflow_tracking import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(args.tracking_uri))
    try:
        if args.models_command == "list":
            return _models_list(client, args.name)
        if args.models_command == "show":
            return _models_show(client, args)
        if args.models_command == "propose":
            return _models_propose(client, args)
        if args.models_command == "promote":
            copy, before = registry.promote_candidate(client, args.name, args.candidate)
            old = before.get(registry.CHAMPION)
            print(f"model {args.name}: candidate v{args.candidate} of {registry.candidates_of(args.name)} is now "
                  f"v{copy.version}, the champion" + (f" (previous-champion = v{old})" if old else ""))
            return 0
        old, new = registry.rollback(client, args.name, args.to)
        print(f"model {args.name}: champion v{old} -> v{new} (previous-champion = v{old})")
        serving = registry.aliases_of(client, args.name).get(aliases.SERVING)
        if serving is not None:
            print(f"model {args.name}: serving = v{serving}"
                  + ("" if serving == new else f" (v{new} has no published index: serving stays)"))
        return 0
    except registry.RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _models_list(client, name: str | None) -> int:
    from services import registry

    if name is None:
        models = list(client.search_registered_models())
        if not models:
            print("no registered models")
        for m in sorted(models, key=lambda m: m.name):
            aliases = " ".join(f"{a}=v{v}" for a, v in sorted(m.aliases.items()))
            print(f"{m.name:32s} {aliases}")
        return 0
    model = registry.require_model(client, name)
    by_version: dict[str, list[str]] = {}
    for alias, version in model.aliases.items():
        by_version.setdefault(str(version), []).append(alias)
    print(f"{'version':8s} {'aliases':28s} {'decision':14s} {'metric':22s} snapshot")
    for v in registry.versions(client, name):
        metric = v.tags.get("metric", "")
        value = v.tags.get(f"{registry.CANDIDATE_SCORES}{metric}", "")
        shown = f"{metric}={float(value):.4f}" if value else ""
        failed = " (registration failed)" if v.tags.get(registry.FAILED_TAG) == "failed" else ""
        print(f"{str(v.version):8s} {','.join(sorted(by_version.get(str(v.version), []))) or '-':28s} "
              f"{v.tags.get('decision', '-'):14s} {shown:22s} {v.tags.get('snapshot_id', '-')}{failed}")
    return 0


def _models_propose(client, args: argparse.Namespace) -> int:
    from pipelines.evaluate import is_retrieval_metric
    from services import registry

    try:
        run = client.get_run(args.run)
    except Exception as exc:  # noqa: BLE001 -- MLflow's not-found and bad-id errors differ by store
        if auth.auth_status(exc):
            raise
        raise registry.RegistryError(f"--run {args.run!r}: no such MLflow run") from exc
    if run.info.status != "FINISHED":
        raise registry.RegistryError(f"--run {args.run}: the run is {run.info.status}, not FINISHED")
    # The run's last retrieval scores ride along, as on a retrain candidate (`models list`).
    scores = {k: v for k, v in run.data.metrics.items() if is_retrieval_metric(k)}
    tags = {"metric": args.metric, "proposed_by": auth.current_user() or "",
            **registry.score_tags(registry.CANDIDATE_SCORES, scores)}
    version = registry.propose(client, args.name, run_id=args.run, tags=tags, description=args.note or "")
    pool = registry.candidates_of(args.name)
    print(f"model {args.name}: run {args.run} proposed as v{version.version} of {pool}; "
          f"a maintainer serves it with `proxydml models promote {args.name} --candidate {version.version}`")
    return 0


def _models_show(client, args: argparse.Namespace) -> int:
    import tempfile

    from services import registry

    registry.require_model(client, args.name)
    if args.version:
        version = client.get_model_version(args.name, args.version)
    else:
        version = registry.version_by_alias(client, args.name, args.alias)
        if version is None:
            raise registry.RegistryError(f"model {args.name!r} has no alias {args.alias!r}")
    aliases = [a for a, v in registry.aliases_of(client, args.name).items() if v == str(version.version)]
    print(f"model    : {args.name} version {version.version} ({', '.join(sorted(aliases)) or 'no alias'})")
    print(f"load     : models:/{args.name}/{version.version}")
    print(f"run      : {version.run_id}")
    print(f"source   : {version.source}")
    if version.description:
        print(f"about    : {version.description}")
    for key in sorted(version.tags):
        print(f"  {key:24s} {version.tags[key]}")
    if args.config and version.run_id:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n# config.yaml of the training run")
            print(Path(client.download_artifacts(version.run_id, "config.yaml", tmp)).read_text(), end="")
    return 0


def _cmd_index_build(args: argparse.Namespace) -> int:
    from pipelines.index import IndexSpecError
    from services import index, registry

    req = index.BuildRequest(
        model=args.model, gallery=args.gallery, tracking_uri=args.tracking_uri, factory=args.factory,
        skip_bad=args.skip_bad, concurrency=args.concurrency, batch_size=args.batch_size, threads=args.threads,
        serve=args.serve, min_recall=args.min_recall, address=args.address,
    )
    try:
        result = index.build(req, log=lambda msg: print(msg, flush=True))
    except (index.IndexBuildError, IndexSpecError, registry.RegistryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in result.lines():
        print(line)
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from services import index
    from services.mlflow_tracking import resolve_tracking_uri

    if args.k < 1:
        print(f"error: -k must be at least 1, got {args.k}", file=sys.stderr)
        return 2
    try:
        ref = index.parse_model_ref(args.model, default_alias=args.alias)
        if args.version:
            ref = index.ModelRef(ref.name, None, args.version)
        searcher = index.open_searcher(MlflowClient(resolve_tracking_uri(args.tracking_uri)), ref)
        hits = searcher.query(searcher.embed_files(args.images), args.k)
    except index.IndexBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": searcher.name, "version": searcher.version,
                          "results": [{"query": q, "hits": h} for q, h in zip(args.images, hits)]}))
        return 0
    for query, found in zip(args.images, hits):
        print(f"{query}  ({searcher.name}/{searcher.version})")
        for rank, hit in enumerate(found, 1):
            print(f"  {rank:>3}  {hit['score']:.4f}  id {hit['id']:<8} {hit['class'] or '-':<24} {hit['path']}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import functools
    import signal
    import threading

    from mlflow.tracking import MlflowClient

    from services import index, runtime, serve
    from services.mlflow_tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri)
    try:  # checked here, in one line, before any replica starts
        version = index.resolve_version(MlflowClient(uri), index.ModelRef(args.model, args.alias, None))
        index.require_index(args.model, version)
    except index.IndexBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runtime.ensure_ray(args.address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        make = functools.partial(serve.open_service, uri, args.model, alias=args.alias, challenger=args.challenger,
                                 poll_s=args.poll_s)
        url = runtime.serve_http(make, tracking_uri=uri, port=args.port, replicas=args.replicas, threads=args.threads)
        print(f"serving {args.model} ({args.alias} = version {version.version}; page compares {args.challenger}) "
              f"at {url}  POST {url}search", flush=True)
        stop.wait()
    finally:
        runtime.stop_serving()
    print("stopped", flush=True)
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    import shlex

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("error: nothing to submit; usage: proxydml submit [--address A] -- proxydml train ...",
              file=sys.stderr)
        return 2
    env = {}
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --env {item!r} must look like KEY=VALUE", file=sys.stderr)
            return 2
        env[key] = value
    from services import runtime

    try:
        job_id, status, code = runtime.run_job(shlex.join(command), address=args.address, env=env or None,
                                               follow=not args.no_wait, working_dir=args.working_dir or None)
    except ConnectionError as exc:
        print(f"error: cannot reach the Ray cluster ({args.address or 'RAY_ADDRESS / local'}): {exc}",
              file=sys.stderr)
        return 2
    if args.no_wait:
        print(f"job {job_id}: {status} (not waiting; follow with `ray job logs -f {job_id}`)")
        return 0
    print(f"job {job_id} ended: {status}" + (f" (exit code {code})" if code is not None else ""))
    if status == "SUCCEEDED":
        return 0
    return code if code else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proxydml", description="Proxy-based deep metric learning on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_config, _add_train, _add_tune, _add_tune_best, _add_eval, _add_report, _add_data, _add_stack,
                _add_retrain, _add_models, _add_index, _add_search, _add_serve, _add_submit):
        add(sub)  # one function per command: its arguments and handler
    return parser


def _add_config(sub: argparse._SubParsersAction) -> None:

    cfg_p = sub.add_parser("config", help="inspect configurations")
    cfg_sub = cfg_p.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved config of a recipe")
    show.add_argument("--config", default=None, help="recipe name or YAML path (as in train)")
    show.add_argument("items", nargs="*", metavar="[RECIPE] key=value",
                      help="the recipe (when --config is not given) and dotted key=value overrides")
    show.add_argument("--keys", action="store_true", help="list every config key with its doc")
    show.set_defaults(func=_cmd_config_show)


def _add_train(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train", help="train on Ray Train workers")
    tr.add_argument("--config", default=None, help="recipe name or YAML path")
    tr.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar (there is none when not in a terminal)")
    tr.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    tr.set_defaults(func=_cmd_train)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    tu = sub.add_parser("tune", help="hyper-parameter sweep on Ray Tune (or: tune best SWEEP)")
    tu.add_argument("--config", default=None, help="recipe name or YAML path")
    tu.add_argument("--space", required=True, help="search-space YAML (or a name under configs/search)")
    tu.add_argument("--samples", type=int, default=8, help="number of trials (default 8)")
    tu.add_argument("--scheduler", default="asha",
                    help="asha | pbt (population-based training of one-worker trials) | none (default asha)")
    tu.add_argument("--search", default="optuna", help="optuna | random | grid (default optuna)")
    tu.add_argument("--max-concurrent", type=int, default=None, help="default: what the cluster holds")
    tu.add_argument("--metric", default="map_at_r", help="metric to maximise (default map_at_r)")
    tu.add_argument("--grace", type=int, default=None,
                    help="ASHA: epochs every trial runs before a cut (default: the first after optim.warmup_epochs)")
    tu.add_argument("--reduction-factor", type=int, default=2,
                    help="ASHA: 1/N of the trials at a rung go on to the next (default 2)")
    tu.add_argument("--include-base", action="store_true",
                    help="the first trial runs the recipe's own values of the searched keys")
    tu.add_argument("--warm-start", default=None, metavar="SWEEP",
                    help="tell the Optuna searcher an earlier sweep's scored trials before it suggests any")
    tu.add_argument("--start-from-best", action="store_true",
                    help="with --warm-start: the earlier sweep's best point is the first trial")
    tu.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    tu.add_argument("overrides", nargs="*", help="dotted key=value overrides of the base config")
    tu.set_defaults(func=_cmd_tune)


def _add_tune_best(sub: argparse._SubParsersAction) -> None:
    best = sub.add_parser("tune-best", help=argparse.SUPPRESS)
    best.add_argument("sweep", help="sweep name (printed by proxydml tune)")
    best.add_argument("--tracking-uri", default=None, help="MLflow URI (default: $MLFLOW_TRACKING_URI or ./mlruns)")
    best.set_defaults(func=_cmd_tune_best)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="evaluate a saved checkpoint on the unseen classes (data.val_classes=0 "
                        "scores a model trained on a validation split on the test classes)")
    ev.add_argument("--checkpoint", required=True, help="checkpoint folder, or s3://bucket/prefix of one")
    ev.add_argument("--json", action="store_true", help="print the metrics as JSON, at full precision")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. data.root=...)")
    ev.set_defaults(func=_cmd_eval)


def _add_report(sub: argparse._SubParsersAction) -> None:
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


def _add_data(sub: argparse._SubParsersAction) -> None:
    data_p = sub.add_parser("data", help="build offline data sets; push one to S3")
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
    push = data_sub.add_parser("push", help="upload a data set folder with its manifest to s3://bucket/prefix "
                               "(then train with data.root=s3://bucket/prefix on any node)")
    push.add_argument("folder", help="the data set folder (any loader's layout)")
    push.add_argument("destination", help="s3://bucket/prefix (endpoint and keys from the AWS environment)")
    push.add_argument("--id", default=None, help="name recorded in the manifest (default: the folder's name)")
    push.set_defaults(func=_cmd_data_push)
    man = data_sub.add_parser("manifest", help="write manifest.json (sha256 of every file) into a snapshot folder, "
                              "for proxydml retrain --data FOLDER")
    man.add_argument("folder", help="the snapshot folder (train/<class>/..., test/<class>/...)")
    man.add_argument("--id", required=True, help="the snapshot's id (recorded with every model trained on it)")
    man.set_defaults(func=_cmd_data_manifest)


def _add_stack(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("stack", help="local PostgreSQL + durable S3-compatible server + MLflow server on 127.0.0.1")
    st_opts = argparse.ArgumentParser(add_help=False)
    st_opts.add_argument("--state-dir", default=None, help="pid files, logs, store (default .proxydml/stack)")
    st_opts.add_argument("--s3-port", type=int, default=None, help="S3 port (default: last used, else 9000)")
    st_opts.add_argument("--mlflow-port", type=int, default=None, help="MLflow port (default: last used, else 5000)")
    st_sub = st.add_subparsers(dest="stack_command", required=True)
    for name, text in (("up", "start the stack (idempotent)"), ("down", "stop the stack"),
                       ("status", "show each service up/down with its URL")):
        st_sub.add_parser(name, help=text, parents=[st_opts]).set_defaults(func=_cmd_stack)
    st_sub.choices["up"].add_argument("--auth", action="store_true",
                                      help="MLflow with logins and per-experiment/model permissions (kept once set)")
    st_sub.choices["up"].add_argument("--single-user", action="store_true",
                                      help="a new stack on sqlite instead of PostgreSQL (one user; kept once set)")
    for name, text in (("backup", "copy the database dump and every object into a new folder"),
                       ("restore", "load a backup into this state folder (replaces its database)")):
        p = st_sub.add_parser(name, help=text, parents=[st_opts])
        p.add_argument("folder", help="the backup folder")
        p.set_defaults(func=_cmd_stack)
    su = st_sub.add_parser("user", help="users of a stack started with --auth").add_subparsers(
        dest="user_command", required=True).add_parser("add", help="create or update a user with one role",
                                                       parents=[st_opts])
    su.add_argument("name")
    su.add_argument("--role", required=True, choices=list(auth.ROLES),
                    help="; ".join(f"{r.name}: {r.summary}" for r in auth.ROLES.values()))
    su.add_argument("--experiment", action="append", default=[], help="trainer: EDIT on this experiment (repeat)")
    su.add_argument("--model", action="append", default=[], help="maintainer: MANAGE on this model (default all); trainer: EDIT on "
                    "MODEL.candidates, to propose candidates (repeat)")
    su.add_argument("--tracking-uri", default=None, help="another basic-auth MLflow server (admin login from env)")
    su.add_argument("--password-env", default=None, metavar="VAR", help="password from $VAR (default: generated)")
    su.set_defaults(func=_cmd_stack)


def _add_retrain(sub: argparse._SubParsersAction) -> None:
    rt = sub.add_parser("retrain", help="retrain a registered model on a data snapshot; promote if better")
    rt.add_argument("--model", required=True, help="registered model name (models:/NAME)")
    rt.add_argument("--data", required=True, help="snapshot folder or s3://bucket/prefix (with manifest.json)")
    src = rt.add_mutually_exclusive_group()
    src.add_argument("--config", default=None, help="recipe name or YAML path")
    src.add_argument("--from-champion", action="store_true",
                     help="the champion's training config (the default once a champion exists)")
    src.add_argument("--from-sweep", default=None, metavar="SWEEP", help="the best config of a sweep")
    rt.add_argument("--margin", type=float, default=retrain.DEFAULT_MARGIN,
                    help=f"promote only if the candidate beats the champion by this much (default {retrain.DEFAULT_MARGIN})")
    rt.add_argument("--metric", default=retrain.DEFAULT_METRIC, help=f"decision metric (default {retrain.DEFAULT_METRIC})")
    rt.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    rt.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    rt.add_argument("--cache-dir", default=None, help="where S3 snapshots are downloaded (default ~/.cache/proxydml)")
    rt.add_argument("--lock-ttl", type=float, default=retrain.DEFAULT_LOCK_TTL_S,
                    help="seconds a crashed retrain keeps the model locked (renewed while alive; "
                         f"default {retrain.DEFAULT_LOCK_TTL_S:g})")
    rt.add_argument("--gallery", default=retrain.DEFAULT_GALLERY,
                    help="after a promotion, index this gallery with the new champion and move 'serving' to it "
                         f"(as index build --gallery; default {retrain.DEFAULT_GALLERY}: the snapshot's evaluation classes; "
                         "none: skip)")
    rt.add_argument("--min-recall", type=float, default=aliases.SERVING_MIN_RECALL,
                    help=f"ANN recall@10 that 'serving' needs (default {aliases.SERVING_MIN_RECALL})")
    rt.add_argument("overrides", nargs="*", help="dotted key=value overrides of the source config")
    rt.set_defaults(func=_cmd_retrain)


def _add_models(sub: argparse._SubParsersAction) -> None:
    mo = sub.add_parser("models", help="registered models: list | show | rollback | propose | promote")
    mo_opts = argparse.ArgumentParser(add_help=False)
    mo_opts.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    mo_sub = mo.add_subparsers(dest="models_command", required=True)
    ls = mo_sub.add_parser("list", help="all models, or the versions of one", parents=[mo_opts])
    ls.add_argument("name", nargs="?", default=None)
    sh = mo_sub.add_parser("show", help="one version: tags, run, decision", parents=[mo_opts])
    sh.add_argument("name")
    sh.add_argument("--version", default=None, help="version number (default: the --alias)")
    sh.add_argument("--alias", default=aliases.CHAMPION, help=f"alias to show (default {aliases.CHAMPION})")
    sh.add_argument("--config", action="store_true", help="also print the training config.yaml")
    rb = mo_sub.add_parser("rollback", help="champion := previous-champion (or --to VERSION)", parents=[mo_opts])
    rb.add_argument("name")
    rb.add_argument("--to", default=None, help="version to restore (default: previous-champion)")
    pr = mo_sub.add_parser("propose", help="a trainer's run as a candidate version of NAME (in NAME.candidates)",
                           parents=[mo_opts])
    pr.add_argument("name")
    pr.add_argument("--run", required=True, help="MLflow run id of a finished training run (its logged model)")
    pr.add_argument("--metric", default="map_at_r", help="the score `models list` shows (default map_at_r)")
    pr.add_argument("--note", default=None, help="description of the candidate")
    pm = mo_sub.add_parser("promote", help="champion := a copy of candidate V (maintainer)", parents=[mo_opts])
    pm.add_argument("name")
    pm.add_argument("--candidate", required=True, help="version number in NAME.candidates")
    for p in (ls, sh, rb, pr, pm):
        p.set_defaults(func=_cmd_models)


def _add_index(sub: argparse._SubParsersAction) -> None:
    ix = sub.add_parser("index", help="build a model version's faiss index of a gallery (Ray Data), publish it in MLflow")
    ix_sub = ix.add_subparsers(dest="index_command", required=True)
    b = ix_sub.add_parser("build", help="embed a gallery with a model version, index it, publish, tag the version")
    b.add_argument("--model", required=True, help="NAME (its champion), NAME@ALIAS or NAME/VERSION")
    b.add_argument("--gallery", required=True,
                   help="image folder (class = first sub-folder), s3://bucket/prefix (proxydml data push), "
                        "unseen (the model's own unseen classes) or unseen:RECIPE")
    b.add_argument("--factory", default=None,
                   help="faiss index_factory string (default: exact up to a size, then HNSW, then IVF-PQ; docs/guide.md)")
    b.add_argument("--skip-bad", action="store_true", help="skip (and count) gallery files that cannot be decoded")
    b.add_argument("--serve", action="store_true",
                   help="then move the 'serving' alias to this version if its recall reaches --min-recall")
    b.add_argument("--min-recall", type=float, default=aliases.SERVING_MIN_RECALL,
                   help=f"ANN recall@10 that 'serving' needs (default {aliases.SERVING_MIN_RECALL})")
    b.add_argument("--concurrency", type=int, default=None, help="embedding actors (default: one per GPU, else per node)")
    b.add_argument("--batch-size", type=int, default=None, help="images per forward pass (default data.eval_batch_size)")
    b.add_argument("--threads", type=int, default=1, help="torch threads (and CPUs) per embedding actor (default 1)")
    b.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    b.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    b.set_defaults(func=_cmd_index_build)


def _add_search(sub: argparse._SubParsersAction) -> None:
    se = sub.add_parser("search", help="nearest gallery images of query images, with a version's model and index")
    se.add_argument("--model", required=True, help="NAME (with --alias), NAME@ALIAS or NAME/VERSION")
    se.add_argument("--alias", default=aliases.SERVING, help=f"alias to search with (default {aliases.SERVING})")
    se.add_argument("--version", default=None, help="a version number instead of the alias")
    se.add_argument("-k", type=int, default=10, help="neighbours per query (default 10)")
    se.add_argument("--json", action="store_true", help="print JSON: model, version and every query's hits")
    se.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    se.add_argument("images", nargs="+", metavar="IMAGE", help="query image files")
    se.set_defaults(func=_cmd_search)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="search over HTTP on 127.0.0.1 (Ray Serve): POST /search, and a page at /")
    sv.add_argument("--model", required=True, help="registered model name")
    sv.add_argument("--alias", default=aliases.SERVING,
                    help=f"alias that answers; replicas follow it when it moves (default {aliases.SERVING})")
    sv.add_argument("--challenger", default=aliases.PREVIOUS,
                    help=f"alias or version the page shows beside it (default {aliases.PREVIOUS})")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    sv.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (default 1)")
    sv.add_argument("--threads", type=int, default=1, help="torch threads (and CPUs) per replica (default 1)")
    sv.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the alias (default 1)")
    sv.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI, else ./mlruns)")
    sv.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    sv.set_defaults(func=_cmd_serve)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    sj = sub.add_parser("submit", help="run a command as a Ray Job on a cluster and follow it: submit -- CMD...")
    sj.add_argument("--address", default=None,
                    help="Ray dashboard (http://host:8265) or cluster address (default RAY_ADDRESS, else local)")
    sj.add_argument("--env", action="append", default=None, metavar="KEY=VALUE", help="environment of the job")
    sj.add_argument("--no-wait", action="store_true", help="submit and return without following the logs")
    sj.add_argument("--working-dir", default=".",
                    help="folder shipped with the job; it runs there on the cluster (default: the current folder, "
                         "less what its .gitignore lists; '' ships nothing)")
    sj.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. proxydml retrain ...")
    sj.set_defaults(func=_cmd_submit)


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
    except Exception as exc:
        refused = auth.as_auth_error(exc)  # MLflow said 401/403: one line, never a traceback
        if refused is None:
            raise
        print(f"error: {refused}", file=sys.stderr)
        return auth.EXIT_NOPERM


if __name__ == "__main__":
    sys.exit(main())
