"""Training against the stack users get: an MLflow server on PostgreSQL with artifacts on
Swift's S3 API (over HTTP on 127.0.0.1) and Ray checkpoints in the same bucket; the stack
stopped, crashed (SIGKILL of the S3 server and the database) and moved by backup and restore,
keeping every artifact, the registered model and the checkpoint; 16 concurrent writers with
no lost metric; an MLflow outage in the middle of training; a scan of everything a run leaves
for the credentials.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import mlflow
import mlflow.pytorch
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from pipelines.checkpoint import CHECKPOINT_FILES
from pipelines.data import build_datasets
from services import registry, training
from services.cli import main as cli_main
from services.mlflow_tracking import find_run
from services.s3 import Credentials, list_keys, s3_client
from services.stack import Stack
from tests.benchmarks.bench_tracking_load import run_load

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

# Swift's S3 keys name the account: proxydml:USER.
CREDS = Credentials("proxydml:e2e", "proxydml-e2e-SECRET-do-not-leak")
PLOTS = {"plots/learning_curves.png", "plots/retrieval_grid.png", "plots/proxy_similarity.png",
         "plots/embedding_map.png"}
MODEL = "stack-e2e-digits"
METRIC_KEYS = {"recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8", "map_at_r", "r_precision",
               "precision_at_1", "loss"}
STACK_EXPERIMENT = "tracking.experiment=stack-e2e"


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(CREDS, durable=True)


def _point_at(stack: Stack, mp: pytest.MonkeyPatch) -> None:
    """The driver's environment: the S3 endpoint and keys for Ray storage and eval only."""
    mp.setenv("AWS_ENDPOINT_URL", stack.s3_endpoint)
    mp.setenv("AWS_ACCESS_KEY_ID", CREDS.access_key)
    mp.setenv("AWS_SECRET_ACCESS_KEY", CREDS.secret_key)


@pytest.fixture(scope="module")
def trained(ray_cluster, stack, digits_config):
    """A digits run with checkpoints on the stack's S3, resumed for a third epoch, and its
    model registered as the champion."""
    with pytest.MonkeyPatch.context() as mp:
        _point_at(stack, mp)
        cfg = digits_config(stack.tracking_uri, f"s3://{stack.bucket}/ray", STACK_EXPERIMENT, steps=6)
        first = training.train(cfg)
        client = MlflowClient(stack.tracking_uri)
        after_two = {k: [(m.step, m.value) for m in client.get_metric_history(first.mlflow_run_id, k)]
                     for k in ("map_at_r", "loss")}
        third_epoch = digits_config(stack.tracking_uri, f"s3://{stack.bucket}/ray", STACK_EXPERIMENT, epochs=3, steps=6)
        second = training.train(third_epoch)
        again = training.train(third_epoch)
    client = MlflowClient(stack.tracking_uri)
    registry.register_version(client, MODEL, run_id=second.mlflow_run_id, tags={}, description="stack e2e",
                              promote_it=True)
    return cfg, first, second, after_two, again


def _bucket_keys(stack: Stack) -> list[str]:
    return list_keys(s3_client(stack.s3_endpoint, CREDS), stack.bucket)


def test_run_on_the_stack_lands_in_mlflow_and_s3_and_resumes(stack, trained):
    cfg, first, second, after_two, again = trained
    assert first.checkpoint_path.startswith(f"s3://{stack.bucket}/ray/{cfg.run_name()}/checkpoint_")
    assert [step for step, _ in after_two["map_at_r"]] == [1, 2]
    assert not first.resumed and first.metrics["epoch"] == 2 and METRIC_KEYS <= set(first.metrics)
    assert first.metrics["recall_at_1"] > 0.5  # digits 5-9 unseen in training: chance R@1 ~ 0.2
    # The same run started again with one more epoch resumes from epoch 2, in the same MLflow run.
    assert second.resumed and second.mlflow_run_id == first.mlflow_run_id and second.metrics["epoch"] == 3
    # Once more with nothing left to train: the recorded result, no worker started, no model logged again.
    assert again.already_finished and not second.already_finished
    assert (again.mlflow_run_id, again.checkpoint_path) == (second.mlflow_run_id, second.checkpoint_path)
    assert again.metrics == second.metrics

    keys = _bucket_keys(stack)
    ray_ckpt = [k for k in keys if k.startswith(f"ray/{cfg.run_name()}/checkpoint_")]
    assert any(k.endswith("/model.pt") for k in ray_ckpt) and any(k.endswith("/loss.pt") for k in ray_ckpt)
    run_artifacts = [k for k in keys if first.mlflow_run_id in k]
    assert any(k.endswith("checkpoint/model.pt") for k in run_artifacts), run_artifacts
    assert any(k.endswith("plots/retrieval_grid.png") for k in run_artifacts)
    # mlflow.pytorch model files (MLflow 3 stores logged models beside the run's artifacts): one
    # per training call that trained (the resumed one logs its new weights), none for `again`.
    assert any(k.endswith("MLmodel") for k in keys)
    client = MlflowClient(stack.tracking_uri)
    assert len(registry.logged_models_of_run(client, first.mlflow_run_id)) == 2

    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["tracking.storage_path"] == f"s3://{stack.bucket}/ray"
    assert run.data.tags["ray_checkpoint_path"] == second.checkpoint_path
    assert [m.step for m in client.get_metric_history(run.info.run_id, "map_at_r")] == [1, 2, 3]
    losses = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert losses[:2] == after_two["loss"] and [s for s, _ in losses] == [1, 2, 3]  # epochs 1-2 not logged twice
    assert len(client.search_runs([run.info.experiment_id], f"tags.ray_run_name = '{cfg.run_name()}'")) == 1
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert PLOTS <= listed
    # Params, tags and the checkpoint's config: the flattened config, the run's identity.
    assert set(run.data.params) == set(cfg.flat()) and run.data.params["loss.name"] == "proxy_anchor"
    assert run.data.params["scaling.num_workers"] == "2"
    assert run.data.tags["ray_run_name"] == cfg.run_name() and run.data.tags["world_size"] == "2"
    assert run.data.tags["dataset"] == "digits" and run.data.tags["loss"] == "proxy_anchor" and run.data.tags["git_sha"]
    # cpus_per_worker left automatic: this machine's cores / 2 workers, recorded concrete, and
    # each worker computes with that many torch threads.
    cpus = max(1, (os.cpu_count() or 1) // 2)
    assert run.data.params["scaling.cpus_per_worker"] == str(float(cpus))
    assert run.data.tags["torch_threads"] == str(cpus)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"checkpoint", "config.yaml"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")} >= {
        f"checkpoint/{f}" for f in CHECKPOINT_FILES}
    with tempfile.TemporaryDirectory() as tmp:
        stored = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="config.yaml",
                                                          dst_path=tmp, tracking_uri=stack.tracking_uri))
        stored_cfg = yaml.safe_load(stored.read_text())
        state = json.loads(Path(mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id, artifact_path="checkpoint/trainer_state.json", dst_path=tmp,
            tracking_uri=stack.tracking_uri)).read_text())
    assert state["mlflow_run_id"] == first.mlflow_run_id  # a restarted worker continues this run
    assert stored_cfg["loss"]["name"] == "proxy_anchor" and stored_cfg["scaling"]["cpus_per_worker"] == cpus
    # The trained embedder is logged with mlflow.pytorch and loads back as a working model.
    mlflow.set_tracking_uri(stack.tracking_uri)
    model = mlflow.pytorch.load_model(f"runs:/{second.mlflow_run_id}/model")
    images = torch.stack([build_datasets(cfg.data).test[i][0] for i in range(3)])
    assert model(images).shape == (3, 64)
    # System metrics sampled on the rank-0 worker's node while it trained.
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)

    # Secret scan: params, tags, metric keys, every object in the bucket, the server logs.
    secret = CREDS.secret_key
    texts = [str(run.data.params), str(run.data.tags), str(list(run.data.metrics))]
    s3 = s3_client(stack.s3_endpoint, CREDS)
    for key in keys:
        body = s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
        assert secret.encode() not in body, f"credentials leaked into s3://{stack.bucket}/{key}"
    for log in Path(stack.state_dir).glob("*.log"):
        texts.append(log.read_text(errors="replace"))
    for text in texts:
        assert secret not in text


def test_report_of_the_two_worker_run_leads_with_retrieval_in_chromium(stack, trained, browser, tmp_path):
    """`proxydml report` of this 2-worker run, opened in headless Chromium: the retrieval
    metrics lead, then the loss; MLflow's system metrics sit in their own collapsed section."""
    from pipelines.evaluate import metric_names
    from services import report

    _, _, second, _, _ = trained
    out = tmp_path / "report.html"
    report.build_report([second.mlflow_run_id], out=out, tracking_uri=stack.tracking_uri, log=False)
    browser.get(out.as_uri())
    table = browser.find_element("css selector", "table.metrics")
    keys = [row.find_element("tag name", "code").text for row in table.find_elements("css selector", "tbody tr")]
    retrieval = list(metric_names())
    assert keys[: len(retrieval) + 1] == [*retrieval, "loss"], keys
    assert not any(k.startswith("system/") for k in keys), keys
    folded = browser.find_element("css selector", "details.system")
    assert folded.get_attribute("open") is None and folded.text.startswith("System metrics (")
    browser.execute_script("arguments[0].scrollIntoView()", table)
    shot = browser.get_screenshot_as_png()
    (tmp_path / "report-two-workers.png").write_bytes(shot)
    assert len(shot) > 10_000
    folded.find_element("tag name", "summary").click()
    assert "system/cpu_utilization_percentage" in folded.text


def _artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for info in client.list_artifacts(run_id, path):
        out += _artifact_paths(client, run_id, info.path) if info.is_dir else [info.path]
    return out


def _what_the_team_has(stack: Stack, run_id: str, checkpoint: str) -> dict:
    """Everything a restart must keep, as comparable values: each artifact's sha256 (downloaded
    through MLflow), each object's sha256, the champion's weights, and a re-evaluation of the
    S3 checkpoint by ``proxydml eval --checkpoint s3://...``."""
    import mlflow
    import mlflow.pytorch

    client = MlflowClient(stack.tracking_uri)
    artifacts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in _artifact_paths(client, run_id):
            local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=tmp,
                                                        tracking_uri=stack.tracking_uri)
            artifacts[path] = hashlib.sha256(Path(local).read_bytes()).hexdigest()
    s3 = s3_client(stack.s3_endpoint, CREDS)
    objects = {k: hashlib.sha256(s3.get_object(Bucket=stack.bucket, Key=k)["Body"].read()).hexdigest()
               for k in _bucket_keys(stack)}
    mlflow.set_tracking_uri(stack.tracking_uri)
    champion = mlflow.pytorch.load_model(f"models:/{MODEL}@{registry.CHAMPION}")
    weights = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes()
                                      for t in champion.state_dict().values())).hexdigest()
    # `proxydml eval --checkpoint s3://...` in this process (a new interpreter costs seconds),
    # with the endpoint and keys in the environment as a user exports them.
    env = {**stack.client_env(with_credentials=True), "AWS_ENDPOINT_URL": stack.s3_endpoint}
    printed = io.StringIO()
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(printed):
        assert cli_main(["eval", "--checkpoint", checkpoint, "--json"]) == 0
    return {"artifacts": artifacts, "objects": objects, "champion": weights,
            "eval": json.loads(printed.getvalue().strip().splitlines()[-1]), "runs": _runs(client)}


def _runs(client: MlflowClient) -> dict:
    exp = client.get_experiment_by_name("stack-e2e")
    return {r.info.run_id: (r.info.status, r.data.metrics) for r in client.search_runs([exp.experiment_id])}


def test_restart_crash_and_restore_keep_every_artifact_model_and_checkpoint(stack, trained, tmp_path):
    _, _, second, _, _ = trained
    run_id, ckpt = second.mlflow_run_id, second.checkpoint_path
    before = _what_the_team_has(stack, run_id, ckpt)
    assert len(before["artifacts"]) >= 8 and any(p.startswith("checkpoint/") for p in before["artifacts"])
    logged = MlflowClient(stack.tracking_uri).get_run(run_id).data.metrics
    for key in ("recall_at_1", "map_at_r"):
        assert before["eval"][key] == logged[key], key  # the S3 checkpoint re-evaluates to the logged score

    stack.down()
    assert all(not s.running for s in stack.status().values())
    stack.up()
    assert _what_the_team_has(stack, run_id, ckpt) == before, "stack down / up"

    stack.kill_service("s3")
    stack.kill_service("db")
    assert not stack.is_running("s3") and not stack.is_running("db")
    stack.up()
    assert _what_the_team_has(stack, run_id, ckpt) == before, "SIGKILL of S3 and the database, then up"

    manifest = stack.backup(tmp_path / "backup")
    assert set(manifest["objects"]) == set(before["objects"])
    moved = Stack(Path(stack.state_dir).parent / "moved", s3_port=0, mlflow_port=0, credentials=CREDS,
                  s3_server="swift", store="postgresql")
    try:
        moved.restore(tmp_path / "backup")
        assert _what_the_team_has(moved, run_id, ckpt) == before, "backup, then restore into a fresh state folder"
        assert registry.aliases_of(MlflowClient(moved.tracking_uri), MODEL) == \
            registry.aliases_of(MlflowClient(stack.tracking_uri), MODEL)
    finally:
        moved.down()


def test_sixteen_concurrent_writers_lose_no_metric(stack):
    result = run_load(stack.tracking_uri, clients=16, batches=20, metrics_per_batch=10, processes=2)
    assert result.errors == [] and result.failed_writes == 0
    assert result.lost_points == 0 and len(result.write_latencies) == 16 * 20


def test_mlflow_outage_during_training_loses_nothing(ray_cluster, stack, tmp_path, digits_config):
    """MLflow stops once the run is open (epoch 1 logs fail) and comes back after epoch 1."""
    cfg = digits_config(stack.tracking_uri, tmp_path / "runs", STACK_EXPERIMENT, epochs=4, steps=30)
    run_dir = tmp_path / "runs" / cfg.run_name()
    client = MlflowClient(stack.tracking_uri)
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = training.train(cfg)
        except BaseException as exc:  # surfaced by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=train)
    worker.start()
    deadline = time.monotonic() + 120

    def opened() -> bool:  # the experiment too may not exist yet when this test runs alone
        exp = client.get_experiment_by_name(cfg.experiment_name())
        return exp is not None and find_run(client, exp.experiment_id, cfg) is not None

    while not opened():
        assert time.monotonic() < deadline, "run never opened"
        time.sleep(0.2)
    stack.stop_service("mlflow")
    while not list(run_dir.glob("checkpoint_*")):  # epoch 1 finished while MLflow was down
        assert worker.is_alive() and time.monotonic() < deadline + 120, outcome
        time.sleep(0.2)
    stack.start_service("mlflow")
    worker.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")
    run_id = outcome["result"].mlflow_run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "recall_at_1", "map_at_r"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == [1, 2, 3, 4], (key, steps)
