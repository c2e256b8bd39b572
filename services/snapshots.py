"""Data snapshots: an image folder (``train/<class>/<file>``, ``test/<class>/<file>``) with a
``manifest.json`` of sha256 sums, local or under an ``s3://bucket/prefix``.

:func:`fetch_snapshot` gives a verified local copy: a local folder is verified in place; an
S3 prefix is downloaded into a cache folder named by the snapshot's content (the same
snapshot always lands in the same folder) and verified there. Every refusal is a
:class:`SnapshotError` whose message names the snapshot and the offending file.

``manifest.json`` holds ``snapshot_id``, ``created_at``, ``files`` (path -> sha256) and
``checksum``: the sha256 of the ``sha256sum``-style listing of ``files``
(:func:`manifest_checksum`). :func:`write_manifest` writes one. Used by retraining
(``services/retrain.py``); nothing here imports Ray or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.s3 import s3_client

MANIFEST = "manifest.json"
SPLITS = ("train", "test")
_HASH_CHUNK = 1 << 20


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


def write_manifest(root: str | Path, snapshot_id: str) -> dict[str, Any]:
    """Write ``root/manifest.json`` for an image-folder snapshot and return it."""
    root = Path(root)
    if not snapshot_id:
        raise SnapshotError("a snapshot id is required")
    files = {rel: sha256_file(root / rel) for rel in _data_files(root)}
    if not files:
        raise SnapshotError(f"{root} holds no files under train/ or test/")
    manifest = {"snapshot_id": snapshot_id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files, "checksum": manifest_checksum(files)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def parse_manifest(text: str, where: str) -> dict[str, Any]:
    """Check a manifest's structure and its overall checksum against its own file list."""
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
        parts = rel.split("/")
        # Only train/<class>/<file> and test/<class>/<file>: nothing outside the snapshot.
        if len(parts) != 3 or parts[0] not in SPLITS or any(p in ("", ".", "..") for p in parts) or rel.startswith("/"):
            raise SnapshotError(f"{where}: {MANIFEST} lists {rel!r}; expected train/<class>/<file> or test/<class>/<file>")
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


def default_cache_dir() -> Path:
    """``$PROXYDML_CACHE/snapshots``, default ``~/.cache/proxydml/snapshots``."""
    return Path(os.environ.get("PROXYDML_CACHE") or Path.home() / ".cache" / "proxydml") / "snapshots"


def safe_name(text: str, limit: int = 48) -> str:
    """``text`` reduced to a file-name-safe ``[A-Za-z0-9._-]`` slug of at most ``limit`` characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "x"


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
    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise SnapshotError(f"{option} {location}: no bucket")
    s3 = s3_client()
    key = f"{prefix}/{MANIFEST}" if prefix else MANIFEST
    try:
        text = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except s3.exceptions.NoSuchKey as exc:
        raise SnapshotError(f"snapshot {location} is missing or empty (no {MANIFEST})") from exc
    except s3.exceptions.NoSuchBucket as exc:
        raise SnapshotError(f"snapshot {location}: bucket {bucket!r} does not exist") from exc
    manifest = parse_manifest(text, location)  # fail before downloading anything
    # Cache by content: the same snapshot always lands in the same folder, so data.root (and
    # hence a resumed Ray run) is stable across calls.
    local = (cache_dir or default_cache_dir()) / f"{safe_name(manifest['snapshot_id'])}-{manifest['checksum'][:12]}"
    local.mkdir(parents=True, exist_ok=True)
    for rel, digest in sorted(manifest["files"].items()):
        dest = local / rel
        if dest.is_file() and sha256_file(dest) == digest:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        try:
            s3.download_file(bucket, f"{prefix}/{rel}" if prefix else rel, str(part))
        except Exception as exc:
            raise SnapshotError(f"snapshot {location}: cannot download {rel}: {exc}") from exc
        part.replace(dest)
    (local / MANIFEST).write_text(text)
    return verify_snapshot(local, location)
