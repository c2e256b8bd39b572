"""Shared fixtures: one local Ray cluster per test session (init costs 6-14 s here)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
# System metrics every second, so that short test runs record some (workers inherit this).
os.environ.setdefault("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
# No telemetry from MLflow or anything else: tests talk to 127.0.0.1 only.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")


@pytest.fixture(scope="session")
def ray_cluster():
    from services import runtime

    runtime.ensure_ray()
    yield
    runtime.shutdown_ray()


@pytest.fixture
def digits_config():
    """Builds the small Ray run most service tests train: the ``digits`` recipe on 2 workers,
    tracked at ``uri`` with checkpoints under ``storage``, plus any overrides."""
    from pipelines.config import Config, load_config

    def build(uri: str, storage: str | os.PathLike[str], *extra: str, epochs: int = 2, steps: int = 0,
              workers: int = 2) -> Config:
        return load_config("digits", [
            f"train.epochs={epochs}", f"train.max_steps_per_epoch={steps}", f"scaling.num_workers={workers}",
            f"tracking.tracking_uri={uri}", f"tracking.storage_path={storage}", *extra,
        ])

    return build


@pytest.fixture
def local_mlflow(tmp_path):
    """A fresh embedded sqlite tracking store for one test."""
    from services.mlflow_tracking import local_store

    uri, _ = local_store(tmp_path / "mlruns")
    return uri


@pytest.fixture(scope="module")
def make_stack(tmp_path_factory):
    """Starts real local stacks (moto S3 + MLflow server on 127.0.0.1, free ports) with the
    given credentials; every one is stopped when the module ends. Each test module keeps its
    own test keys, so a secret scan can tell whose keys leaked."""
    from services.stack import Stack

    started = []

    def make(credentials, start_timeout: float = 120, **options):
        # options: further Stack arguments, e.g. auth=True (MLflow with basic auth).
        st = Stack(tmp_path_factory.mktemp("stack"), s3_port=0, mlflow_port=0, credentials=credentials,
                   s3_server="moto", start_timeout=start_timeout, **options)
        started.append(st)
        st.up()
        return st

    yield make
    for st in started:
        st.down()
