"""Scheduled retraining against a real MLflow server (DB-backed registry, artifacts on a local
S3-compatible server) and the shared Ray cluster.

One scenario, in order (each step's wall time is printed with ``-s``):

1. retrain on snapshot A (digits 0-4 for training, a fixed 5-9 evaluation split) -> version 1,
   champion (there was none), its exact index of the evaluation images built and ``serving``;
2. retrain on snapshot B (more training data) with a deliberately bad config (tiny lr, one
   step) -> version 2 registered, version 1 stays champion. Meanwhile a second
   ``proxydml retrain`` of the same model (a subprocess) finds the lock and exits 75;
3. retrain on B with a good config; the first call crashes after training (nothing is
   registered), the second resumes the same run -> version 3 takes over,
   ``previous-champion`` = 1, but its index build fails midway: ``serving`` stays on 1 and
   nothing of the index is published; ``index build --serve`` then moves ``serving`` to 3 and
   ``proxydml search`` answers from version 3;
4. ``proxydml models rollback`` -> champion 1 again, and ``serving`` with it;
5. the same call as 3, and the same snapshot read from S3 -> nothing retrained, fast;
6. ``models:/NAME@champion`` loads with mlflow and embeds the evaluation images.

Then: ``proxydml submit`` runs commands as Ray Jobs on the running cluster (exit codes
mirrored), and bad input against the server registers nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from services import index as index_mod
from services import registry, retrain
from services.cli import main as cli_main
from services.snapshots import push_dataset, write_manifest
from services.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "digits-embedder"
# Tiny trainings: 2 workers, a few steps (Ray actor start-up dominates on 2 cores anyway).
COMMON = ["data.batch_size=64", "data.samples_per_class=16", "data.random_flip=false",
          "scaling.num_workers=2", "model.embedding_dim=32"]
FIRST = ["train.epochs=1", "train.max_steps_per_epoch=6"]
WORSE = ["train.epochs=1", "train.max_steps_per_epoch=1", "optim.lr=1e-7", "optim.proxy_lr_multiplier=1"]
BETTER = ["train.epochs=2", "train.max_steps_per_epoch=30", "optim.lr=3e-3"]


def write_digits_snapshot(root: Path, snapshot_id: str, train_per_class: int, test_per_class: int = 80) -> Path:
    """scikit-learn digits as PNGs: train/0..4 (``train_per_class`` each), test/5..9 (fixed)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    counts: dict[int, int] = {}
    for image, label in zip(digits.images, digits.target):
        label = int(label)
        split, limit = ("train", train_per_class) if label < 5 else ("test", test_per_class)
        n = counts.get(label, 0)
        if n >= limit:
            continue
        counts[label] = n + 1
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 15.9).astype(np.uint8), mode="L").save(folder / f"{n:04d}.png")
    write_manifest(root, snapshot_id)
    return root


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    base = tmp_path_factory.mktemp("snapshots")
    return {"A": write_digits_snapshot(base / "A", "digits-2024-01-A", train_per_class=40),
            "B": write_digits_snapshot(base / "B", "digits-2024-02-B", train_per_class=170)}


def _args(stack: Stack, snapshot: Path | str, storage: Path, *extra: str) -> list[str]:
    return ["retrain", "--model", MODEL, "--data", str(snapshot), "--tracking-uri", stack.tracking_uri,
            "--config", "digits", *COMMON, f"tracking.storage_path={storage}", *extra]


def _cli(capsys, argv: list[str]) -> tuple[int, str, str, float]:
    capsys.readouterr()
    t0 = time.monotonic()
    code = cli_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err, time.monotonic() - t0


def _aliases(client: MlflowClient) -> dict[str, str]:
    return registry.aliases_of(client, MODEL)


def _contender(stack: Stack, argv: list[str], result: dict) -> None:
    """Wait for the lock to be taken, then run the same retrain as a second process."""
    client = MlflowClient(stack.tracking_uri)
    deadline = time.monotonic() + 180
    while registry.current_lock(client, MODEL) is None:
        if time.monotonic() > deadline:
            result["error"] = "the lock never appeared"
            return
        time.sleep(0.3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    result.update(code=proc.returncode, err=proc.stderr, out=proc.stdout, seconds=time.monotonic() - t0,
                  lock_still_held=registry.current_lock(client, MODEL) is not None)


def test_retrain_promotes_only_better_models(ray_cluster, stack, snapshots, tmp_path, capsys, monkeypatch):
    client = MlflowClient(stack.tracking_uri)
    storage = tmp_path / "runs"
    timings: dict[str, float] = {}
    decisions: list[str] = []  # printed at the end (visible with -s)

    # 1. First version: champion because there is none.
    code, out, err, timings["A first"] = _cli(capsys, _args(stack, snapshots["A"], storage, *FIRST))
    assert code == 0, err
    assert "decision: PROMOTED to champion -- no champion yet" in out
    assert "index: v1 Flat, ANN recall@10 1.0000; serving -> v1" in out, out
    decisions.append(out)
    assert _aliases(client) == {"champion": "1", "serving": "1"}
    v1 = client.get_model_version(MODEL, "1")
    assert v1.tags["gallery_images"] == "400" and v1.tags["index_uri"] == f"runs:/{v1.tags['index_run_id']}/index"
    assert v1.tags["snapshot_id"] == "digits-2024-01-A" and v1.tags["decision"] == "promoted"
    for key in ("config_hash", "git_sha", "code_version", "snapshot_checksum", "candidate.map_at_r", "retrain_key"):
        assert v1.tags.get(key), key
    assert v1.run_id and client.get_run(v1.run_id).info.status == "FINISHED"
    # The registered model carries its config (the run's config.yaml) and metrics.
    assert {a.path for a in client.list_artifacts(v1.run_id)} >= {"config.yaml", "checkpoint"}
    assert "map_at_r" in client.get_run(v1.run_id).data.metrics

    # 2. A worse candidate on B is registered but not promoted; a concurrent retrain is refused.
    contender: dict = {}
    worse_args = _args(stack, snapshots["B"], storage, *WORSE)
    watcher = threading.Thread(target=_contender, args=(stack, worse_args, contender))
    watcher.start()
    code, out, err, timings["B worse (+ concurrent contender)"] = _cli(capsys, worse_args)
    watcher.join(timeout=300)
    assert code == 0, err
    assert "decision: NOT promoted: champion kept" in out, out
    decisions.append(out)
    assert _aliases(client) == {"champion": "1", "serving": "1"}
    v2 = client.get_model_version(MODEL, "2")
    assert v2.tags["decision"] == "kept-champion" and v2.tags["champion_version"] == "1"
    assert float(v2.tags["candidate.map_at_r"]) < float(v2.tags["champion.map_at_r"]) + 0.005
    assert "error" not in contender, contender
    assert contender["code"] == retrain.EXIT_LOCKED, contender
    assert contender["err"].strip().splitlines()[-1].startswith(
        f"error: another retrain of model '{MODEL}' is running: lock proxydml-lock/retrain/{MODEL} held by")
    assert contender["lock_still_held"], "the contender must not have released the holder's lock"
    assert registry.current_lock(client, MODEL) is None  # released by the holder at the end
    timings["contender (subprocess)"] = contender["seconds"]

    # 3. A better candidate. The first call "crashes" after training (in evaluation): nothing
    # is registered and the lock is freed; the next call resumes the same Ray and MLflow run.
    better_args = _args(stack, snapshots["B"], storage, *BETTER)
    real_evaluate = retrain.evaluate_split

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash after training")

    monkeypatch.setattr(retrain, "evaluate_split", crash)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="simulated crash"):
        cli_main(better_args)
    timings["B better (crashes)"] = time.monotonic() - t0
    monkeypatch.setattr(retrain, "evaluate_split", real_evaluate)
    assert [str(v.version) for v in registry.versions(client, MODEL)] == ["2", "1"]
    assert registry.current_lock(client, MODEL) is None
    crashed = capsys.readouterr().out
    crashed_run = crashed.split("trained: run ")[1].split()[0]
    # ...and the new champion's index build fails midway (the gallery became unreadable).
    real_build = index_mod.build
    unreadable = snapshots["B"] / "test" / "5" / "0003.png"

    def failing_build(req, *, log=print, hook=None):
        def midway(step: str) -> None:
            if step == "embedded-batch":
                raise OSError(f"cannot read image {unreadable}: Permission denied")
        return real_build(req, log=log, hook=midway)

    monkeypatch.setattr(index_mod, "build", failing_build)
    code, out, err, timings["B better (resumed, index fails)"] = _cli(capsys, better_args)
    monkeypatch.setattr(index_mod, "build", real_build)
    assert code == 0, err
    assert f"trained: run {crashed_run} (resumed)" in out, out
    # Its training had finished: the recorded result is used, not retrained, and its model not logged again.
    assert len(registry.logged_models_of_run(client, crashed_run)) == 1
    assert "decision: PROMOTED to champion" in out, out
    assert f"index: build failed, serving stays on v1: cannot read image {unreadable}" in out, out
    decisions.append(out)
    assert _aliases(client) == {"champion": "3", "previous-champion": "1", "serving": "1"}
    v3 = client.get_model_version(MODEL, "3")
    assert float(v3.tags["candidate.map_at_r"]) >= float(v3.tags["champion.map_at_r"]) + 0.005
    assert not set(index_mod.INDEX_TAGS) & set(v3.tags)  # nothing half-published
    index_runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                    filter_string=f"tags.registered_model = '{MODEL}/3' and tags.kind = 'index'")
    assert [r.info.status for r in index_runs] in ([], ["FAILED"])
    # The index built by hand: serving moves to the champion, and search answers from it.
    code, out, err, timings["index build v3"] = _cli(capsys, ["index", "build", "--model", MODEL, "--gallery",
                                                              "unseen", "--serve", "--tracking-uri", stack.tracking_uri])
    assert code == 0, err
    assert _aliases(client)["serving"] == "3"
    query = sorted((snapshots["B"] / "test" / "7").glob("*.png"))[0]
    code, out, err, _ = _cli(capsys, ["search", "--model", MODEL, "--json", "-k", "3", str(query),
                                      "--tracking-uri", stack.tracking_uri])
    assert code == 0, err
    answer = json.loads(out)
    assert answer["version"] == "3" and answer["results"][0]["hits"][0]["path"] == str(query)

    # 4. Rollback restores version 1 (and keeps 3 as the way back).
    code, out, err, _ = _cli(capsys, ["models", "rollback", MODEL, "--tracking-uri", stack.tracking_uri])
    assert code == 0, err
    assert "champion v3 -> v1" in out and "serving = v1" in out
    assert _aliases(client) == {"champion": "1", "previous-champion": "3", "serving": "1"}
    code, out, err, _ = _cli(capsys, ["models", "list", MODEL, "--tracking-uri", stack.tracking_uri])
    assert code == 0 and "kept-champion" in out and "digits-2024-02-B" in out
    code, out, err, _ = _cli(capsys, ["models", "show", MODEL, "--config", "--tracking-uri", stack.tracking_uri])
    assert code == 0 and "version 1 (champion, serving)" in out and "snapshot_id" in out and "loss:" in out

    # 5. The same call again does not retrain: same run name -> the registered result.
    exp_id = client.get_experiment_by_name(f"proxydml-retrain-{MODEL}").experiment_id
    runs_before = len(client.search_runs([exp_id]))
    code, out, err, timings["repeat (local)"] = _cli(capsys, better_args)
    assert code == 0, err
    assert out.startswith("snapshot digits-2024-02-B") and "already done: model digits-embedder version 3" in out
    assert "nothing retrained" in out
    # The same snapshot from S3 (downloaded and verified into a cache): the same key.
    monkeypatch.setenv("AWS_ENDPOINT_URL", stack.s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.credentials.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.credentials.secret_key)
    # Uploaded as `proxydml data push` does, under the snapshot's own id: the same files, so the
    # same manifest checksum and retrain key.
    pushed = push_dataset(snapshots["B"], f"s3://{stack.bucket}/snapshots/B", "digits-2024-02-B")
    assert pushed["checksum"] == json.loads((snapshots["B"] / "manifest.json").read_text())["checksum"]
    monkeypatch.setenv("PROXYDML_CACHE", str(tmp_path / "cache"))
    code, out, err, timings["repeat (from S3)"] = _cli(
        capsys, _args(stack, f"s3://{stack.bucket}/snapshots/B", storage, *BETTER))
    assert code == 0, err
    assert "already done: model digits-embedder version 3" in out
    assert list((tmp_path / "cache" / "snapshots").glob("digits-2024-02-B-*/test/5/*.png"))
    assert len(client.search_runs([exp_id])) == runs_before
    assert [str(v.version) for v in registry.versions(client, MODEL)] == ["3", "2", "1"]
    assert timings["repeat (local)"] < 30 and timings["repeat (from S3)"] < 60, timings

    # 6. The champion loads with plain MLflow and embeds images.
    import mlflow.pytorch
    import torch

    from pipelines.evaluate import retrieval_metrics

    model = mlflow.pytorch.load_model(f"models:/{MODEL}@champion")
    files = sorted((snapshots["B"] / "test").glob("*/*.png"))
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB"), dtype=np.float32) / 255.0)
                          .permute(2, 0, 1) for f in files])
    labels = torch.tensor([int(f.parent.name) for f in files])
    with torch.no_grad():
        emb = model(images)
    assert emb.shape == (len(files), 32) and torch.isfinite(emb).all()
    metrics = retrieval_metrics(emb, labels, recall_ks=(1,))
    assert metrics["precision_at_1"] > 0.4  # 5 unseen classes: chance is ~0.2
    assert abs(metrics["map_at_r"] - float(v1.tags["candidate.map_at_r"])) < 1e-3  # the registered weights

    print("\n" + "\n".join(line for out in decisions for line in out.splitlines()
                           if line.startswith(("model ", "  candidate", "decision"))))
    print("retrain e2e timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


def test_submit_runs_commands_as_ray_jobs(ray_cluster, stack, capsys):
    import ray

    dashboard = "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]
    assert dashboard.startswith("http://127.0.0.1:")
    t0 = time.monotonic()
    code, out, err, _ = _cli(capsys, ["submit", "--address", dashboard, "--env", f"PYTHONPATH={ROOT}", "--",
                                      sys.executable, "-m", "services.cli", "models", "list",
                                      "--tracking-uri", stack.tracking_uri])
    assert code == 0, (out, err)
    assert "ended: SUCCEEDED" in out and (MODEL in out or "no registered models" in out)
    code, out, err, _ = _cli(capsys, ["submit", "--address", dashboard, "--", sys.executable, "-c",
                                      "import sys; print('from the job'); sys.exit(3)"])
    assert code == 3, (out, err)
    assert "from the job" in out and "ended: FAILED (exit code 3)" in out
    print(f"\nsubmit: 2 jobs in {time.monotonic() - t0:.1f}s")


def test_bad_input_against_the_server_registers_nothing(stack, snapshots, tmp_path, capsys):
    client = MlflowClient(stack.tracking_uri)
    before = {m.name for m in client.search_registered_models()}
    code, _, err, _ = _cli(capsys, ["retrain", "--model", "never-registered", "--data", str(snapshots["A"]),
                                    "--from-champion", "--tracking-uri", stack.tracking_uri])
    assert code == 2 and err.strip().startswith("error: no registered model named 'never-registered'")
    assert "\n" not in err.strip()
    tampered = tmp_path / "tampered"
    write_digits_snapshot(tampered, "t", train_per_class=20, test_per_class=10)
    (tampered / "train" / "0" / "0000.png").write_bytes(b"changed after the manifest was written")
    code, _, err, _ = _cli(capsys, ["retrain", "--model", "never-registered", "--data", str(tampered),
                                    "--config", "digits", "--tracking-uri", stack.tracking_uri])
    assert code == 2 and "checksum mismatch for train/0/0000.png" in err
    assert {m.name for m in client.search_registered_models()} == before
    assert registry.current_lock(client, "never-registered") is None
