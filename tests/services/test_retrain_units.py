"""Retraining without Ray: snapshots and manifests, config hashing, the decision, registry
aliases and their undo, the tracking-server lock, and the CLI's bad-input errors.

Everything runs on one embedded sqlite store per module (creating its schema takes seconds):
a DB-backed store, so the registry and the lock's unique experiment names behave as on a
server. Each test uses its own model name.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from services import registry, retrain, snapshots
from services.cli import main as cli_main


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from services.mlflow_tracking import local_store

    uri, _ = local_store(tmp_path_factory.mktemp("mlruns"))
    MlflowClient(uri).search_experiments()  # create the schema once, before any output capture
    return uri


@pytest.fixture
def name(request) -> str:
    """A model name unique to the test (and its parameters)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:100]


def make_snapshot(root: Path, snapshot_id: str, *, train=("0", "1", "2"), test=("7", "8", "9"),
                  per_class: int = 3, manifest: bool = True) -> Path:
    """A tiny image-folder snapshot of random 8x8 PNGs (+ manifest.json)."""
    rng = np.random.default_rng(0)
    for split, classes in (("train", train), ("test", test)):
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (8, 8), dtype=np.uint8)
                Image.fromarray(pixels, mode="L").save(root / split / cls / f"{i}.png")
    if manifest:
        snapshots.write_manifest(root, snapshot_id)
    return root


# ---------------------------------------------------------------- snapshots -------------------


def test_data_manifest_command_writes_what_retrain_verifies(tmp_path, capsys):
    from services.cli import main

    snap = make_snapshot(tmp_path / "s", "ignored", manifest=False)
    assert main(["data", "manifest", str(snap), "--id", "snap-cli"]) == 0
    assert f"{snap / snapshots.MANIFEST}: 18 files" in capsys.readouterr().out
    assert snapshots.verify_snapshot(snap).snapshot_id == "snap-cli"


def test_manifest_round_trip(tmp_path):
    snap = make_snapshot(tmp_path / "s", "snap-1")
    got = snapshots.verify_snapshot(snap)
    assert got.snapshot_id == "snap-1"
    assert got.files == 18
    assert got.train_classes == ("0", "1", "2") and got.test_classes == ("7", "8", "9")
    manifest = json.loads((snap / "manifest.json").read_text())
    assert manifest["checksum"] == snapshots.manifest_checksum(manifest["files"]) == got.checksum
    assert retrain.fetch_snapshot(str(snap)).root == snap.resolve()


@pytest.mark.parametrize("damage, message", [
    ("file", "checksum mismatch for train/0/0.png"),
    ("overall", "checksum mismatch: manifest.json says"),
    ("extra", "not in manifest.json, e.g. test/7/extra.png"),
    ("missing", "train/1/2.png is listed in manifest.json but missing"),
    ("traversal", "expected train/<class>/<file>"),
    ("json", "is not valid JSON"),
])
def test_damaged_snapshots_are_refused(tmp_path, damage, message):
    snap = make_snapshot(tmp_path / "s", "snap-1")
    manifest_path = snap / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "file":
        (snap / "train/0/0.png").write_bytes(b"not the same bytes")
    elif damage == "overall":
        manifest["checksum"] = "0" * 64
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "extra":
        (snap / "test/7/extra.png").write_bytes((snap / "test/7/0.png").read_bytes())
    elif damage == "missing":
        (snap / "train/1/2.png").unlink()
    elif damage == "traversal":
        manifest["files"]["../outside.png"] = "0" * 64
        manifest["checksum"] = snapshots.manifest_checksum(manifest["files"])
        manifest_path.write_text(json.dumps(manifest))
    else:
        manifest_path.write_text("{not json")
    with pytest.raises(snapshots.SnapshotError, match=re.escape(message)):
        snapshots.verify_snapshot(snap)


def test_missing_empty_and_overlapping_snapshots(tmp_path):
    with pytest.raises(snapshots.SnapshotError, match="does not exist"):
        snapshots.verify_snapshot(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(snapshots.SnapshotError, match="is empty"):
        snapshots.verify_snapshot(tmp_path / "empty")
    snap = make_snapshot(tmp_path / "overlap", "o", train=("0", "1", "2"), test=("2", "3"))
    with pytest.raises(snapshots.SnapshotError, match=r"evaluation classes overlap training classes \(2\)"):
        snapshots.verify_snapshot(snap)
    one = make_snapshot(tmp_path / "one", "o", test=("9",))
    with pytest.raises(snapshots.SnapshotError, match="test/ holds 1 evaluation class"):
        snapshots.verify_snapshot(one)
    # retrain's --data reports the same refusals as RetrainError (exit code 2 in the CLI).
    with pytest.raises(retrain.RetrainError, match="test/ holds 1 evaluation class"):
        retrain.fetch_snapshot(str(one))
    with pytest.raises(retrain.RetrainError, match="--data must name a snapshot folder"):
        retrain.fetch_snapshot("")


def test_s3_snapshot_is_downloaded_verified_and_cached(tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="data")
        snap = make_snapshot(tmp_path / "s", "snap-s3")
        for path in snap.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), "data", f"snaps/one/{path.relative_to(snap).as_posix()}")
        got = retrain.fetch_snapshot("s3://data/snaps/one", tmp_path / "cache")
        assert got.snapshot_id == "snap-s3" and got.files == 18 and got.source == "s3://data/snaps/one"
        assert got.root.parent == (tmp_path / "cache").resolve() and got.root.name.startswith("snap-s3-")
        assert retrain.fetch_snapshot("s3://data/snaps/one", tmp_path / "cache").root == got.root  # cached
        s3.put_object(Bucket="data", Key="snaps/one/train/2/1.png", Body=b"corrupted in the bucket")
        with pytest.raises(retrain.RetrainError, match="checksum mismatch for train/2/1.png"):
            retrain.fetch_snapshot("s3://data/snaps/one", tmp_path / "fresh-cache")
        with pytest.raises(retrain.RetrainError, match="missing or empty"):
            retrain.fetch_snapshot("s3://data/snaps/none", tmp_path / "cache")
        with pytest.raises(retrain.RetrainError, match="bucket 'nobucket' does not exist"):
            retrain.fetch_snapshot("s3://nobucket/x", tmp_path / "cache")
    finally:
        server.stop()


# ---------------------------------------------------------------- configs / decision ----------


def test_config_hash_and_run_name_ignore_where_it_runs(tmp_path):
    snap = snapshots.verify_snapshot(make_snapshot(tmp_path / "s", "2024-01-01/A"))
    base = {"train": {"epochs": 2}, "tracking": {"run_name": "old", "tracking_uri": "http://elsewhere"}}
    a = retrain.build_config(base, ["scaling.num_workers=1"], snap, model="m", tracking_uri="sqlite:///x.db")
    b = retrain.build_config(base, ["scaling.num_workers=4", "data.batch_size=64"], snap, model="m",
                             tracking_uri="sqlite:///y.db")
    assert a.data.name == "folder" and a.data.root == str(snap.root)
    assert a.tracking.tracking_uri == "sqlite:///x.db" and a.tracking.experiment == "proxydml-retrain-m"
    assert retrain.config_hash(a) == retrain.config_hash(b)
    assert a.run_name() == b.run_name() == f"retrain-m-2024-01-01-A-{retrain.config_hash(a)}"
    c = retrain.build_config(base, ["train.epochs=3"], snap, model="m", tracking_uri="sqlite:///x.db")
    assert retrain.config_hash(c) != retrain.config_hash(a)  # epochs make another candidate
    # A sweep's best config chosen on held-out seen classes trains on all of them and is
    # judged on the snapshot's evaluation classes, like every other candidate and the champion.
    swept = retrain.build_config({**base, "data": {"val_classes": 50}}, [], snap, model="m",
                                 tracking_uri="sqlite:///x.db")
    assert swept.data.val_classes == 0 and "data.val_classes=0" in retrain.snapshot_overrides(snap)


def test_decide():
    assert retrain.decide(0.5, None, 0.005, "map_at_r", None) == (True, "no champion yet")
    ok, why = retrain.decide(0.51, 0.50, 0.005, "map_at_r", "1")
    assert ok and "+0.0100 >= margin 0.005" in why
    ok, why = retrain.decide(0.503, 0.50, 0.005, "map_at_r", "1")
    assert not ok and "< margin" in why
    assert not retrain.decide(float("nan"), 0.1, 0.0, "map_at_r", "1")[0]


# ---------------------------------------------------------------- registry --------------------


def _runs(client: MlflowClient, n: int, name: str) -> list[str]:
    exp = client.create_experiment(f"units-{name}")
    return [client.create_run(exp).info.run_id for _ in range(n)]


def test_register_promote_and_rollback(store, name):
    client = MlflowClient(store)
    r1, r2, r3 = _runs(client, 3, name)
    reg = registry.register_version(client, name, run_id=r1, tags={"decision": "promoted"},
                                    description="", promote_it=True)
    assert str(reg.version.version) == "1" and registry.aliases_of(client, name) == {"champion": "1"}
    registry.register_version(client, name, run_id=r2, tags={}, description="", promote_it=False)
    assert registry.aliases_of(client, name) == {"champion": "1"}
    registry.register_version(client, name, run_id=r3, tags={}, description="", promote_it=True)
    assert registry.aliases_of(client, name) == {"champion": "3", "previous-champion": "1"}
    assert registry.rollback(client, name) == ("3", "1")
    assert registry.aliases_of(client, name) == {"champion": "1", "previous-champion": "3"}
    assert registry.rollback(client, name, to="2") == ("1", "2")
    with pytest.raises(registry.RegistryError, match="already the champion"):
        registry.rollback(client, name, to="2")
    with pytest.raises(registry.RegistryError, match="no registered model named 'nope'"):
        registry.rollback(client, "nope")


def test_models_cli(store, name, capsys):
    client = MlflowClient(store)
    r1, r2, _ = _runs(client, 3, name)
    registry.register_version(client, name, run_id=r1, tags={"decision": "promoted", "metric": "map_at_r",
                              "candidate.map_at_r": "0.5", "snapshot_id": "s1"}, description="", promote_it=True)
    registry.register_version(client, name, run_id=r2, tags={"decision": "kept-champion"}, description="",
                              promote_it=False)
    code, out, _ = _cli(capsys, "models", "list", "--tracking-uri", store)
    assert code == 0 and name in out
    code, out, _ = _cli(capsys, "models", "list", name, "--tracking-uri", store)
    assert code == 0 and "map_at_r=0.5000" in out and "kept-champion" in out
    code, out, _ = _cli(capsys, "models", "show", name, "--tracking-uri", store)
    assert code == 0 and "version 1 (champion)" in out and "snapshot_id" in out
    code, _, err = _cli(capsys, "models", "show", name, "--alias", "previous-champion", "--tracking-uri", store)
    assert code == 2 and "has no alias 'previous-champion'" in err


@pytest.mark.parametrize("fail_at", ["create_version", "created", "promote", "promoted"])
def test_failed_registration_leaves_nothing_half_done(store, name, fail_at):
    client = MlflowClient(store)
    r1, r2, r3 = _runs(client, 3, name)

    def boom(step: str) -> None:
        if step == fail_at:
            raise ConnectionError(f"registry went away at {step}")

    # First model version ever: the registered model itself is removed again.
    with pytest.raises(ConnectionError):
        registry.register_version(client, name + "-fresh", run_id=r1, tags={}, description="", promote_it=True, hook=boom)
    assert registry.get_model(client, name + "-fresh") is None
    # With history: the new version is deleted and both aliases are back.
    registry.register_version(client, name, run_id=r1, tags={}, description="", promote_it=True)
    registry.register_version(client, name, run_id=r2, tags={}, description="", promote_it=True)
    before = registry.aliases_of(client, name)
    with pytest.raises(ConnectionError):
        registry.register_version(client, name, run_id=r3, tags={}, description="", promote_it=True, hook=boom)
    assert [str(v.version) for v in registry.versions(client, name)] == ["2", "1"]
    assert registry.aliases_of(client, name) == before == {"champion": "2", "previous-champion": "1"}


def test_promote_restores_the_first_alias_when_the_second_fails(store, name, monkeypatch):
    client = MlflowClient(store)
    r1, r2, r3 = _runs(client, 3, name)
    for run in (r1, r2):
        registry.register_version(client, name, run_id=run, tags={}, description="", promote_it=True)
    registry.register_version(client, name, run_id=r3, tags={}, description="", promote_it=False)
    real = client.set_registered_model_alias

    def flaky(name, alias, version):
        if alias == "champion" and version == "3":
            raise ConnectionError("lost the server between the two aliases")
        return real(name, alias, version)

    monkeypatch.setattr(client, "set_registered_model_alias", flaky)
    with pytest.raises(ConnectionError):
        registry.promote(client, name, "3")
    assert registry.aliases_of(client, name) == {"champion": "2", "previous-champion": "1"}


def test_proposed_candidate_is_served_only_by_promote(store, name, capsys, monkeypatch):
    client = MlflowClient(store)
    r1, r2, _ = _runs(client, 3, name)
    client.log_metric(r2, "map_at_r", 0.625)
    client.set_terminated(r2)
    registry.register_version(client, name, run_id=r1, tags={}, description="", promote_it=True)
    code, out, err = _cli(capsys, "models", "propose", name, "--run", r2, "--tracking-uri", store)
    assert code == 0 and f"proposed as v1 of {name}.candidates" in out, err
    [candidate] = registry.versions(client, registry.candidates_of(name))
    assert candidate.run_id == r2 and candidate.tags["candidate.map_at_r"] == "0.625000"
    assert registry.aliases_of(client, name) == {"champion": "1"} and len(registry.versions(client, name)) == 1
    # Bad input: one line, exit 2, nothing registered.
    for argv, message in ((("--run", r1), "is RUNNING, not FINISHED"), (("--run", "0" * 32), "no such MLflow run")):
        code, _, err = _cli(capsys, "models", "propose", name, *argv, "--tracking-uri", store)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _cli(capsys, "models", "promote", name, "--candidate", "7", "--tracking-uri", store)
    assert code == 2 and f"model '{name}.candidates' has no version 7" in err
    assert len(registry.versions(client, registry.candidates_of(name))) == 1
    # A failed alias move deletes the copy again: the served model is as before.
    real = client.set_registered_model_alias

    def flaky(model, alias, version):
        if alias == "champion":
            raise ConnectionError("lost the server during the alias move")
        return real(model, alias, version)

    monkeypatch.setattr(client, "set_registered_model_alias", flaky)
    with pytest.raises(ConnectionError):
        registry.promote_candidate(client, name, "1")
    assert [str(v.version) for v in registry.versions(client, name)] == ["1"]
    assert registry.aliases_of(client, name) == {"champion": "1"}
    monkeypatch.undo()
    code, out, err = _cli(capsys, "models", "promote", name, "--candidate", "1", "--tracking-uri", store)
    assert code == 0 and "now v3, the champion (previous-champion = v1)" in out, err
    served = client.get_model_version(name, "3")
    assert served.run_id == r2 and served.tags["promoted_from"] == f"{name}.candidates/1"
    assert served.tags["candidate.map_at_r"] == "0.625000"
    assert registry.aliases_of(client, name) == {"champion": "3", "previous-champion": "1"}


# ---------------------------------------------------------------- lock ------------------------


def test_lock_is_exclusive_releasable_and_expires(store, name):
    client = MlflowClient(store)
    now = [1000.0]
    first = registry.TrackingLock(client, name, ttl_s=60, heartbeat_s=0, clock=lambda: now[0]).acquire()
    second = registry.TrackingLock(client, name, ttl_s=60, heartbeat_s=0, clock=lambda: now[0])
    with pytest.raises(registry.LockHeld, match=r"held by .*:\d+ since .* expires"):
        second.acquire()
    assert registry.current_lock(client, name)["token"] == first.token
    first.release()
    assert registry.current_lock(client, name) is None
    second.acquire()  # free again
    # The holder crashes (no renewal); after the TTL a newcomer breaks the lock ...
    now[0] += 61
    third = registry.TrackingLock(client, name, ttl_s=60, heartbeat_s=0, clock=lambda: now[0]).acquire()
    assert registry.current_lock(client, name)["token"] == third.token
    # ... and the displaced holder finds out before it registers anything.
    with pytest.raises(registry.LockHeld, match="lost"):
        second.verify()
    second.release()  # not ours any more: must not free the newcomer's lock
    assert registry.current_lock(client, name)["token"] == third.token
    third.release()


def test_lock_renewal_keeps_it(store, name):
    client = MlflowClient(store)
    now = [0.0]
    holder = registry.TrackingLock(client, name, ttl_s=60, heartbeat_s=0, clock=lambda: now[0]).acquire()
    now[0] += 50
    holder.renew()
    now[0] += 50  # 100 s after acquiring, 50 s after renewing: still valid
    with pytest.raises(registry.LockHeld):
        registry.TrackingLock(client, name, ttl_s=60, heartbeat_s=0, clock=lambda: now[0]).acquire()
    holder.verify()
    holder.release()


def test_lock_of_a_dead_process_on_this_host_is_broken_at_once(store, name):
    import subprocess

    client = MlflowClient(store)
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid no longer exists
    crashed = registry.TrackingLock(client, name, ttl_s=3600, heartbeat_s=0)
    crashed.owner = f"{crashed.owner.rsplit(':', 1)[0]}:{dead.pid}"
    crashed.acquire()
    # A live owner (this very process, as another lock object) is respected ...
    alive = registry.TrackingLock(client, name + "-b", ttl_s=3600, heartbeat_s=0).acquire()
    with pytest.raises(registry.LockHeld):
        registry.TrackingLock(client, name + "-b", ttl_s=3600, heartbeat_s=0).acquire()
    alive.release()
    # ... a dead one is not, long before its TTL.
    resumed = registry.TrackingLock(client, name, ttl_s=3600, heartbeat_s=0).acquire()
    assert registry.current_lock(client, name)["token"] == resumed.token
    resumed.release()


def test_concurrent_acquirers_one_wins(store, name):
    client_uri = store
    MlflowClient(client_uri).search_experiments()  # create the schema before the race
    barrier = threading.Barrier(4)
    results: list[str] = []

    def contend() -> None:
        lock = registry.TrackingLock(MlflowClient(client_uri), name, ttl_s=60, heartbeat_s=0)
        barrier.wait()
        try:
            lock.acquire()
            results.append("won")
        except registry.LockHeld:
            results.append("held")
        except Exception as exc:  # sqlite may answer "database is locked" under contention
            results.append(f"error {exc}")

    threads = [threading.Thread(target=contend) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("won") == 1, results


# ---------------------------------------------------------------- CLI bad input ---------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr stripped) of one in-process CLI call."""
    capsys.readouterr()  # drop what came before (e.g. MLflow creating the sqlite schema)
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def test_cli_bad_input_fails_cleanly_and_registers_nothing(store, name, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    good = make_snapshot(tmp_path / "good", "good")
    bad_sum = make_snapshot(tmp_path / "bad", "bad")
    (bad_sum / "test/8/1.png").write_bytes(b"tampered")
    overlap = make_snapshot(tmp_path / "overlap", "ov", train=("0", "1", "5"), test=("5", "6"))
    (tmp_path / "empty").mkdir()
    cases = [
        (["--data", str(tmp_path / "missing"), "--config", "digits"], "does not exist"),
        (["--data", str(tmp_path / "empty"), "--config", "digits"], "is empty"),
        (["--data", str(bad_sum), "--config", "digits"], "checksum mismatch for test/8/1.png"),
        (["--data", str(overlap), "--config", "digits"], "evaluation classes overlap training classes (5)"),
        (["--data", str(good), "--from-champion"], f"no registered model named '{name}'"),
        (["--data", str(good)], "not registered yet"),
        (["--data", str(good), "--config", "digits", "--metric", "accuracy"], "not a reported retrieval metric"),
        (["--data", str(good), "--config", "digits", "optim.lr=-1"], "optim.lr must be > 0"),
        (["--data", str(good), "--config", "nope"], "config file 'nope' not found"),
    ]
    for args, message in cases:
        code, _, err = _cli(capsys, "retrain", "--model", name, *args)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and message in err and "\n" not in err, (args, err)
    code, _, err = _cli(capsys, "retrain", "--model", "bad name!", "--data", str(good), "--config", "digits")
    assert code == 2 and "model name" in err
    code, _, err = _cli(capsys, "models", "rollback", name)
    assert code == 2 and "no registered model" in err
    client = MlflowClient(store)
    assert registry.get_model(client, name) is None
    assert registry.current_lock(client, name) is None


def test_cli_lock_held_exits_75(store, name, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    good = make_snapshot(tmp_path / "good", "good")
    holder = registry.TrackingLock(MlflowClient(store), name, ttl_s=600, heartbeat_s=0).acquire()
    try:
        code, _, err = _cli(capsys, "retrain", "--model", name, "--data", str(good), "--config", "digits",
                         "data.batch_size=6", "data.samples_per_class=2", "scaling.num_workers=1")
    finally:
        holder.release()
    assert code == retrain.EXIT_LOCKED == 75
    assert err.startswith(f"error: another retrain of model '{name}' is running: lock proxydml-lock/retrain/{name} held by")


def test_submit_needs_a_command(capsys):
    assert cli_main(["submit"]) == 2
    assert "nothing to submit" in capsys.readouterr().err
    assert cli_main(["submit", "--env", "NOEQUALS", "--", "true"]) == 2
