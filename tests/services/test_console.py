"""The console filter: library chatter to the log file only, everything else through; a sweep's
one progress line."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from services.console import SweepConsole, SweepProgress, _Tee, is_chatter, log_only, run_console

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


def test_log_only_mutes_everything_but_show_and_logs_it_all(tmp_path, capsys):
    with run_console(tmp_path / "sweep.log") as path:
        print("before")
        with log_only() as show:
            print("Trial status: 2 RUNNING")  # Tune's table: the log only
            print("(RayTrainWorker pid=1) epoch 1/1", file=sys.stderr)
            show("trials 1/2: 1 done\n")
        print("after")
    out = capsys.readouterr()
    assert out.out == "before\ntrials 1/2: 1 done\nafter\n" and out.err == ""
    assert all(s in path.read_text() for s in ("Trial status", "epoch 1/1", "trials 1/2", "after"))


def _progress(done: int, elapsed: float, best: float | None = 0.41234) -> SweepProgress:
    return SweepProgress(planned=200, done=done, running=4, pending=180 - done, stopped=12, failed=1,
                         metric="map_at_r", best=best, best_trial="a1b2_00007", elapsed_s=elapsed,
                         cpu_hours=1.5, gpu_hours=0.0)


def test_sweep_progress_line_counts_trials_best_time_and_compute():
    assert _progress(3, 754.2).line() == ("trials 16/200: 3 done, 4 running, 12 stopped, 1 failed | "
                                          "best map_at_r 0.4123 (a1b2_00007) | 12m34s, 1.50 CPU-h")
    assert "no score yet" in _progress(0, 1, best=None).line()
    gpu = SweepProgress(1, 1, 0, 0, 0, 0, "recall_at_1", 0.9, "t", 61, 2.0, 0.5)
    assert gpu.line().endswith("1m01s, 2.00 CPU-h, 0.50 GPU-h")


def test_sweep_console_in_a_pipe_prints_a_line_at_most_every_period_and_the_last(monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 32.0, 33.0])
    monkeypatch.setattr("services.console.time.monotonic", lambda: next(clock))
    shown: list[str] = []
    console = SweepConsole(shown.append, tty=False, every_s=30)
    for done in range(4):
        console(_progress(done, done))
    console(_progress(9, 9), final=True)
    assert [line.split(":")[0] for line in shown] == ["trials 13/200", "trials 15/200", "trials 22/200"]
    assert all(line.endswith("\n") for line in shown)


def test_sweep_console_on_a_terminal_redraws_one_line():
    shown: list[str] = []
    console = SweepConsole(shown.append, tty=True)
    console(_progress(10, 1))
    console(_progress(11, 2))  # within the second: skipped
    console(_progress(12, 3), final=True)
    assert len(shown) == 2 and all(s.startswith("\r") for s in shown) and shown[-1].endswith("\n")
    assert "\n" not in shown[0]
