"""Which Ray cluster a command joins: without an address a fresh local instance (never the dead
one a stale /tmp/ray/ray_current_cluster names), ``--address auto`` the running one, and an
address where no cluster answers one line and exit 2 at once.

Every command runs with its own Ray temp folder ($RAY_TMPDIR): the stale file written here
must not reach other Ray users on this machine. A plain ``proxydml train`` under such a stale
file is the piped run of ``tests/e2e/test_console.py`` (one train command shows both).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed on exit: nothing listens there


def stale_ray_folder() -> tuple[Path, str]:
    """A Ray temp folder whose ray_current_cluster names a dead cluster, as a killed
    ``ray.cluster_utils.Cluster`` leaves it, and that address. Short: Ray's socket paths must
    fit 107 bytes. The caller removes it."""
    folder = Path(tempfile.mkdtemp(prefix="pdml-ray-", dir="/tmp"))
    dead = _dead_address()
    (folder / "ray").mkdir()
    (folder / "ray" / "ray_current_cluster").write_text(dead)
    return folder, dead


@pytest.fixture
def stale_ray_tmp():
    folder, dead = stale_ray_folder()
    yield folder, dead
    shutil.rmtree(folder, ignore_errors=True)


def command_env(ray_tmp: Path, **env: str) -> dict[str, str]:
    """The environment of a ``proxydml`` command run from this checkout under its own Ray temp
    folder: no cluster address and no tracking server inherited from the test session."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return {**environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(ray_tmp), **env}


def _start(args: list[str], cwd: Path, ray_tmp: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=cwd, env=command_env(ray_tmp, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _cli(args: list[str], cwd: Path, ray_tmp: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return _finish(_start(args, cwd, ray_tmp, **env), timeout)


def test_dead_addresses_fail_at_once_with_one_line(stale_ray_tmp, tmp_path):
    ray_tmp, stale = stale_ray_tmp
    # One store per command: they run at once, and each would create (migrate) a new sqlite store.
    stores = [f"sqlite:///{tmp_path / f'mlflow{i}.db'}" for i in range(3)]

    def common(i: int) -> list[str]:
        return ["train.epochs=1", f"tracking.storage_path={tmp_path / 'runs'}", f"tracking.tracking_uri={stores[i]}"]

    dead = _dead_address()
    cases = [
        (["train", "--address", dead, *common(0)], {}, f"error: no Ray cluster at {dead} (--address)"),
        (["train", *common(1)], {"RAY_ADDRESS": dead}, f"error: no Ray cluster at {dead} ($RAY_ADDRESS)"),
        # auto: the cluster the stale file names, which is dead.
        (["tune", "--address", "auto", "--space", "digits_quick", "--samples", "2", *common(2)], {},
         f"error: no Ray cluster at {stale} (--address auto)"),
    ]
    # The three commands side by side: each is mostly its own start-up (imports, config checks).
    started = time.monotonic()
    procs = [_start(args, tmp_path, ray_tmp, **env) for args, env, _ in cases]
    for (args, _, line), proc in zip(cases, procs):
        out = _finish(proc, timeout=120)
        seconds = time.monotonic() - started
        assert out.returncode == 2, out.stderr
        err = out.stderr.strip().splitlines()
        assert err[-1].startswith(line) and "Traceback" not in out.stderr, out.stderr
        assert seconds < 60, f"{args[:3]}: {seconds:.0f} s"  # Ray's own retries take minutes
    assert not (tmp_path / "runs").exists()
    assert all(no_mlflow_runs(uri) for uri in stores)


def no_mlflow_runs(uri: str) -> bool:
    """True when the store holds no run (an experiment may exist: the login check makes it)."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return True
    client = MlflowClient(uri)
    return not client.search_runs([e.experiment_id for e in client.search_experiments()])
