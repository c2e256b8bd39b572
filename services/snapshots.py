"""Manifests of sha256 sums for data on local disk or under an ``s3://bucket/prefix``, and the
verified, per-node cached download of such data.

Two kinds of folder carry a ``manifest.json``:

- a *snapshot* (retraining): an image folder ``train/<class>/<file>``, ``test/<class>/<file>``;
  :func:`fetch_snapshot` gives a verified local copy (a local folder is verified in place; an
  S3 prefix is downloaded into a cache folder named by the snapshot's content) and checks the
  class split;
- a *data set* (``data.root=s3://...``, any loader's layout: folder, emoji, CUB, Cars, SOP,
  In-Shop): :func:`fetch_dataset` downloads it once per node into a cache keyed by the prefix
  and the manifest's checksum; ``proxydml data push`` uploads one (:func:`push_dataset`).

``manifest.json`` holds ``snapshot_id`` (the data's name), ``created_at``, ``files`` (path ->
sha256) and ``checksum``: the sha256 of the ``sha256sum``-style listing of ``files``
(:func:`manifest_checksum`). Every refusal is a :class:`SnapshotError` whose message names the
data and the offending file. Nothing here imports Ray or MLflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.s3 import list_keys, s3_client

MANIFEST = "manifest.json"
SPLITS = ("train", "test")
_HASH_CHUNK = 1 << 20
# S3 round trips wait on the network, not the CPU: this many files move at once (a boto3 client
# is thread-safe, and botocore keeps 10 connections per client).
TRANSFER_THREADS = 8
# Written last into a data-set cache folder, once every file is downloaded and verified: a
# folder without it is an interrupted fill and is completed (not trusted) by the next process.
COMPLETE = ".complete"


class SnapshotError(ValueError):
    """A snapshot that is missing, malformed or not what its manifest says; the message names
    the snapshot and the file."""


@dataclass(frozen=True)
class Snapshot:
    """A verified data snapshot on local disk."""

    root: Path
    snapshot_id: str
    checksum: str
    source: str
    files: int
    train_classes: tuple[str, ...]
    test_classes: tuple[str, ...]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_checksum(files: dict[str, str]) -> str:
    """Overall checksum: sha256 of ``"<sha256>  <path>\\n"`` lines sorted by path (sha256sum style)."""
    listing = "".join(f"{files[p]}  {p}\n" for p in sorted(files))
    return hashlib.sha256(listing.encode()).hexdigest()


def _data_files(root: Path) -> list[str]:
    """Every file under train/ and test/, as POSIX paths relative to ``root``."""
    out = []
    for split in SPLITS:
        base = root / split
        if base.is_dir():
            out += [p.relative_to(root).as_posix() for p in sorted(base.rglob("*")) if p.is_file()]
    return out


def dataset_files(root: Path) -> list[str]:
    """Every file under ``root`` but its ``manifest.json``, as sorted POSIX relative paths."""
    return sorted(rel for p in root.rglob("*") if p.is_file() and (rel := p.relative_to(root).as_posix()) != MANIFEST)


def build_manifest(root: Path, manifest_id: str, files: list[str]) -> dict[str, Any]:
    """The manifest of ``files`` (paths relative to ``root``) under the name ``manifest_id``."""
    if not manifest_id:
        raise SnapshotError("a snapshot id is required")
    if not files:
        raise SnapshotError(f"{root} holds no files to list")
    digests = {rel: sha256_file(root / rel) for rel in files}
    return {"snapshot_id": manifest_id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": digests, "checksum": manifest_checksum(digests)}


def write_manifest(root: str | Path, snapshot_id: str) -> dict[str, Any]:
    """Write ``root/manifest.json`` for an image-folder snapshot and return it."""
    root = Path(root)
    files = _data_files(root)
    if not files:
        raise SnapshotError(f"{root} holds no files under train/ or test/")
    manifest = build_manifest(root, snapshot_id, files)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _check_listed_path(rel: str, where: str, snapshot: bool) -> None:
    parts = rel.split("/")
    # Nothing outside the folder: no absolute path, no empty, "." or ".." component.
    outside = rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or rel == MANIFEST
    if snapshot and (outside or len(parts) != 3 or parts[0] not in SPLITS):
        raise SnapshotError(f"{where}: {MANIFEST} lists {rel!r}; expected train/<class>/<file> or test/<class>/<file>")
    if outside:
        raise SnapshotError(f"{where}: {MANIFEST} lists {rel!r}, a path outside the data")


def parse_manifest(text: str, where: str, *, snapshot: bool = True) -> dict[str, Any]:
    """Check a manifest's structure and its overall checksum against its own file list.

    ``snapshot``: the files must follow the snapshot layout (``train|test/<class>/<file>``);
    otherwise any relative path inside the folder is allowed (a data set's own layout).
    """
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{where}: {MANIFEST} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: {MANIFEST} must be a JSON object")
    sid, files, checksum = manifest.get("snapshot_id"), manifest.get("files"), manifest.get("checksum")
    if not isinstance(sid, str) or not sid.strip():
        raise SnapshotError(f"{where}: {MANIFEST} has no snapshot_id")
    if not isinstance(files, dict) or not files:
        raise SnapshotError(f"{where}: {MANIFEST} lists no files (empty snapshot)")
    if not isinstance(checksum, str) or not checksum:
        raise SnapshotError(f"{where}: {MANIFEST} has no checksum")
    for rel, digest in files.items():
        _check_listed_path(rel, where, snapshot)
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise SnapshotError(f"{where}: {MANIFEST}: {rel} has no sha256")
    actual = manifest_checksum(files)
    if actual != checksum:
        raise SnapshotError(f"{where}: checksum mismatch: {MANIFEST} says {checksum[:16]}..., "
                            f"its file list hashes to {actual[:16]}...")
    return manifest


def verify_snapshot(root: Path, source: str | None = None) -> Snapshot:
    """Verify a local snapshot against its manifest: every file, nothing unlisted, class split."""
    source = source or str(root)
    if not root.exists():
        raise SnapshotError(f"snapshot {source} does not exist")
    if not root.is_dir():
        raise SnapshotError(f"snapshot {source} is not a folder")
    if not (root / MANIFEST).is_file():
        empty = not any(root.iterdir())
        raise SnapshotError(f"snapshot {source} is {'empty' if empty else f'missing {MANIFEST}'}")
    manifest = parse_manifest((root / MANIFEST).read_text(), source)
    files: dict[str, str] = manifest["files"]
    for rel, digest in sorted(files.items()):
        path = root / rel
        if not path.is_file():
            raise SnapshotError(f"snapshot {source}: {rel} is listed in {MANIFEST} but missing")
        if sha256_file(path) != digest:
            raise SnapshotError(f"snapshot {source}: checksum mismatch for {rel}")
    # A file the manifest does not list would be trained on unverified.
    extra = sorted(set(_data_files(root)) - set(files))
    if extra:
        raise SnapshotError(f"snapshot {source}: {len(extra)} file(s) not in {MANIFEST}, e.g. {extra[0]}")
    classes = {s: sorted({rel.split("/")[1] for rel in files if rel.startswith(s + "/")}) for s in SPLITS}
    for split, what in (("train", "training"), ("test", "evaluation")):
        if len(classes[split]) < 2:
            raise SnapshotError(f"snapshot {source}: {split}/ holds {len(classes[split])} {what} class(es); need >= 2")
    overlap = sorted(set(classes["train"]) & set(classes["test"]))
    if overlap:
        raise SnapshotError(
            f"snapshot {source}: evaluation classes overlap training classes ({', '.join(overlap[:10])}): "
            "test/ must hold only classes unseen in training"
        )
    return Snapshot(root=root.resolve(), snapshot_id=manifest["snapshot_id"], checksum=manifest["checksum"],
                    source=source, files=len(files), train_classes=tuple(classes["train"]),
                    test_classes=tuple(classes["test"]))


def cache_root() -> Path:
    """``$PROXYDML_CACHE``, default ``~/.cache/proxydml``: this node's download cache."""
    return Path(os.environ.get("PROXYDML_CACHE") or Path.home() / ".cache" / "proxydml")


def default_cache_dir() -> Path:
    """``$PROXYDML_CACHE/snapshots``, default ``~/.cache/proxydml/snapshots``."""
    return cache_root() / "snapshots"


def safe_name(text: str, limit: int = 48) -> str:
    """``text`` reduced to a file-name-safe ``[A-Za-z0-9._-]`` slug of at most ``limit`` characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "x"


def split_s3(location: str, option: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end)."""
    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    if not bucket:
        raise SnapshotError(f"{option} {location}: no bucket")
    return bucket, prefix.strip("/")


def download_folder(location: str, dest: Path, *, option: str = "--checkpoint") -> Path:
    """Copy every object under ``s3://bucket/prefix/`` into ``dest`` (a Ray checkpoint folder,
    say); the endpoint and keys come from the environment. Returns ``dest``."""
    bucket, prefix = split_s3(location, option)
    s3 = s3_client()
    found = 0
    try:
        for key in list_keys(s3, bucket, f"{prefix}/"):
            rel = key[len(prefix) + 1 :]
            if not rel or rel.endswith("/") or ".." in rel.split("/"):
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, key, str(dest / rel))
            found += 1
    except Exception as exc:  # unreachable endpoint, refused keys, no bucket: one line
        raise SnapshotError(f"{option} {location}: cannot download: {exc}") from exc
    if not found:
        raise SnapshotError(f"{option} {location}: no object under that prefix")
    return dest


def _key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


@dataclass(frozen=True)
class _Remote:
    """A manifest read from S3, checked, and what is needed to download its files."""

    location: str
    bucket: str
    prefix: str
    text: str
    manifest: dict[str, Any]
    client: Any


def _read_remote(location: str, option: str, *, snapshot: bool) -> _Remote:
    """Read and check ``location``'s manifest (one GET) before anything is downloaded."""
    bucket, prefix = split_s3(location, option)
    s3 = s3_client()
    try:
        text = s3.get_object(Bucket=bucket, Key=_key(prefix, MANIFEST))["Body"].read().decode()
    except s3.exceptions.NoSuchKey as exc:
        what = "snapshot" if snapshot else "data set"
        hint = "" if snapshot else f" (upload it with `proxydml data push FOLDER {location}`)"
        raise SnapshotError(f"{what} {location} is missing or empty (no {MANIFEST}){hint}") from exc
    except s3.exceptions.NoSuchBucket as exc:
        raise SnapshotError(f"{option} {location}: bucket {bucket!r} does not exist") from exc
    except Exception as exc:  # unreachable endpoint, refused keys: one line, not a botocore traceback
        raise SnapshotError(f"{option} {location}: cannot read {MANIFEST}: {exc}") from exc
    return _Remote(location, bucket, prefix, text, parse_manifest(text, location, snapshot=snapshot), s3)


def _fetch_file(remote: _Remote, rel: str, digest: str, dest: Path) -> bool:
    """Download one listed file into ``dest``, hashed as it streams in, unless the copy there
    already has ``digest``; a file that fails or differs never takes its place. Returns whether
    it was downloaded.

    One ``get_object`` streamed to disk rather than ``download_file``: data sets are many small
    images, and s3transfer's per-call machinery made a small object cost 25 ms against 11 ms
    (400 objects from the local server, ``tests/benchmarks/bench_s3_transfer.py``).
    """
    if dest.is_file() and sha256_file(dest) == digest:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        body = remote.client.get_object(Bucket=remote.bucket, Key=_key(remote.prefix, rel))["Body"]
        with part.open("wb") as fh:
            while chunk := body.read(_HASH_CHUNK):
                h.update(chunk)
                fh.write(chunk)
    except Exception as exc:
        part.unlink(missing_ok=True)
        raise SnapshotError(f"{remote.location}: cannot download {rel}: {exc}") from exc
    if h.hexdigest() != digest:
        part.unlink()
        raise SnapshotError(f"{remote.location}: checksum mismatch for {rel}: the object differs from "
                            f"{MANIFEST} (corrupted or replaced in the bucket; push the data again)")
    part.replace(dest)
    return True


def _in_parallel(work: Callable[[str], Any], items: list[str]) -> list[Any]:
    """``work`` over ``items`` on :data:`TRANSFER_THREADS` threads, results in order. The first
    failure in order is raised and the items not started yet are dropped."""
    pool = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="s3-transfer")
    try:
        return list(pool.map(work, items))
    finally:
        pool.shutdown(cancel_futures=True)


def _download(remote: _Remote, local: Path) -> int:
    """Download every listed file whose copy under ``local`` lacks the listed sha256 (see
    :func:`_fetch_file`), :data:`TRANSFER_THREADS` at a time. Returns the count."""
    files: dict[str, str] = remote.manifest["files"]
    fetched = _in_parallel(lambda rel: _fetch_file(remote, rel, files[rel], local / rel), sorted(files))
    (local / MANIFEST).write_text(remote.text)
    return sum(fetched)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` among the processes of this node (``flock`` on a sibling
    file): the Ray workers of one node fill a cache folder once, the others wait and reuse it.
    The kernel releases it when its holder dies, so a killed worker never leaves it held."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_snapshot(location: str, cache_dir: Path | None = None, *, option: str = "--data") -> Snapshot:
    """A verified local copy of the snapshot at ``location`` (local folder: verified in place).

    ``s3://bucket/prefix``: the manifest is read and checked first, then every file it lists
    is downloaded into ``cache_dir`` (default :func:`default_cache_dir`) unless the cached
    copy already has the listed sha256, then the copy is verified. The S3 endpoint and keys
    come from the environment or the AWS profile (:func:`services.s3.s3_client`). ``option``
    names where the location came from in error messages (``--data``, ``data.root``).
    """
    if not location:
        raise SnapshotError(f"{option} must name a snapshot folder or s3://bucket/prefix")
    if not location.startswith("s3://"):
        return verify_snapshot(Path(location.removeprefix("file://")), location)
    remote = _read_remote(location, option, snapshot=True)  # fail before downloading anything
    # Cache by content: the same snapshot always lands in the same folder, so data.root (and
    # hence a resumed Ray run) is stable across calls.
    manifest = remote.manifest
    local = (cache_dir or default_cache_dir()) / f"{safe_name(manifest['snapshot_id'])}-{manifest['checksum'][:12]}"
    with _locked(local):
        local.mkdir(parents=True, exist_ok=True)
        _download(remote, local)
        return verify_snapshot(local, location)


def dataset_cache_dir(location: str, checksum: str, cache_dir: Path | None = None) -> Path:
    """Where this node keeps the data set at ``location`` with manifest checksum ``checksum``:
    ``$PROXYDML_CACHE/data/<bucket-prefix>-<checksum>``. A re-pushed prefix (new checksum) gets
    a new folder; the same data under the same prefix is never downloaded twice."""
    return (cache_dir or cache_root() / "data") / f"{safe_name(location.removeprefix('s3://'), 80)}-{checksum[:16]}"


def fetch_dataset(location: str, cache_dir: Path | None = None, *, option: str = "data.root") -> Path:
    """The local folder holding the data set at ``s3://bucket/prefix``, downloaded once per node.

    One GET reads the manifest (its checksum names the cache folder, :func:`dataset_cache_dir`);
    a complete cached copy is then used as is. Otherwise the first process takes the folder's
    lock and downloads what is missing, each file checked against its sha256 before it lands
    (a corrupt or missing object: :class:`SnapshotError` naming the file); the node's other
    processes wait on the lock and find the copy complete. Files are hashed when they land,
    not on every later use: a cached copy is trusted while its ``.complete`` marker is there.
    """
    remote = _read_remote(location, option, snapshot=False)
    checksum = remote.manifest["checksum"]
    local = dataset_cache_dir(location, checksum, cache_dir)
    marker = local / COMPLETE
    if marker.is_file() and marker.read_text() == checksum:
        return local
    with _locked(local):
        if marker.is_file() and marker.read_text() == checksum:  # filled while we waited
            return local
        local.mkdir(parents=True, exist_ok=True)
        _download(remote, local)
        marker.write_text(checksum)
    return local


def push_dataset(folder: str | Path, location: str, dataset_id: str | None = None) -> dict[str, Any]:
    """Upload every file under ``folder`` to ``s3://bucket/prefix`` with a ``manifest.json``.

    The manifest is built in memory (nothing is written into ``folder``) and uploaded last: a
    push that stops half way leaves no manifest, so the prefix is refused rather than read
    incomplete. A ``manifest.json`` already in ``folder`` is not uploaded (it is replaced).
    Returns the manifest.
    """
    root = Path(folder)
    if not root.is_dir():
        raise SnapshotError(f"data push: {root} is not a folder")
    if not location.startswith("s3://"):
        raise SnapshotError(f"data push: the destination must be s3://bucket/prefix, got {location!r}")
    bucket, prefix = split_s3(location, "data push")
    manifest = build_manifest(root, dataset_id or root.resolve().name, dataset_files(root))
    s3 = s3_client()
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception as exc:
        raise SnapshotError(f"data push: bucket {bucket!r} is not reachable or does not exist: {exc}") from exc
    from boto3.s3.transfer import TransferConfig  # boto3: ~0.5 s of start-up that `data --help` skips

    # One transfer per thread: s3transfer's own threads would multiply with ours.
    single = TransferConfig(use_threads=False)
    _in_parallel(lambda rel: s3.upload_file(str(root / rel), bucket, _key(prefix, rel), Config=single),
                 list(manifest["files"]))
    s3.put_object(Bucket=bucket, Key=_key(prefix, MANIFEST),
                  Body=json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def install_data_resolver() -> None:
    """Let the data loaders read ``data.root=s3://bucket/prefix`` (:func:`fetch_dataset`) in this
    process: the driver's preflight and every Ray Train worker call it before building data."""
    from pipelines.data import DataError, register_root_resolver

    def resolve(location: str) -> Path:
        try:
            return fetch_dataset(location)
        except SnapshotError as exc:
            raise DataError(str(exc)) from exc

    register_root_resolver("s3", resolve)
