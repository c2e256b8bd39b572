"""A searchable model version: embed a gallery, build and publish its faiss index, search it.

``build`` resolves a registered version (``NAME``, ``NAME@ALIAS``, ``NAME/VERSION``), embeds the
gallery with that version's model on the Ray cluster (``runtime.embed_gallery``: Ray Data, or this
process on a one-node cluster without GPUs), writes
the embeddings as Parquet, builds the index in shards (``pipelines/index.py``), measures its
ANN recall@10 against exact search on held-out gallery queries, and publishes:

1. the index, the embeddings and a manifest (sha256 of every file) as artifacts of an *index
   run* in the model's experiment;
2. the index is downloaded back and its sha256 checked;
3. only then the version is tagged (``index_uri`` last: a reader trusts a version only once it
   has it, and checks the file it downloads against ``index_sha256``).

A failure before step 3 leaves the index run FAILED and the version untouched. ``serving``
(the alias ``search`` and ``serve`` answer with) moves only to a version whose published
index reaches :data:`MIN_RECALL`.

This module never imports Ray (services/runtime.py does, imported on use).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.config import Config, from_dict, load_config, load_yaml
from pipelines.data import build_datasets
from pipelines.data.types import DataError
from pipelines.gallery import (
    IMAGE_SUFFIXES,
    GalleryEmbedder,
    GalleryItems,
    dataset_items,
    decode_image,
    folder_items,
    query_transform,
    read_embeddings,
    write_embeddings,
)
from pipelines.index import (
    Tuned,
    add_shard,
    check_factory,
    default_factory,
    exact_top_k,
    new_index,
    read_index,
    search,
    train_sample_size,
    tune_search,
    write_index,
)
from services import aliases, registry
from services.snapshots import cache_root, fetch_dataset, sha256_file

SERVING, MIN_RECALL = aliases.SERVING, aliases.SERVING_MIN_RECALL
RECALL_K = 10
RECALL_QUERIES = 1000  # held-out gallery queries the recall is measured on
INDEX_TAGS = ("index_run_id", "index_sha256", "index_factory", "index_search", "ann_recall_at_10", "gallery",
              "gallery_id", "gallery_images", "index_uri")  # index_uri last: see the module docstring
_REF_RE = re.compile(r"^(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>\d+))?$")


class IndexBuildError(ValueError):
    """A gallery, model reference or index setting that cannot be used; one line says which."""


class NotFound(IndexBuildError):
    """No such model, alias or version (``serve`` answers 404)."""


@dataclass(frozen=True)
class ModelRef:
    name: str
    alias: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        return self.name + (f"@{self.alias}" if self.alias else f"/{self.version}" if self.version else "")


def parse_model_ref(text: str, default_alias: str = registry.CHAMPION) -> ModelRef:
    """``NAME`` (the default alias), ``NAME@ALIAS`` or ``NAME/VERSION``."""
    m = _REF_RE.match(text or "")
    if not m:
        raise IndexBuildError(f"--model {text!r}: give NAME, NAME@ALIAS or NAME/VERSION")
    registry.check_model_name(m["name"])
    if m["alias"] is None and m["version"] is None:
        return ModelRef(m["name"], default_alias)
    return ModelRef(m["name"], m["alias"], m["version"])


def resolve_version(client: Any, ref: ModelRef) -> Any:
    """The ModelVersion ``ref`` names; NotFound naming what is missing."""
    if registry.get_model(client, ref.name) is None:
        raise NotFound(f"no registered model {ref.name!r}")
    if ref.alias:
        version = registry.version_by_alias(client, ref.name, ref.alias)
        if version is None:
            raise NotFound(f"model {ref.name!r} has no alias {ref.alias!r}")
        return version
    try:
        return client.get_model_version(ref.name, ref.version)
    except Exception as exc:
        raise NotFound(f"model {ref.name!r} has no version {ref.version}") from exc


def load_version(client: Any, version: Any, cache: Path | None = None) -> tuple[Config, dict[str, torch.Tensor]]:
    """(config, weights) of a model version, from its run's checkpoint artifacts (cached by run id)."""
    folder = (cache or cache_root() / "models") / version.run_id
    if not ((folder / "config.yaml").is_file() and (folder / "model.pt").is_file()):
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        try:
            registry.download_checkpoint(client, version.run_id, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)  # complete or absent: a reader never sees half a download
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    cfg = from_dict(load_yaml(folder / "config.yaml"))
    return cfg, torch.load(folder / "model.pt", map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- the gallery -----------------
def resolve_gallery(source: str, cfg: Config) -> tuple[GalleryItems, str]:
    """(items, source as recorded) of ``--gallery``: an image folder, ``s3://bucket/prefix``
    pushed with ``proxydml data push``, ``unseen`` (the unseen classes of the model's own data
    set) or ``unseen:RECIPE`` (those of a recipe's data set)."""
    if not source:
        raise IndexBuildError("--gallery must name an image folder, s3://bucket/prefix, unseen or unseen:RECIPE")
    if source == "unseen" or source.startswith("unseen:"):
        data = cfg.data if source == "unseen" else load_config(source.removeprefix("unseen:")).data
        data = dataclasses.replace(cfg.data, name=data.name, root=data.root, val_classes=0)
        try:
            items = dataset_items(build_datasets(data).test)
        except DataError as exc:
            raise IndexBuildError(f"--gallery {source}: {exc}") from exc
        return items, f"{source} ({data.name}{', ' + data.root if data.root else ''})"
    root = fetch_dataset(source, option="--gallery") if source.startswith("s3://") else Path(source)
    try:
        return folder_items(root), source
    except DataError as exc:
        raise IndexBuildError(f"--gallery {source}: {exc}") from exc


# ---------------------------------------------------------------- build -----------------------
@dataclass
class IndexResult:
    model: str
    version: str
    factory: str
    search_param: str
    recall: float
    images: int
    skipped: int
    gallery: str
    gallery_id: str
    index_run_id: str
    index_sha256: str
    nodes: dict[str, int] = field(default_factory=dict)
    serving_moved: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [
            f"index    : {self.model}/{self.version} {self.factory}{' ' + self.search_param if self.search_param else ''}"
            f", {self.images} images ({self.skipped} skipped) from {self.gallery}",
            f"recall   : ANN recall@{RECALL_K} {self.recall:.4f} against exact search",
            f"embedded : on {len(self.nodes)} node(s) " + ", ".join(f"{n[:8]}={c}" for n, c in sorted(self.nodes.items())),
            f"published: runs:/{self.index_run_id}/index (sha256 {self.index_sha256[:16]})",
            f"serving  : {'moved to version ' + self.version if self.serving_moved else 'unchanged'}",
            "time     : " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()),
        ]


@dataclass
class BuildRequest:
    model: str  # NAME, NAME@ALIAS or NAME/VERSION
    gallery: str
    tracking_uri: str | None = None
    factory: str | None = None
    skip_bad: bool = False
    concurrency: int | None = None
    batch_size: int | None = None
    threads: int = 1
    serve: bool = False  # move `serving` to this version when its recall reaches min_recall
    min_recall: float = MIN_RECALL
    address: str | None = None


def build(req: BuildRequest, *, log: Callable[[str], None] = print,
          hook: Callable[[str], None] | None = None) -> IndexResult:
    """Embed, index, verify and publish (see the module docstring). ``hook(step)`` is called
    between steps (tests break the build there)."""
    from mlflow.tracking import MlflowClient

    from services import mlflow_tracking as mt

    step = hook or (lambda _step: None)
    if not (0.0 <= req.min_recall <= 1.0):
        raise IndexBuildError(f"--min-recall must be in [0, 1], got {req.min_recall}")
    uri = mt.resolve_tracking_uri(req.tracking_uri)
    client = MlflowClient(uri)
    ref = parse_model_ref(req.model)
    version = resolve_version(client, ref)
    if req.serve:
        registry.require_maintainer(client, ref.name)
    cfg, state = load_version(client, version)
    dim = cfg.model.embedding_dim
    if req.factory:
        check_factory(req.factory, dim)
    items, gallery = resolve_gallery(req.gallery, cfg)
    if len(items) == 0:
        raise IndexBuildError(f"--gallery {req.gallery}: no images (looked for {', '.join(IMAGE_SUFFIXES)})")
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="proxydml-index-") as tmp:
        out = Path(tmp) / "index"
        t0 = time.monotonic()
        counts = _embed(items, cfg, state, out / "embeddings", req, step)
        timings["embed"] = time.monotonic() - t0
        if counts.bad and not req.skip_bad:
            raise IndexBuildError(f"{counts.first_error} ({counts.bad} undecodable gallery file(s); "
                                  "--skip-bad skips and counts them)")
        if counts.good == 0:
            raise IndexBuildError(f"--gallery {req.gallery}: none of its {len(items)} file(s) could be decoded")
        log(f"embedded {counts.good} images on {len(counts.nodes)} node(s) in {timings['embed']:.1f} s")
        t0 = time.monotonic()
        factory = req.factory or default_factory(counts.good, dim)
        index = _index_from_shards(out / "embeddings", factory, dim, cfg.train.seed)
        timings["index"] = time.monotonic() - t0
        t0 = time.monotonic()
        tuned = _tune(index, out / "embeddings", cfg.train.seed, req.min_recall)
        timings["recall"] = time.monotonic() - t0
        step("indexed")
        write_index(index, out / "index.faiss")
        gallery_id = counts.gallery_id()
        manifest = {
            "model": ref.name, "version": str(version.version), "run_id": version.run_id, "factory": factory,
            "search": tuned.parameter, "ann_recall_at_10": tuned.recall, "dim": dim, "images": counts.good,
            "skipped": counts.bad, "gallery": gallery, "gallery_id": gallery_id, "nodes": dict(counts.nodes),
            "files": {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*")) if p.is_file()},
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        result = IndexResult(ref.name, str(version.version), factory, tuned.parameter, tuned.recall, counts.good,
                             counts.bad, gallery, gallery_id, "", manifest["files"]["index.faiss"],
                             dict(counts.nodes), seconds=timings)
        result.index_run_id = _publish(client, version, out, result, step)
    if req.serve:
        result.serving_moved = move_serving(client, ref.name, result.version, min_recall=req.min_recall, log=log)
    return result


@dataclass
class _Counts:
    good: int = 0
    bad: int = 0
    first_error: str = ""
    nodes: Counter = field(default_factory=Counter)
    digest: Any = field(default_factory=hashlib.sha256)

    def gallery_id(self) -> str:
        """Content id of what was indexed: sha256 over each image's (class, sha256), in id order."""
        return self.digest.hexdigest()


def _embed(items: GalleryItems, cfg: Config, state: dict[str, torch.Tensor], folder: Path, req: BuildRequest,
           step: Callable[[str], None]) -> _Counts:
    from services import runtime

    runtime.ensure_ray(req.address)
    counts = _Counts()
    batches = runtime.embed_gallery(items, cfg, state, batch_size=req.batch_size or cfg.data.eval_batch_size,
                                    concurrency=req.concurrency, threads=req.threads)
    for batch in write_embeddings(batches, folder):
        ok = np.asarray(batch["ok"], dtype=bool)
        counts.good += int(ok.sum())
        counts.bad += int((~ok).sum())
        if counts.bad and not counts.first_error:
            counts.first_error = str(np.asarray(batch["error"])[~ok][0])
        counts.nodes.update(str(n) for n in np.asarray(batch["node"])[ok])
        for cls, sha in zip(np.asarray(batch["class"])[ok], np.asarray(batch["sha256"])[ok]):
            counts.digest.update(f"{cls}\t{sha}\n".encode())
        step("embedded-batch")
    return counts


def _index_from_shards(folder: Path, factory: str, dim: int, seed: int) -> Any:
    index = new_index(factory, dim)
    want = train_sample_size(index)
    if want:  # a seeded sample of the whole gallery, one shard in memory at a time
        total = sum(len(ids) for ids, _, _ in read_embeddings(folder, vectors=False))
        keep = np.random.default_rng(seed).random(total) < min(1.0, want / total)
        sample, start = [], 0
        for ids, vectors, _ in read_embeddings(folder):
            sample.append(vectors[keep[start:start + len(ids)]])
            start += len(ids)
        from pipelines.evaluate import l2_normalise

        index.train(l2_normalise(np.concatenate(sample)))
    for ids, vectors, _ in read_embeddings(folder):
        add_shard(index, ids, vectors)
    return index


def _tune(index: Any, folder: Path, seed: int, target: float) -> Any:
    """ANN recall@10 of held-out gallery queries (each left out of its own neighbours) against exact
    search, the search depth tuned to ``target``."""
    total = int(index.ntotal)
    if total < 2:
        return Tuned(1.0, "")  # one image: nothing else to find
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(RECALL_QUERIES, total), replace=False))
    queries, own, start = [], [], 0
    for ids, vectors, _ in read_embeddings(folder):
        pos = chosen[(chosen >= start) & (chosen < start + len(ids))] - start
        queries.append(vectors[pos])
        own.append(ids[pos])
        start += len(ids)
    q, own = np.concatenate(queries), np.concatenate(own)
    k = min(RECALL_K, total - 1)
    exact = exact_top_k(q, ((ids, v) for ids, v, _ in read_embeddings(folder)), k, self_ids=own)
    return tune_search(index, q, exact, target, self_ids=own)


def _publish(client: Any, version: Any, folder: Path, result: IndexResult, step: Callable[[str], None]) -> str:
    """Log ``folder`` as the index run's artifacts, verify the index downloads intact, then tag
    the version. Returns the index run id; the run is FAILED and the version untouched when any
    step before the tags fails."""
    exp_id = client.get_run(version.run_id).info.experiment_id
    run = client.create_run(exp_id, run_name=f"index-{result.model}-v{result.version}-{result.gallery_id[:12]}", tags={
        "kind": "index", "registered_model": f"{result.model}/{result.version}", "gallery": result.gallery,
        "gallery_id": result.gallery_id,
    })
    run_id = run.info.run_id
    status = "FAILED"
    try:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        params = {"index.factory": result.factory, "index.search": result.search_param or "exact",
                  "index.gallery": result.gallery, "index.model": f"{result.model}/{result.version}"}
        metrics = {"ann_recall_at_10": result.recall, "gallery_images": result.images,
                   "gallery_skipped": result.skipped, **{f"seconds_{k}": v for k, v in result.seconds.items()}}
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()],
                         metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
        client.log_artifacts(run_id, str(folder), "index")
        step("uploaded")
        with tempfile.TemporaryDirectory(prefix="proxydml-verify-") as tmp:
            got = Path(client.download_artifacts(run_id, "index/index.faiss", tmp))
            if sha256_file(got) != result.index_sha256:
                raise IndexBuildError(f"the index uploaded to run {run_id} does not match what was built "
                                      "(sha256 differs); the version was not tagged")
        step("verified")
        tags = {"index_run_id": run_id, "index_sha256": result.index_sha256, "index_factory": result.factory,
                "index_search": result.search_param, "ann_recall_at_10": f"{result.recall:.6f}",
                "gallery": result.gallery, "gallery_id": result.gallery_id, "gallery_images": str(result.images),
                "index_uri": f"runs:/{run_id}/index"}
        for key in INDEX_TAGS:
            client.set_model_version_tag(result.model, result.version, key, tags[key])
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status=status)
    return run_id


def has_index(version: Any, min_recall: float = 0.0) -> bool:
    """Whether ``version`` carries a published index with ANN recall@10 >= ``min_recall``."""
    tags = version.tags or {}
    return bool(tags.get("index_uri")) and float(tags.get("ann_recall_at_10", "0") or 0) >= min_recall


def move_serving(client: Any, name: str, version: str, *, min_recall: float = MIN_RECALL,
                 log: Callable[[str], None] = print) -> bool:
    """``serving`` := ``version`` when it has a published index with recall >= ``min_recall``."""
    mv = client.get_model_version(name, version)
    if not has_index(mv, min_recall):
        recall = (mv.tags or {}).get("ann_recall_at_10")
        log(f"serving unchanged: version {version} of {name} has "
            + (f"ANN recall@10 {float(recall):.4f} < {min_recall}" if recall else "no published index"))
        return False
    registry.require_maintainer(client, name)
    registry.set_aliases(client, name, {SERVING: str(version)})
    return True


# ---------------------------------------------------------------- search ----------------------
def require_index(name: str, version: Any) -> None:
    """NotFound naming the command to run when ``version`` of model ``name`` has no published index."""
    if not has_index(version):
        raise NotFound(f"model {name!r} version {version.version} has no index: build one with "
                       f"`proxydml index build --model {name}/{version.version} --gallery SOURCE`")


@dataclass
class Searcher:
    """One version's model and index, ready to answer: what ``search`` and ``serve`` hold."""

    name: str
    version: str
    cfg: Config
    embedder: GalleryEmbedder
    index: Any
    meta: dict[int, tuple[str, str]]  # gallery id -> (path, class)

    def embed_images(self, images: Sequence[tuple[str, bytes]]) -> np.ndarray:
        """(name, file bytes) of each query image -> (n, d) embeddings; IndexBuildError naming
        the first image that does not decode."""
        transform = query_transform(self.cfg)
        try:
            decoded = [decode_image(raw, name, transform) for name, raw in images]
        except DataError as exc:
            raise IndexBuildError(str(exc)) from exc
        return self.embedder.embed(np.stack(decoded))

    def embed_files(self, paths: Sequence[str]) -> np.ndarray:
        images = []
        for path in paths:
            try:
                images.append((path, Path(path).read_bytes()))
            except OSError as exc:
                raise IndexBuildError(f"cannot read image {path}: {exc}") from exc
        return self.embed_images(images)

    def query(self, vectors: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        scores, ids = search(self.index, vectors, k)
        return [[{"id": int(i), "path": self.meta[int(i)][0], "class": self.meta[int(i)][1], "score": float(s)}
                 for s, i in zip(row_s, row_i) if i >= 0] for row_s, row_i in zip(scores, ids)]


def open_searcher(client: Any, ref: ModelRef, cache: Path | None = None) -> Searcher:
    """Load the model and the index of the version ``ref`` names (downloads cached, checked by sha256)."""
    version = resolve_version(client, ref)
    require_index(ref.name, version)
    tags = version.tags
    # One folder per published index (its run): the embeddings' paths belong to that gallery.
    folder = (cache or cache_root() / "index") / tags["index_run_id"]
    if not (folder / ".complete").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".partial-") as tmp:
            got = Path(client.download_artifacts(tags["index_run_id"], "index", tmp))
            if sha256_file(got / "index.faiss") != tags["index_sha256"]:
                raise IndexBuildError(f"the index of {ref.name}/{version.version} does not match its sha256 tag")
            (got / ".complete").write_text(tags["index_sha256"])
            shutil.rmtree(folder, ignore_errors=True)
            shutil.move(str(got), folder)
    cfg, state = load_version(client, version)
    meta = {}
    for ids, _, table in read_embeddings(folder / "embeddings", vectors=False):
        for i, path, cls in zip(ids.tolist(), table.column("path").to_pylist(), table.column("class").to_pylist()):
            meta[int(i)] = (path, cls)
    try:  # query images are files, decoded to RGB
        embedder = GalleryEmbedder(cfg, state, in_channels=3)
    except RuntimeError as exc:
        raise IndexBuildError(f"{ref.name}/{version.version} does not read RGB images, so it cannot search "
                              f"image files ({str(exc).splitlines()[0]})") from exc
    return Searcher(ref.name, str(version.version), cfg, embedder, read_index(folder / "index.faiss"), meta)
