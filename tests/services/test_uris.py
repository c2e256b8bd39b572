"""The one tracking-URI resolver and the one redaction of URIs shown to people."""

from __future__ import annotations

import pytest

from services.mlflow_tracking import local_store, resolve_tracking_uri
from services.uris import redact


@pytest.mark.parametrize("uri, shown", [
    ("postgresql://mlflow:s3cret@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    ("postgresql://mlflow@db/mlflow", "postgresql://mlflow@db/mlflow"),
    ("sqlite:////tmp/x/mlflow.db", "sqlite:////tmp/x/mlflow.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("postgresql://u:pw@[::1/db", "postgresql://u:***@[::1/db"),  # not parsable: still no password
])
def test_redact_hides_only_the_password(uri, shown):
    assert redact(uri) == shown


def test_tracking_uri_explicit_then_environment_then_local_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == resolve_tracking_uri(None) == local_store()[0]
    assert resolve_tracking_uri().startswith(f"sqlite:///{tmp_path.resolve()}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_tracking_uri() == "http://127.0.0.1:5999"
    assert resolve_tracking_uri("sqlite:///elsewhere.db") == "sqlite:///elsewhere.db"
