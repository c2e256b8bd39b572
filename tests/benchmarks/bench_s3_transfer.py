"""What moving a data set of small images to and from S3 costs: per-object calls, and
``proxydml data push`` / the per-node fetch (``services.snapshots``) end to end.

Runs against a local stack's S3 server (moto by default, ``--s3-server swift`` for the
durable one), on 127.0.0.1 only:

    python tests/benchmarks/bench_s3_transfer.py --files 400

Rows: ``download_file``/``get_object``/``upload_file`` one object after another, then
:func:`push_dataset` and :func:`fetch_dataset` as shipped (:data:`TRANSFER_THREADS` at a time).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from services.s3 import Credentials, s3_client
from services.snapshots import TRANSFER_THREADS, fetch_dataset, push_dataset
from services.stack import Stack

CREDS = Credentials("proxydml-bench-key", "proxydml-bench-secret")


def _timed(what: str, n: int, fn) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"| {what} | {n} | {wall:.1f} | {1000 * wall / n:.1f} | {cpu:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=400, help="objects of --size bytes each")
    parser.add_argument("--size", type=int, default=300, help="bytes per object (a digits PNG is ~300)")
    parser.add_argument("--s3-server", default="moto", choices=["moto", "swift"])
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="proxydml-s3bench-"))
    base.chmod(0o755)
    stack = Stack(base / "stack", s3_port=0, mlflow_port=0, credentials=CREDS, s3_server=args.s3_server)
    stack.up()
    try:
        os.environ.update(stack.client_env(with_credentials=True))
        s3 = s3_client()
        folder = base / "data"
        for i in range(args.files):
            path = folder / f"class{i % 10}" / f"{i:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(args.size))
        rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
        out = base / "out"
        out.mkdir()
        n = len(rels)
        print(f"{n} objects of {args.size} bytes, {args.s3_server}; {TRANSFER_THREADS} transfer threads\n")
        print("| call | objects | wall s | ms per object | client CPU-s |\n|---|---:|---:|---:|---:|")
        _timed("upload_file, one at a time", n, lambda: [
            s3.upload_file(str(folder / r), stack.bucket, f"seq/{r}") for r in rels])
        _timed("download_file, one at a time", n, lambda: [
            s3.download_file(stack.bucket, f"seq/{r}", str(out / r.replace("/", "-"))) for r in rels])
        _timed("get_object, one at a time", n, lambda: [
            (out / r.replace("/", "_")).write_bytes(s3.get_object(Bucket=stack.bucket, Key=f"seq/{r}")["Body"].read())
            for r in rels])
        location = f"s3://{stack.bucket}/pushed"
        _timed("push_dataset (proxydml data push)", n, lambda: push_dataset(folder, location, "bench"))
        os.environ["PROXYDML_CACHE"] = str(base / "cache")
        _timed("fetch_dataset (a node's first read)", n, lambda: fetch_dataset(location))
    finally:
        stack.down()


if __name__ == "__main__":
    main()
