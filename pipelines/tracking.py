"""The two small protocols through which the pipeline talks to Ray and MLflow.

``services/`` implements them (Ray Train session, MLflow client); tests and single-process
runs use the local implementations below. The pipeline never imports Ray or MLflow.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol


class Progress(Protocol):
    """A progress bar (tqdm's interface): ``update`` after each step, ``close`` at the end."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> object: ...


class NullProgress:
    """No bar: ranks other than 0, ``--quiet``, or output that is not a terminal."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class Reporter(Protocol):
    """Reports per-epoch results and hands back the checkpoint to resume from."""

    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None: ...

    def progress(self, total: int, description: str) -> Progress:
        """The bar of one epoch on rank 0 (steps, steps/s and ETA), shown where the user looks."""
        ...


class Tracker(Protocol):
    """Experiment tracking, called on rank 0 only."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...


class NullTracker:
    """Used on ranks other than 0 and when tracking is off."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass


class LocalReporter:
    """Keeps checkpoints in a folder; for single-process runs and tests without Ray.

    Checkpoint ``checkpoint_<epoch>`` merges the files of every rank (their names differ), so
    a multi-process run without Ray (gloo, one reporter per rank) writes one checkpoint per
    epoch, as Ray Train does.
    """

    def __init__(self, root: Path, show_progress: bool | None = None) -> None:
        self.root = Path(root)
        self.history: list[dict[str, float]] = []
        # None: a bar only when stderr is a terminal (never in logs or CI output).
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress

    def progress(self, total: int, description: str) -> Progress:
        if not self.show_progress:
            return NullProgress()
        from tqdm import tqdm

        return tqdm(total=total, desc=description, unit="step", leave=False, dynamic_ncols=True)

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        ckpts = sorted(self.root.glob("checkpoint_*")) if self.root.exists() else []
        yield ckpts[-1] if ckpts else None

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        self.history.append(dict(metrics))
        if checkpoint_dir is not None:
            dest = self.root / f"checkpoint_{int(metrics['epoch']):06d}"
            shutil.copytree(checkpoint_dir, dest, dirs_exist_ok=True)
