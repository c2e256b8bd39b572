"""Shared fixtures: one local Ray cluster per test session (init costs 6-14 s here)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny emoji set (64 classes x 5 designs, 32 px) built from the real npm packages,
    through the CLI as a user builds it, once per session. npm is part of the machines we run
    on: without it this fails (a skip would hide that the real data path was never exercised)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    assert shutil.which("npm"), "npm is needed to fetch the emoji packages (apt-get install npm)"
    out = tmp_path_factory.mktemp("emoji") / "tiny"
    # A relative --out, as users type it: npm runs in the cache folder, the output must not nest there.
    proc = subprocess.run([sys.executable, "-m", "services.cli", "data", "build", "emoji", "--tiny",
                           "--out", "tiny", "--quiet"], cwd=out.parent, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def local_mlflow(tmp_path):
    """A fresh embedded sqlite tracking store for one test."""
    from services.mlflow_tracking import local_store

    uri, _ = local_store(tmp_path / "mlruns")
    return uri


@contextlib.contextmanager
def _stack_maker() -> Iterator[Callable[..., Any]]:
    """Yields ``make(credentials, start_timeout=120, durable=False, **options)``, which starts a
    real local stack (MLflow server + S3 on 127.0.0.1, free ports); every one is stopped on exit.

    Default: a throw-away stack (moto S3 in memory, sqlite store), the cheapest to start.
    ``durable=True``: the stack users get (PostgreSQL + Swift, data on disk). The state
    folders live under a world-traversable temporary folder, because PostgreSQL runs as its
    own account when the tests run as root.
    """
    import shutil
    import tempfile
    from pathlib import Path

    from services.stack import Stack

    base = Path(tempfile.mkdtemp(prefix="proxydml-stacks-"))
    base.chmod(0o755)
    started = []

    def make(credentials, start_timeout: float = 120, durable: bool = False, **options):
        # options: further Stack arguments, e.g. auth=True (MLflow with basic auth).
        kinds = {"s3_server": "swift", "store": "postgresql"} if durable else {"s3_server": "moto", "store": "sqlite"}
        st = Stack(tempfile.mkdtemp(dir=base), s3_port=0, mlflow_port=0, credentials=credentials,
                   start_timeout=start_timeout, **{**kinds, **options})
        Path(st.state_dir).chmod(0o755)
        started.append(st)
        st.up()
        return st

    try:
        yield make
    finally:
        for st in started:
            st.down()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def make_stack():
    """A module's own stacks (see ``_stack_maker``), stopped when the module ends: for modules
    that restart or break their stack, change its users, or scan it for their own keys."""
    with _stack_maker() as make:
        yield make


@pytest.fixture(scope="session")
def shared_stack():
    """One throw-away stack (moto, sqlite) for the session's modules that only use it: they
    neither restart nor break it, and each keeps to its own experiments, models and bucket
    prefixes. One start (about 15 s and 32 CPU-s on 2 cores) instead of one per module."""
    from services.s3 import Credentials

    with _stack_maker() as make:
        yield make(Credentials("proxydml-shared-key", "proxydml-shared-secret"))


CHROMIUM = os.environ.get("PROXYDML_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PROXYDML_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = ("apt-get update && apt-get install -y chromium chromium-driver  (Debian packages), "
           "and pip install selenium into the venv")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium driven by Selenium, resolving no host but 127.0.0.1. Missing
    Chromium is a failure with the install commands, never a skip: `make test` installs it."""
    from pathlib import Path

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).is_file() and os.access(p, os.X_OK))]
    if missing:
        pytest.fail(f"headless browser test: {', '.join(missing)} missing; install with: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"headless browser test: selenium is not installed; {INSTALL}")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download a driver/browser
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1400,1000",
                # Every host name but 127.0.0.1 fails to resolve: the pages cannot reach out.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
