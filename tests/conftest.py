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
def local_mlflow(tmp_path):
    """A fresh embedded sqlite tracking store for one test."""
    from services.mlflow_tracking import local_store

    uri, _ = local_store(tmp_path / "mlruns")
    return uri
