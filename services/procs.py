"""Process supervision for the local servers: pid liveness, process groups, stop, log tails.

Every server the stack starts runs in its own session (``start_new_session=True``), so it is
the leader of a process group holding every child it spawns (MLflow's uvicorn workers,
PostgreSQL's backends, Swift's four servers): stopping or killing the group leaves nothing.
Linux's ``/proc`` is read where it exists (zombies count as gone); elsewhere ``kill(pid, 0)``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) from /proc, or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: init reaps it
        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (another user's process counts)."""
    _reap(pid)
    if Path("/proc").is_dir():
        stat = _proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the process group."""
    _reap(pgid)
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat and stat[1] == pgid and stat[0] not in ("Z", "X"):
                return True
    return False


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ('' when unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the group; a group already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pgid: int, timeout: float) -> bool:
    """Poll until no process of the group is left (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_group_alive(pgid):
            return True
        time.sleep(0.1)
    return not process_group_alive(pgid)


def stop_group(pgid: int, timeout: float, first: signal.Signals = signal.SIGTERM) -> str:
    """``first`` (SIGTERM; PostgreSQL's fast shutdown is SIGINT) to the group, SIGKILL what is
    left after ``timeout``; returns 'terminated' or 'killed'."""
    signal_group(pgid, first)
    if wait_gone(pgid, timeout):
        return "terminated"
    signal_group(pgid, signal.SIGKILL)
    wait_gone(pgid, 5.0)
    return "killed"


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('(no log)' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
