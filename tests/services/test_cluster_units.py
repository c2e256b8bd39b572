"""Multi-node settings without a cluster: address probing, the node-local refusal, elastic
worker ranges, and data sets pushed to and fetched from S3 (an in-process moto server)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelines.config import ConfigError, load_config
from pipelines.data import build_datasets
from services import cluster, snapshots
from services.cli import main as cli_main


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


# ---------------------------------------------------------------- addresses ------------------
def test_probe_answers_at_once_for_a_dead_address_and_passes_a_live_one():
    port = _dead_port()
    started = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=rf"no Ray cluster at 127.0.0.1:{port} \(--address\)"):
        cluster.probe(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 2
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        cluster.probe(f"ray://127.0.0.1:{live.getsockname()[1]}")
    assert cluster.host_port("http://127.0.0.1:8265/jobs") == ("127.0.0.1", 8265)
    with pytest.raises(cluster.ClusterError, match="is not host:port"):
        cluster.host_port("nohost")


# ---------------------------------------------------------------- node-local state -------------
def test_node_local_settings_are_refused_only_on_several_nodes():
    local = load_config("digits", ["tracking.storage_path=/tmp/x/runs"])
    uri = "sqlite:///tmp/x/mlflow.db"
    cluster.require_shared_state(local, uri, nodes=1)  # one node: everything is shared
    with pytest.raises(ConfigError) as err:
        cluster.require_shared_state(local, uri, nodes=2)
    message = str(err.value)
    assert "\n" not in message and message.startswith("the Ray cluster has 2 nodes and ")
    assert "tracking.storage_path=/tmp/x/runs is a folder on one node" in message
    assert "tracking.tracking_uri=sqlite:///tmp/x/mlflow.db is a store on one node" in message
    assert "s3://BUCKET/PREFIX" in message and "tracking.shared_storage=true" in message
    assert "data.root" not in message  # digits is in memory

    remote = load_config("digits", ["tracking.storage_path=s3://b/runs"])
    assert cluster.node_local_settings(remote, "http://127.0.0.1:5000") == []
    assert cluster.node_local_settings(remote, "file:///tmp/mlruns")  # a file store is local
    folder = load_config(None, ["data.name=folder", "data.root=/data/x", "tracking.storage_path=s3://b/runs"])
    [problem] = cluster.node_local_settings(folder, "http://127.0.0.1:5000")
    assert problem.startswith("data.root=/data/x is a folder on one node") and "proxydml data push" in problem
    # Declared on NFS: the folders pass, a sqlite store never does (its locking is unsafe there).
    shared = load_config(None, ["data.name=folder", "data.root=/nfs/x", "tracking.storage_path=/nfs/runs",
                                "tracking.shared_storage=true"])
    assert cluster.node_local_settings(shared, "http://127.0.0.1:5000") == []
    [problem] = cluster.node_local_settings(shared, uri)
    assert problem.startswith("tracking.tracking_uri=")


# ---------------------------------------------------------------- elastic ranges --------------
def test_elastic_worker_ranges():
    cfg = load_config("digits", ["scaling.num_workers=2-4", "scaling.max_failures=1", "data.batch_size=48",
                                 "data.samples_per_class=12"])
    assert cfg.scaling.elastic and list(cfg.scaling.worker_counts()) == [2, 3, 4]
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (2, 4)
    assert cfg.flat()["scaling.num_workers"] == "2-4"
    assert cfg.run_name() == load_config("digits", ["data.batch_size=48", "data.samples_per_class=12"]).run_name()
    fixed = load_config("digits", ["scaling.num_workers=3-3", "data.batch_size=48", "data.samples_per_class=12"])
    assert fixed.scaling.num_workers == 3 and not fixed.scaling.elastic
    cases = [
        (["scaling.num_workers=2-4", "scaling.max_failures=1"],
         "data.batch_size (64) must be divisible by scaling.num_workers (2-4) (the range includes 3)"),
        (["scaling.num_workers=2-4", "data.batch_size=48", "data.samples_per_class=12"],
         "scaling.num_workers=2-4 is elastic: set scaling.max_failures >= 1"),
        (["scaling.num_workers=4-2"], "scaling.num_workers=4-2: MIN must be <= MAX"),
        (["scaling.num_workers=two"], "scaling.num_workers must be N or MIN-MAX"),
        (["scaling.num_workers=0-2", "scaling.max_failures=1"], "scaling.num_workers must be > 0, got 0"),
        (["data.root=gs://bucket/x"], "data.root: a local folder or s3://bucket/prefix"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config("digits", overrides)


# ---------------------------------------------------------------- data sets on S3 -------------
@pytest.fixture
def s3(monkeypatch, tmp_path):
    """An in-process moto S3 server with bucket ``data``; the environment points at it and the
    node's cache ($PROXYDML_CACHE) is under ``tmp_path``."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true", "PROXYDML_CACHE": str(tmp_path / "node")}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="data")
    yield client
    server.stop()


def _cub_like(root: Path) -> Path:
    """A data set in its own layout (CUB's: split files at the top, images in folders)."""
    from tests.distributed.whole_run_workers import make_image_folder

    make_image_folder(root)
    return root


def _count_downloads(monkeypatch) -> list[str]:
    """Data files (not manifests) downloaded by :mod:`services.snapshots` from now on (every thread)."""
    downloaded: list[str] = []
    lock = threading.Lock()
    real = snapshots.s3_client

    def counting_client():
        client = real()
        original = client.get_object

        def get_object(*, Bucket, Key, **kwargs):
            if not Key.endswith(f"/{snapshots.MANIFEST}"):
                with lock:
                    downloaded.append(Key)
            return original(Bucket=Bucket, Key=Key, **kwargs)

        client.get_object = get_object
        return client

    monkeypatch.setattr(snapshots, "s3_client", counting_client)
    return downloaded


def test_pushed_data_set_is_fetched_once_per_node_and_verified(s3, tmp_path, monkeypatch, capsys):
    folder = _cub_like(tmp_path / "images")
    (folder / "images.txt").write_text("a split file at the top, outside train/ and test/\n")
    assert cli_main(["data", "push", str(folder), "s3://data/sets/shapes", "--id", "shapes-v1"]) == 0
    assert "pushed: 81 files of shapes-v1 to s3://data/sets/shapes" in capsys.readouterr().out
    assert not (folder / "manifest.json").exists()  # nothing written into the user's folder

    downloaded = _count_downloads(monkeypatch)
    cache = tmp_path / "cache"
    results: list[Path] = []
    # Four workers of one node start at once: one downloads, the others wait on the lock.
    threads = [threading.Thread(target=lambda: results.append(snapshots.fetch_dataset("s3://data/sets/shapes", cache)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    local = results[0]
    assert local.parent == cache and local.name.startswith("data-sets-shapes-")
    assert sorted(downloaded) == sorted(f"sets/shapes/{rel}" for rel in snapshots.dataset_files(folder))
    assert (local / "images.txt").read_text().startswith("a split file")
    assert snapshots.fetch_dataset("s3://data/sets/shapes", cache) == local and len(downloaded) == 81

    # The loaders read it through the resolver the proxydml commands install.
    snapshots.install_data_resolver()
    monkeypatch.setenv("PROXYDML_CACHE", str(cache.parent / "node-cache"))
    split = build_datasets(load_config(None, ["data.name=folder", "data.root=s3://data/sets/shapes"]).data)
    assert split.num_classes == 6 and len(split.test) == 32


def test_corrupt_or_missing_objects_are_named_and_never_land(s3, tmp_path, capsys):
    folder = _cub_like(tmp_path / "images")
    snapshots.push_dataset(folder, "s3://data/bad")
    s3.put_object(Bucket="data", Key="bad/train/class03/5.png", Body=b"corrupted in the bucket")
    cache = tmp_path / "cache"
    with pytest.raises(snapshots.SnapshotError, match="s3://data/bad: checksum mismatch for train/class03/5.png"):
        snapshots.fetch_dataset("s3://data/bad", cache)
    [local] = [p for p in cache.iterdir() if p.is_dir()]
    assert not (local / "train/class03/5.png").exists() and not (local / snapshots.COMPLETE).exists()

    s3.put_object(Bucket="data", Key="bad/train/class03/5.png", Body=(folder / "train/class03/5.png").read_bytes())
    s3.delete_object(Bucket="data", Key="bad/train/class05/2.png")
    # A fresh cache: the first attempt's transfer threads (snapshots.TRANSFER_THREADS) may have
    # fetched and verified that file before the failure stopped them (how far they got depends on
    # the machine's load), and a verified file stays cached.
    with pytest.raises(snapshots.SnapshotError, match="s3://data/bad: cannot download train/class05/2.png"):
        snapshots.fetch_dataset("s3://data/bad", tmp_path / "cache-missing")

    # Through a command: one line naming the file, exit 2.
    argv = ["train", "data.name=folder", "data.root=s3://data/bad", f"tracking.storage_path={tmp_path / 'runs'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: s3://data/bad: cannot download train/class05/2.png") and "\n" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()

    assert cli_main(["data", "push", str(folder), "s3://nobucket/x"]) == 2
    assert "bucket 'nobucket' is not reachable or does not exist" in capsys.readouterr().err
    assert cli_main(["data", "push", str(tmp_path / "nope"), "s3://data/x"]) == 2
    assert cli_main(["data", "push", str(folder), "/local/path"]) == 2
    assert "must be s3://bucket/prefix" in capsys.readouterr().err
    assert cli_main(["train", "data.name=folder", "data.root=s3://data/absent"]) == 2
    assert "data set s3://data/absent is missing or empty (no manifest.json)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["folder", "emoji", "cub", "cars", "sop", "inshop"])
def test_every_loader_reads_its_layout_from_s3(s3, tmp_path, name):
    """data.root=s3://... for each loader: the split read through the node's cache is the
    split of the local folder (the layouts of tests/pipelines/test_data.py)."""
    from tests.distributed.whole_run_workers import make_image_folder
    from tests.pipelines import test_data as layouts

    local = tmp_path / name
    {"folder": make_image_folder, "emoji": layouts.make_emoji, "cub": layouts.make_cub, "cars": layouts.make_cars,
     "sop": layouts.make_sop, "inshop": layouts.make_inshop}[name](local)
    snapshots.push_dataset(local, f"s3://data/{name}")
    snapshots.install_data_resolver()
    want = build_datasets(layouts._cfg(name, local))
    got = build_datasets(layouts._cfg(name, f"s3://data/{name}"))
    assert (got.num_classes, len(got.train), len(got.test)) == (want.num_classes, len(want.train), len(want.test))
    assert got.query_indices == want.query_indices
    assert torch.equal(got.test[0][0], want.test[0][0])  # the same image, read from the cached copy
    assert (tmp_path / "node" / "data").is_dir()
