"""Training against the real stack: an MLflow server with artifacts on an S3-compatible server
(moto, over HTTP on 127.0.0.1) and Ray checkpoints in the same bucket; an MLflow outage in the
middle of training; a scan of everything a run leaves for the credentials.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from services import training
from services.mlflow_tracking import find_run
from services.s3 import Credentials, s3_client
from services.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

CREDS = Credentials("proxydml-e2e-key", "proxydml-e2e-SECRET-do-not-leak")
PLOTS = {"plots/learning_curves.png", "plots/retrieval_grid.png", "plots/proxy_similarity.png",
         "plots/embedding_map.png"}


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(CREDS)


@pytest.fixture
def s3_env(stack, monkeypatch):
    """The driver's environment: the S3 endpoint and keys for Ray storage only."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", stack.s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDS.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDS.secret_key)
    return stack


STACK_EXPERIMENT = "tracking.experiment=stack-e2e"


def _bucket_keys(stack: Stack) -> list[str]:
    s3 = s3_client(stack.s3_endpoint, CREDS)
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def test_run_on_the_stack_lands_in_mlflow_and_s3_and_resumes(ray_cluster, s3_env, tmp_path, digits_config):
    stack = s3_env
    cfg = digits_config(stack.tracking_uri, f"s3://{stack.bucket}/ray", STACK_EXPERIMENT, steps=4)
    first = training.train(cfg)
    assert first.checkpoint_path.startswith(f"s3://{stack.bucket}/ray/{cfg.run_name()}/checkpoint_")

    keys = _bucket_keys(stack)
    ray_ckpt = [k for k in keys if k.startswith(f"ray/{cfg.run_name()}/checkpoint_")]
    assert any(k.endswith("/model.pt") for k in ray_ckpt) and any(k.endswith("/loss.pt") for k in ray_ckpt)
    run_artifacts = [k for k in keys if first.mlflow_run_id in k]
    assert any(k.endswith("checkpoint/model.pt") for k in run_artifacts), run_artifacts
    assert any(k.endswith("plots/retrieval_grid.png") for k in run_artifacts)
    # mlflow.pytorch model files (MLflow 3 stores logged models beside the run's artifacts).
    assert any(k.endswith("MLmodel") for k in keys)

    client = MlflowClient(stack.tracking_uri)
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["tracking.storage_path"] == f"s3://{stack.bucket}/ray"
    assert run.data.tags["ray_checkpoint_path"] == first.checkpoint_path
    assert [m.step for m in client.get_metric_history(run.info.run_id, "map_at_r")] == [1, 2]
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert PLOTS <= listed

    second = training.train(digits_config(stack.tracking_uri, f"s3://{stack.bucket}/ray", STACK_EXPERIMENT,
                                               epochs=3, steps=4))
    assert second.resumed and second.mlflow_run_id == first.mlflow_run_id
    assert [m.step for m in client.get_metric_history(run.info.run_id, "map_at_r")] == [1, 2, 3]

    # Secret scan: params, tags, metric keys, every object in the bucket, the server logs.
    secret = CREDS.secret_key
    run = client.get_run(first.mlflow_run_id)
    texts = [str(run.data.params), str(run.data.tags), str(list(run.data.metrics))]
    s3 = s3_client(stack.s3_endpoint, CREDS)
    for key in _bucket_keys(stack):
        body = s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
        assert secret.encode() not in body, f"credentials leaked into s3://{stack.bucket}/{key}"
    for log in Path(stack.state_dir).glob("*.log"):
        texts.append(log.read_text(errors="replace"))
    for text in texts:
        assert secret not in text


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
