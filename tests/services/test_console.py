"""The console filter: library chatter to the log file only, everything else through."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from services.console import _Tee, is_chatter, run_console

CHATTER_LINES = [
    "\x1b[36m(RayTrainWorker pid=10670)\x1b[0m Loading faiss with AVX512 support.",
    "(RayTrainWorker pid=10670) Could not load library with AVX2 support due to:",
    "(RayTrainWorker pid=10670) ModuleNotFoundError(\"No module named 'faiss.swigfaiss_avx2'\")",
    "(RayTrainWorker pid=10670) Successfully loaded faiss.",
    # a Sapphire Rapids CPU: faiss tries its AVX512-SPR build first
    "\x1b[36m(RayTrainWorker pid=28555)\x1b[0m Loading faiss with AVX512-SPR support.",
    "\x1b[36m(RayTrainWorker pid=28555)\x1b[0m Could not load library with AVX512-SPR support due to:",
    "(RayTrainWorker pid=28555) ModuleNotFoundError(\"No module named 'faiss.swigfaiss_avx512_spr'\")",
    "2026/12/01 01:25:06 INFO mlflow.system_metrics.system_metrics_monitor: Started monitoring system metrics.",
    "2026/12/01 01:24:39 INFO mlflow.store.db.utils: Creating initial MLflow database tables...",
    "(TrainController pid=10531) [2026-12-01 01:25:02,138 E 10531 10571] core_worker.cc:2465: Actor with class "
    "name: 'PreemptionWatcher' and ID: 'ab00' has constructor arguments in the object store and max_restarts > 0",
]
REAL_LINES = [
    "(RayTrainWorker pid=10670) epoch 1/4 loss=8.8004 recall_at_1=0.9297",
    "2026/12/01 01:25:06 WARNING mlflow.tracking: the server answered 503",
    "error: train.epochs must be > 0, got -2",
    "UserWarning: loss is not finite",
    "Traceback (most recent call last):",
]


@pytest.mark.parametrize("line", CHATTER_LINES)
def test_known_chatter_is_recognised(line):
    assert is_chatter(line)


@pytest.mark.parametrize("line", REAL_LINES)
def test_real_output_is_not_chatter(line):
    assert not is_chatter(line)


def test_tee_shows_real_lines_logs_everything_and_passes_bars_through():
    console, log = io.StringIO(), io.StringIO()
    tee = _Tee(console, log)
    text = "\n".join([CHATTER_LINES[0], REAL_LINES[0], CHATTER_LINES[4], REAL_LINES[2]]) + "\n"
    tee.write(text[:37])  # lines arrive in pieces
    tee.write(text[37:])
    tee.write("\repoch 1/4:  50%|#####     | 7/14")  # a bar redraw: shown at once
    assert console.getvalue() == f"{REAL_LINES[0]}\n{REAL_LINES[2]}\n\repoch 1/4:  50%|#####     | 7/14"
    assert log.getvalue() == text + "\repoch 1/4:  50%|#####     | 7/14"


def test_run_console_routes_prints_and_logging_and_discards_a_new_log_on_user_error(tmp_path, capsys):
    handler = logging.StreamHandler(sys.stderr)
    lg = logging.getLogger("mlflow.test_console")
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        with run_console(tmp_path / "logs" / "run.log") as path:
            print("epoch 1/1 loss=1.0")
            lg.info("from a library")  # a handler that kept the old stderr is routed too
            print(CHATTER_LINES[3])
        out = capsys.readouterr()
        assert "epoch 1/1 loss=1.0" in out.out and "Successfully loaded faiss" not in out.out
        assert "from a library" in out.err  # INFO of a logger not on the chatter list: shown
        assert "Successfully loaded faiss" in path.read_text() and "from a library" in path.read_text()
        assert handler.stream is sys.stderr  # restored

        with pytest.raises(ValueError), run_console(tmp_path / "logs" / "bad.log", discard_on=(ValueError,)):
            print("note: checking the data")
            raise ValueError("data.root does not exist")
        assert not (tmp_path / "logs" / "bad.log").exists()  # nothing left behind by a user error
        with pytest.raises(ValueError), run_console(tmp_path / "new" / "logs" / "bad.log", discard_on=(ValueError,)):
            raise ValueError("data.root does not exist")
        assert not (tmp_path / "new").exists()  # nor the folders made for it
    finally:
        lg.removeHandler(handler)
