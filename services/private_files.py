"""Files that hold a secret (keys, passwords, a config with a key in it): mode 0600 from the
moment they exist, never world-readable even briefly. The one writer of such files."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0600 from creation on; returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)  # an older file may have had wider bits
    return path
