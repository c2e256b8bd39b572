"""Scheduled retraining: train on a data snapshot, compare with the champion, promote if better.

One call of :func:`retrain`:

1. verifies the snapshot (a local folder or ``s3://bucket/prefix``, downloaded to a cache;
   ``services/snapshots.py``): ``manifest.json`` lists every file with its sha256 plus an
   overall checksum; the evaluation classes (``test/``) must not overlap the training
   classes (``train/``);
2. builds the config: the champion version's ``config.yaml``, a recipe, or a sweep's best
   config, then the overrides, then ``data.name=folder data.root=<snapshot>
   data.val_classes=0`` (a sweep may choose on held-out seen classes; a model is trained on all
   of them and promoted on the snapshot's evaluation classes only);
3. returns the earlier result when a version for the same (model, snapshot, config hash)
   exists -- the run name is derived from exactly that, so a crashed call resumes the same
   Ray run and MLflow run;
4. takes the model's lock on the tracking server (:class:`services.registry.TrackingLock`);
5. trains with :func:`services.training.train` (Ray Train, sharded as usual);
6. evaluates the candidate and the current champion on the snapshot's evaluation split, each
   with its own config's transforms (single process);
7. registers the candidate as a new version with its tags, and moves ``champion`` only if it
   beats the champion by ``margin`` (``previous-champion`` keeps the old one).

Nothing is registered unless training and both evaluations succeeded; a failed registration
is undone (``services.registry.register_version``). On a server with authentication the
login must hold the maintainer's MANAGE permission on an existing model: that is checked
first, before the snapshot is fetched or anything trains. This module never imports Ray.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.config import Config, from_dict, load_recipe, load_yaml, merge, parse_overrides
from pipelines.evaluate import RANK_METRICS, is_retrieval_metric
from services import auth, snapshots
from services.aliases import SERVING_MIN_RECALL
from services.snapshots import Snapshot, SnapshotError, safe_name

# MLflow (services.registry, services.mlflow_tracking, services.sweep) and Ray
# (services.training) are imported inside the functions that use them, for start-up time:
# ``proxydml retrain --help`` and a refused snapshot need neither.

DEFAULT_MARGIN = 0.005
DEFAULT_METRIC = "map_at_r"
DEFAULT_LOCK_TTL_S = 900.0  # seconds a crashed retrain keeps the model locked (renewed while alive)
DEFAULT_GALLERY = "unseen"  # the snapshot's evaluation classes, indexed after a promotion
EXIT_LOCKED = 75  # sysexits EX_TEMPFAIL: "try again later" -- what a cron wrapper should see


class RetrainError(ValueError):
    """Bad input to a retrain (snapshot, source, arguments); the message says what to fix."""


# ================================================================ snapshots ===================


def fetch_snapshot(location: str, cache_dir: Path | None = None) -> Snapshot:
    """``--data``: a verified local copy of the snapshot (see :mod:`services.snapshots`);
    a snapshot it refuses is a RetrainError with the same message."""
    try:
        return snapshots.fetch_snapshot(location, cache_dir, option="--data")
    except SnapshotError as exc:
        raise RetrainError(str(exc)) from exc


# ================================================================ configs =====================


def config_hash(cfg: Config) -> str:
    """What defines a candidate besides its data: :meth:`Config.config_hash` with the epoch
    count in (more epochs = another candidate) and without data.root (the snapshot id stands
    for the data; an S3 snapshot's cache path is local)."""
    return cfg.config_hash(keep_epochs=True, ignore=("data.root",))


def run_name(model: str, snapshot_id: str, cfg_hash: str) -> str:
    """Deterministic: Ray resumes by it, MLflow finds the run by it, the registry by its tag."""
    return f"retrain-{safe_name(model, 40)}-{safe_name(snapshot_id, 40)}-{cfg_hash}"


def _strip_tracking(values: dict[str, Any]) -> dict[str, Any]:
    # Where the source config ran is not where this one runs: keep only experiment and storage.
    tracking = dict(values.get("tracking") or {})
    values = dict(values)
    values["tracking"] = {k: v for k, v in tracking.items() if k in ("experiment", "storage_path") and v}
    return values


def build_config(base: dict[str, Any], overrides: list[str], snapshot: Snapshot, *, model: str,
                 tracking_uri: str) -> Config:
    """Source config + overrides + the snapshot as a folder dataset, validated."""
    values = merge(_strip_tracking(base), parse_overrides(overrides))
    # An S3 snapshot stays data.root=s3://...: every node of a cluster reads it from its own cache.
    root = snapshot.source if snapshot.source.startswith("s3://") else str(snapshot.root)
    values = merge(values, {"data": {"name": "folder", "root": root, "val_classes": 0}})
    tracking = dict(values.get("tracking") or {})
    tracking["tracking_uri"] = tracking_uri
    tracking.setdefault("experiment", f"proxydml-retrain-{model}")
    values["tracking"] = tracking
    cfg = from_dict(values)
    cfg.tracking.run_name = run_name(model, snapshot.snapshot_id, config_hash(cfg))
    return cfg


# ================================================================ evaluation ==================


def snapshot_overrides(snapshot: Snapshot) -> list[str]:
    """The only config change evaluation makes: read the snapshot as a folder dataset, scored
    on its evaluation classes (never a validation split of its training classes)."""
    return ["data.name=folder", f"data.root={snapshot.root}", "data.val_classes=0"]


def evaluate_split(cfg: Config, model: Any, split: Any) -> dict[str, float]:
    """Retrieval metrics of ``model`` on ``split.test`` (every item queries all the others).

    Always in fp32, whatever ``train.eval_precision`` the run trained with: candidate and
    champion are compared at the one reference precision."""
    from pipelines.evaluate import embed, retrieval_metrics

    emb, labels = embed(model, split.test, cfg.data.eval_batch_size)
    return retrieval_metrics(emb, labels, recall_ks=tuple(cfg.train.recall_ks), nmi=cfg.train.nmi)


def load_run_model(client: Any, run_id: str, snapshot: Snapshot,
                   fallback_uri: str | None = None) -> tuple[Config, Any, Any]:
    """(config, embedder, snapshot split) of a training run, ready to evaluate on ``snapshot``.

    The run's checkpoint artifacts (config.yaml + model.pt) are loaded with the pipeline's own
    ``load_model``; the model's config keeps deciding the evaluation transforms (image size,
    resize), only the data location changes, so candidate and champion see the same images.
    A run without checkpoint artifacts falls back to its MLflow model (``fallback_uri``).
    """
    from pipelines.train import load_model

    overrides = snapshot_overrides(snapshot)
    with tempfile.TemporaryDirectory(prefix="proxydml-retrain-") as tmp:
        folder = Path(tmp) / "checkpoint"
        folder.mkdir()
        from services.registry import download_checkpoint

        try:
            download_checkpoint(client, run_id, folder)
            have_checkpoint = True
        except FileNotFoundError:
            have_checkpoint = False
        if have_checkpoint:
            return load_model(folder, overrides)
        if fallback_uri is None:
            raise FileNotFoundError(f"run {run_id} has no checkpoint/ artifacts")
        import mlflow.pytorch

        from pipelines.data import build_datasets

        cfg_path = client.download_artifacts(run_id, "config.yaml", tmp)
        cfg = from_dict(merge(load_yaml(cfg_path), parse_overrides(overrides)))
        return cfg, mlflow.pytorch.load_model(fallback_uri), build_datasets(cfg.data)


# ================================================================ the flow ====================


@dataclass
class RetrainRequest:
    """What ``proxydml retrain`` was asked to do."""

    model: str
    data: str
    config: str | None = None
    from_champion: bool = False
    from_sweep: str | None = None
    overrides: list[str] = field(default_factory=list)
    margin: float = DEFAULT_MARGIN
    metric: str = DEFAULT_METRIC
    tracking_uri: str | None = None
    address: str | None = None
    cache_dir: Path | None = None
    lock_ttl_s: float = DEFAULT_LOCK_TTL_S
    # After a promotion: the new champion's index of this gallery (``index build --gallery``;
    # default the snapshot's unseen classes, "none": no index), and `serving` moves to it when
    # its ANN recall@10 reaches ``min_recall``.
    gallery: str = DEFAULT_GALLERY
    min_recall: float = SERVING_MIN_RECALL


@dataclass
class RetrainResult:
    """What was decided (or found already decided) and why."""

    model: str
    version: str
    decision: str  # "promoted" | "kept-champion"
    reason: str
    metric: str
    candidate: dict[str, float]
    champion: dict[str, float] | None
    champion_version: str | None
    snapshot_id: str
    config_hash: str
    run_name: str
    run_id: str
    reused: bool = False
    seconds: float = 0.0
    serving: str | None = None  # the version `serving` points at after this retrain
    index_note: str = ""  # what happened to the index and `serving`, one line

    def lines(self) -> list[str]:
        head = "already done: " if self.reused else ""
        out = [f"{head}model {self.model} version {self.version} (snapshot {self.snapshot_id}, "
               f"config {self.config_hash}, run {self.run_name})"]
        cand = self.candidate.get(self.metric)
        champ = (self.champion or {}).get(self.metric)
        out.append(f"  candidate {self.metric} = {_fmt(cand)}"
                   + (f"; champion v{self.champion_version} {self.metric} = {_fmt(champ)}" if self.champion_version else ""))
        verb = "PROMOTED to champion" if self.decision == "promoted" else "NOT promoted: champion kept"
        out.append(f"decision: {verb} -- {self.reason}")
        if self.index_note:
            out.append(f"index: {self.index_note}")
        if self.reused:
            out.append("  nothing retrained: a version for this (model, snapshot, config) exists")
        return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def decide(candidate: float | None, champion: float | None, margin: float, metric: str,
           champion_version: str | None) -> tuple[bool, str]:
    """Promote when there is no champion, or the candidate beats it by at least ``margin``."""
    if candidate is None or not math.isfinite(candidate):
        return False, f"candidate {metric} is {candidate}"
    if champion_version is None:
        return True, "no champion yet"
    if champion is None or not math.isfinite(champion):
        return True, f"champion v{champion_version} has no finite {metric} on this snapshot"
    gain = candidate - champion
    if gain >= margin:
        return True, f"{metric} {candidate:.4f} vs {champion:.4f} (+{gain:.4f} >= margin {margin:g})"
    return False, f"{metric} {candidate:.4f} vs {champion:.4f} ({gain:+.4f} < margin {margin:g})"


def request_tracking_uri(explicit: str | None, overrides: Iterable[str]) -> str:
    """--tracking-uri, else a tracking.tracking_uri override, else $MLFLOW_TRACKING_URI, else local."""
    from services.mlflow_tracking import resolve_tracking_uri

    from_override = (parse_overrides(list(overrides)).get("tracking") or {}).get("tracking_uri")
    return resolve_tracking_uri(explicit or (str(from_override) if from_override else None))


def check_metric(metric: str) -> None:
    if not is_retrieval_metric(metric):
        raise RetrainError(f"--metric {metric!r} is not a reported retrieval metric "
                           f"({', '.join(RANK_METRICS)}, recall_at_K)")


def source_config(req: RetrainRequest, client: Any, uri: str) -> tuple[dict[str, Any], str]:
    """(config values, description of where they came from) for the candidate."""
    from services import registry

    chosen = [x for x in (req.config is not None, req.from_champion, req.from_sweep is not None) if x]
    if len(chosen) > 1:
        raise RetrainError("give at most one of --config, --from-champion, --from-sweep")
    if req.config is not None:
        return load_recipe(req.config), f"recipe {req.config}"
    if req.from_sweep is not None:
        from services.sweep import best_config

        try:
            text = best_config(req.from_sweep, uri)
        except FileNotFoundError as exc:
            raise RetrainError(str(exc)) from exc
        return yaml.safe_load(text) or {}, f"best config of sweep {req.from_sweep}"
    # --from-champion, also the default: the champion's training config.
    if registry.get_model(client, req.model) is None:
        if req.from_champion:
            registry.require_model(client, req.model)  # raises, listing known models
        raise RetrainError(f"model {req.model!r} is not registered yet: give --config RECIPE "
                           "or --from-sweep SWEEP for its first version")
    champ = registry.champion(client, req.model)
    if champ is None:
        raise RetrainError(f"model {req.model!r} has no {registry.CHAMPION!r} alias; give --config or --from-sweep")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(champ.run_id, "config.yaml", tmp)
        except Exception as exc:
            raise RetrainError(f"champion v{champ.version} of {req.model!r} (run {champ.run_id}) "
                               f"has no config.yaml artifact: {exc}") from exc
        return load_yaml(path), f"champion v{champ.version}"


def existing_result(client: Any, model: str, key: str, metric: str) -> RetrainResult | None:
    """The registered outcome of an earlier call with the same run name, if any."""
    from services import registry

    if registry.get_model(client, model) is None:
        return None
    done = [v for v in registry.versions(client, model, {"retrain_key": key})
            if v.tags.get(registry.FAILED_TAG) != "failed"]
    if not done:
        return None
    v = done[0]
    tags = v.tags
    return RetrainResult(
        model=model, version=str(v.version), decision=tags.get("decision", "?"), reason=tags.get("reason", ""),
        metric=tags.get("metric", metric), candidate=registry.scores_in_tags(tags, registry.CANDIDATE_SCORES),
        champion=registry.scores_in_tags(tags, registry.CHAMPION_SCORES) or None,
        champion_version=tags.get("champion_version") or None, snapshot_id=tags.get("snapshot_id", "?"),
        config_hash=tags.get("config_hash", "?"), run_name=key, run_id=v.run_id or "", reused=True,
    )


def _code_version() -> str:
    try:
        from importlib.metadata import version

        return version("proxydml")
    except Exception:
        return "unknown"


def retrain(req: RetrainRequest, *, log: Callable[[str], None] = print,
            register_hook: Callable[[str], None] | None = None,
            index_hook: Callable[[str], None] | None = None) -> RetrainResult:
    """Run one retrain (see the module docstring). Raises RetrainError/ConfigError/DataError on
    bad input before anything is trained or registered, and registry.LockHeld when another
    retrain of the same model is running."""
    from mlflow.tracking import MlflowClient

    from services import registry

    started = time.monotonic()
    registry.check_model_name(req.model)
    check_metric(req.metric)
    if not (req.margin >= 0 and math.isfinite(req.margin)):
        raise RetrainError(f"--margin must be a finite number >= 0, got {req.margin}")
    uri = request_tracking_uri(req.tracking_uri, req.overrides)
    client = MlflowClient(uri)
    # Promotion is guarded: refuse a login without MANAGE on the model now, not after training.
    with auth.guard(uri, auth.Need("READ", f"registered model {req.model!r}", "retrain it", "--role maintainer")):
        if registry.get_model(client, req.model) is not None:
            registry.require_maintainer(client, req.model)

    snapshot = fetch_snapshot(req.data, req.cache_dir)
    log(f"snapshot {snapshot.snapshot_id}: {snapshot.files} files verified, {len(snapshot.train_classes)} "
        f"training / {len(snapshot.test_classes)} evaluation classes ({snapshot.root})")
    base, origin = source_config(req, client, uri)
    cfg = build_config(base, req.overrides, snapshot, model=req.model, tracking_uri=uri)
    cfg_hash = config_hash(cfg)
    key = cfg.run_name()

    found = existing_result(client, req.model, key, req.metric)
    if found is not None:
        found.seconds = time.monotonic() - started
        return found

    from services import training

    training.preflight(cfg)  # data and model problems fail here, before the lock and any worker
    log(f"config from {origin} (hash {cfg_hash}); run {key}; tracking {uri}")

    lock = registry.TrackingLock(client, req.model, ttl_s=req.lock_ttl_s)
    with auth.guard(uri, auth.Need("workspace USE (role maintainer)", "the MLflow workspace",
                                   f"create the retrain lock of {req.model!r}", f"--role maintainer --model {req.model}")):
        lock.acquire()
    try:
        found = existing_result(client, req.model, key, req.metric)  # finished while we waited
        if found is not None:
            found.seconds = time.monotonic() - started
            return found
        outcome = training.train(cfg, address=req.address)
        log(f"trained: run {outcome.mlflow_run_id}{' (resumed)' if outcome.resumed else ''}")

        candidate = evaluate_split(*load_run_model(client, outcome.mlflow_run_id, snapshot))
        champ = registry.champion(client, req.model)
        champion_metrics = None
        if champ is not None:
            champion_metrics = evaluate_split(
                *load_run_model(client, champ.run_id, snapshot, f"models:/{req.model}/{champ.version}"))
        champ_version = str(champ.version) if champ is not None else None
        promote, reason = decide(candidate.get(req.metric), (champion_metrics or {}).get(req.metric),
                                 req.margin, req.metric, champ_version)
        decision = "promoted" if promote else "kept-champion"

        tags = {
            "retrain_key": key, "snapshot_id": snapshot.snapshot_id, "snapshot_checksum": snapshot.checksum,
            "snapshot_source": snapshot.source, "config_hash": cfg_hash, "config_source": origin,
            "git_sha": _git_sha(), "code_version": _code_version(), "metric": req.metric,
            "margin": f"{req.margin:g}", "decision": decision, "reason": reason,
            "champion_version": champ_version or "", "mlflow_run_id": outcome.mlflow_run_id,
            **registry.score_tags(registry.CANDIDATE_SCORES, candidate),
            **registry.score_tags(registry.CHAMPION_SCORES, champion_metrics),
        }
        lock.verify()  # never register on a lock that was taken over
        reg = registry.register_version(
            client, req.model, run_id=outcome.mlflow_run_id, tags=tags, promote_it=promote,
            description=f"retrained on snapshot {snapshot.snapshot_id} from {origin}: {decision} ({reason})",
            model_tags={"framework": "proxydml", "task": "image-embedding"}, hook=register_hook,
        )
        _tag_run(client, outcome.mlflow_run_id, req.model, reg.version.version, decision, reason)
        serving, index_note = _index_champion(req, uri, client, str(reg.version.version), promote, log, index_hook)
    finally:
        lock.release()
    return RetrainResult(
        model=req.model, version=str(reg.version.version), decision=decision, reason=reason, metric=req.metric,
        candidate=candidate, champion=champion_metrics, champion_version=champ_version,
        snapshot_id=snapshot.snapshot_id, config_hash=cfg_hash, run_name=key, run_id=outcome.mlflow_run_id,
        seconds=time.monotonic() - started, serving=serving, index_note=index_note,
    )


def _index_champion(req: RetrainRequest, uri: str, client: Any, version: str, promoted: bool,
                    log: Callable[[str], None], hook: Callable[[str], None] | None) -> tuple[str | None, str]:
    """After a promotion, build the new champion's index and move `serving` to it (the bar:
    ``req.min_recall``). A failed build leaves `serving` where it was and says so in one line;
    it does not undo the promotion (the champion is the better model either way).
    Returns (serving version, note)."""
    from services import index, registry

    serving = registry.aliases_of(client, req.model).get(index.SERVING)
    if not promoted or req.gallery == "none":
        return serving, ""
    log(f"index: building version {version}'s index of gallery {req.gallery}")
    try:
        built = index.build(index.BuildRequest(model=f"{req.model}/{version}", gallery=req.gallery, tracking_uri=uri,
                                               serve=True, min_recall=req.min_recall, address=req.address),
                            log=log, hook=hook)
    except Exception as exc:  # any failure: serving stays, the reason in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return serving, f"build failed, serving stays on {f'v{serving}' if serving else 'no version'}: {first}"
    if built.serving_moved:
        return version, f"v{version} {built.factory}, ANN recall@10 {built.recall:.4f}; serving -> v{version}"
    return serving, (f"v{version} {built.factory}, ANN recall@10 {built.recall:.4f} < {req.min_recall}; "
                     f"serving stays on {f'v{serving}' if serving else 'no version'}")


def _git_sha() -> str:
    from services.mlflow_tracking import git_sha

    return git_sha()


def _tag_run(client: Any, run_id: str, model: str, version: str, decision: str, reason: str) -> None:
    # Convenience only (the registry holds the truth): a failure here must not undo a
    # registration that succeeded.
    try:
        client.set_tag(run_id, "registered_model", f"{model}/{version}")
        client.set_tag(run_id, "retrain.decision", decision)
        client.set_tag(run_id, "retrain.reason", reason)
    except Exception as exc:
        print(f"warning: could not tag run {run_id}: {exc}", file=sys.stderr)
