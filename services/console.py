"""What a command prints: its own lines on the console, everything in the run's log file.

Ray forwards every worker's and actor's output to the driver, and the libraries we run talk
on import and on start-up: faiss reports each CPU-feature build it tries (on every worker),
MLflow logs INFO lines for its database and system-metrics monitor, Ray's C++ core in the
Train controller logs an error about its own PreemptionWatcher actor, torch.export warns
about weight placement. None of it is ours to fix, and a user looking at a run cannot tell
it from a real problem. :func:`run_console` tees stdout and stderr: the log file gets every
byte, the console gets everything except the lines :data:`CHATTER` knows. Real warnings and
errors (anything else) still reach the console, and progress bars pass straight through.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# Known library chatter, matched anywhere in a line (Ray prefixes forwarded lines with the
# actor's name and pid). Keep each pattern specific: a line that is not listed is shown.
CHATTER = re.compile("|".join([
    # faiss.loader, per process; the level names a hyphen on Sapphire Rapids ("AVX512-SPR")
    r"Loading faiss( with [\w-]+ support)?\.",
    r"Could not load library with [\w-]+ support due to",
    r"No module named 'faiss\.swigfaiss_\w+'",
    r"Successfully loaded faiss",
    r"\bINFO mlflow[.\w]*:",                         # MLflow's INFO lines (db set-up, system metrics)
    r"Actor with class name: 'PreemptionWatcher'",  # Ray Train's own watcher (core_worker.cc)
    r"Token authentication is enabled for this Ray cluster",
    r"Started a local Ray instance",
    r"No complete tensor found in the group",         # torch.export, when MLflow saves the model
    r"complete_tensor = get_complete_tensor\(",       # ...and the source line the warning shows
]))


def is_chatter(line: str) -> bool:
    """True for a line the console leaves out (it still goes to the log file)."""
    return bool(CHATTER.search(line))


class _Tee(io.TextIOBase):
    """A text stream that writes everything to ``log`` and the non-chatter lines to ``console``.

    Whole lines are filtered; a write with a carriage return and no newline (a progress bar
    redrawing itself) goes to the console at once. Thread-safe: Ray's log monitor prints from
    its own thread.
    """

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        super().__init__()
        self.console: IO[str] = console
        self.log: IO[str] | None = log
        self._pending = ""
        self.quiet = False  # log_only(): everything to the log, the console shows only show()
        # Re-entrant: a signal handler (Ray Tune prints on Ctrl-C) may write while the main
        # thread is inside write(); a plain Lock would deadlock the process there.
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            if self.log is not None:
                self.log.write(text)
            if self.quiet:
                return len(text)
            if "\r" in text and "\n" not in text and not self._pending:
                self.console.write(text)
                return len(text)
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                if not is_chatter(line):
                    self.console.write(line + "\n")
        return len(text)

    def show(self, text: str) -> None:
        """Write ``text`` to the console (and the log) even inside :func:`log_only`."""
        with self._lock:
            if self.log is not None:
                self.log.write(text)
            self.console.write(text)
            self.console.flush()

    def flush(self) -> None:
        with self._lock:
            if self.log is not None:
                self.log.flush()
            self.console.flush()

    def close_pending(self) -> None:
        """Show a last line that never got its newline (unless it is chatter)."""
        with self._lock:
            if self._pending and not is_chatter(self._pending):
                self.console.write(self._pending)
            self._pending = ""

    def release(self) -> None:
        """The log file closes: a library that kept this stream (Ray's colorama does, at import)
        writes to the console from now on."""
        with self._lock:
            self.log = None

    def isatty(self) -> bool:
        try:
            return self.console.isatty()
        except ValueError:  # the console was closed under a late writer (interpreter exit)
            return False

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.console, "encoding", "utf-8")


def _stream_handlers(streams: tuple[object, ...]) -> list[logging.StreamHandler]:
    """Logging handlers that write to one of ``streams`` (they keep the stream they were given
    at import time, so replacing ``sys.stderr`` alone would not reach them)."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in streams]


@contextlib.contextmanager
def run_console(log_path: Path, discard_on: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Within the block, stdout and stderr (and logging handlers on them) go through the
    filter; the full output is appended to ``log_path``. Yields ``log_path``.

    A new log file is removed again when the block raises one of ``discard_on`` (a user error
    found before anything started: nothing is left behind).
    """
    new = not log_path.exists()
    created = [d for d in (log_path.parent, *log_path.parent.parents) if not d.exists()]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out, err = sys.stdout, sys.stderr
    discard = False
    try:
        with log_path.open("a", encoding="utf-8") as log:
            tees = {out: _Tee(out, log), err: _Tee(err, log)}
            handlers = _stream_handlers((out, err))
            previous = [h.stream for h in handlers]
            sys.stdout, sys.stderr = tees[out], tees[err]
            for h in handlers:
                h.setStream(tees[h.stream])
            try:
                yield log_path
            except discard_on:
                discard = new
                raise
            finally:
                for tee in tees.values():
                    tee.close_pending()
                    tee.flush()
                    tee.release()
                sys.stdout, sys.stderr = out, err
                for h, stream in zip(handlers, previous, strict=True):
                    h.setStream(stream)
    finally:
        if discard:
            log_path.unlink(missing_ok=True)
            for d in created:  # innermost first: the folders this call made, if still empty
                with contextlib.suppress(OSError):
                    d.rmdir()


@contextlib.contextmanager
def log_only() -> Iterator[Callable[[str], None]]:
    """Within the block everything printed or logged goes to the log file only, and the console
    shows just what the yielded ``show`` writes: a sweep's one progress line instead of Ray
    Tune's status tables and every trial's forwarded output. Outside :func:`run_console`
    nothing is muted and ``show`` writes to stdout."""
    tees = [s for s in (sys.stdout, sys.stderr) if isinstance(s, _Tee)]
    out = sys.stdout

    def show(text: str) -> None:
        if isinstance(out, _Tee):
            out.show(text)
        else:
            out.write(text)
            out.flush()

    for tee in tees:
        tee.quiet = True
    try:
        yield show
    finally:
        for tee in tees:
            tee.quiet = False


@dataclass(frozen=True)
class SweepProgress:
    """Where a sweep stands: its trials by state, the best score so far, the time and compute spent."""

    planned: int  # trials the search will run in all (as far as it knows)
    done: int  # every epoch trained
    running: int
    pending: int
    stopped: int  # stopped early by the scheduler (an ASHA rung)
    failed: int
    metric: str
    best: float | None
    best_trial: str
    elapsed_s: float
    cpu_hours: float
    gpu_hours: float

    def line(self) -> str:
        best = f"best {self.metric} {self.best:.4f} ({self.best_trial})" if self.best is not None else "no score yet"
        minutes, seconds = divmod(int(self.elapsed_s), 60)
        spent = f"{self.cpu_hours:.2f} CPU-h" + (f", {self.gpu_hours:.2f} GPU-h" if self.gpu_hours else "")
        return (f"trials {self.done + self.stopped + self.failed}/{self.planned}: {self.done} done, "
                f"{self.running} running, {self.stopped} stopped, {self.failed} failed | {best} | "
                f"{minutes}m{seconds:02d}s, {spent}")


class SweepConsole:
    """Shows a sweep's progress as one line: redrawn in place on a terminal (at most once a
    second), else a new line at most every ``every_s`` seconds, and always the final state.
    A 200-trial sweep thus prints a few dozen lines to a pipe, not Tune's tables per step."""

    def __init__(self, show: Callable[[str], None], tty: bool, every_s: float = 30.0) -> None:
        self.show, self.tty = show, tty
        self.every_s = 1.0 if tty else every_s
        self._last = float("-inf")
        self._width = 0

    def __call__(self, progress: SweepProgress, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < self.every_s:
            return
        self._last = now
        line = progress.line()
        if self.tty:
            self.show("\r" + line.ljust(self._width) + ("\n" if final else ""))
            self._width = len(line)
        else:
            self.show(line + "\n")


def log_path_for(name: str, root: Path | None = None) -> Path:
    """Where the console log of run or sweep ``name`` goes: ``.proxydml/logs/<name>.log``."""
    return (root or Path.cwd()) / ".proxydml" / "logs" / f"{name}.log"
