"""What `proxydml train` shows in a terminal: its own lines and a progress bar, no library
chatter; everything goes to the run's log file, which MLflow keeps too."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from services.console import is_chatter
from tests.cluster.test_which_cluster import command_env, stale_ray_folder

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def run_in_terminal(args: list[str], cwd: Path, timeout: float = 420) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal of 160 x 40 (what a user's
    terminal is: tqdm sizes its bar from it). Returns (exit code, everything printed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(args, cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return proc.returncode, out.decode(errors="replace")


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """`proxydml train` with its output on pipes, started when the module starts: it runs beside
    the terminal run of the first test (two Ray instances; the command's start-up, not its
    training, is most of its time), and the second test reads what it printed. One worker: what
    it checks (no bar on a pipe, the epoch line, a stale cluster file) does not depend on the
    worker count, and a second Train worker would slow the terminal run beside it.

    Its Ray temp folder holds a stale ray_current_cluster naming a dead cluster, as a killed
    cluster leaves it: a plain train must start its own instance regardless (ray.init once read
    the file and failed with "When connecting to an existing cluster, num_cpus and num_gpus
    must not be provided")."""
    tmp = tmp_path_factory.mktemp("piped")
    ray_tmp, _ = stale_ray_folder()
    # Files, not pipes: nothing reads them while the first test runs, and a full pipe would stall it.
    with open(tmp / "stdout", "w") as out, open(tmp / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "train", "--config", "digits", "train.epochs=1",
             "train.max_steps_per_epoch=3", "scaling.num_workers=1", f"tracking.storage_path={tmp / 'runs'}",
             f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"],
            cwd=tmp, stdout=out, stderr=err, env=command_env(ray_tmp))

    def finished() -> tuple[int, str, str, Path]:
        code = proc.wait(timeout=420)
        return code, (tmp / "stdout").read_text(), (tmp / "stderr").read_text(), tmp / "runs"

    yield finished
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_train_in_a_terminal_shows_a_progress_bar_and_no_library_chatter(tmp_path, piped_run):
    db = tmp_path / "mlflow.db"
    code, shown = run_in_terminal(
        [sys.executable, "-m", "services.cli", "train", "--config", "digits", "train.epochs=1",
         "train.max_steps_per_epoch=3", f"tracking.storage_path={tmp_path / 'runs'}", f"tracking.tracking_uri=sqlite:///{db}"],
        cwd=tmp_path)
    assert code == 0, shown
    # The bar of epoch 1, drawn on the driver from rank 0's state: description, percentage, rate.
    assert "epoch 1/1:" in shown and "%|" in shown and "step/s" in shown, shown
    lines = shown.splitlines()
    for needle in ("faiss", "INFO mlflow", "PreemptionWatcher", "No complete tensor found"):
        assert not [line for line in lines if needle in line], needle
    assert "unseen-class retrieval (last epoch)" in shown and "recall_at_1" in shown
    assert re.search(r"wall time   : \d+ s", shown), shown  # start of the command to the final table

    # The log file has all of it: what the console left out is there.
    logs = list((tmp_path / ".proxydml" / "logs").glob("digits-*.log"))
    assert len(logs) == 1
    text = logs[0].read_text(errors="replace")
    assert "Loading faiss" in text and "unseen-class retrieval" in text
    assert any(is_chatter(line) for line in text.splitlines())
    # ...and MLflow keeps it with the run.
    client = MlflowClient(f"sqlite:///{db}")
    run_id = shown.split("MLflow run  : ")[1].split()[0]
    assert [a.path for a in client.list_artifacts(run_id, "logs")] == [f"logs/{logs[0].name}"]


def test_output_that_is_not_a_terminal_has_no_bar_and_a_stale_cluster_file_does_not_stop_it(piped_run):
    code, stdout, stderr, runs = piped_run()
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    assert "unseen-class retrieval" in stdout and any(runs.rglob("model.pt"))
    assert "%|" not in stdout + stderr
    # The epoch line: the headline only (the other 16 metrics go to MLflow and the log file).
    line, = [x for x in stdout.splitlines() if "epoch 1/1 loss " in x]
    assert len(line) < 160, line
    for part in ("R@1 0.", "MAP@R 0.", "train ", "eval "):
        assert part in line, line
    assert "system/" not in line and "r_precision" not in line, line
