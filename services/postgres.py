"""PostgreSQL for the team stack: MLflow's tracking store and the auth app's user store.

One cluster under ``STATE/postgres``, created by ``initdb`` on the first ``stack up`` and kept
across restarts; TCP on 127.0.0.1 only (no Unix socket), scram-sha-256 for every connection.
The superuser is :data:`USER` with a generated password that lives only in ``STATE/pgpass``
(mode 0600, libpq's password-file format): MLflow, ``pg_dump`` and ``pg_restore`` find it
through ``$PGPASSFILE``, so no URI, config file or command line carries it.

PostgreSQL refuses to run as root. When the stack runs as root the server runs as the
``postgres`` account that Debian's package creates, which must be able to reach the state
folder (:func:`check_reachable` names the folder that blocks it).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import time
from pathlib import Path

from services.net import HOST
from services.private_files import write_private

USER = "proxydml"
DATABASES = ("mlflow", "mlflow_auth")
RUN_AS_WHEN_ROOT = "postgres"
PGPASS_FILE = "pgpass"
INSTALL_HINT = "install PostgreSQL (Debian: apt-get install postgresql)"
# A team's sweep opens many tracking connections: each MLflow worker's SQLAlchemy pool
# (pool + overflow, see services/stack.py) must fit with room for dumps and admin sessions.
MAX_CONNECTIONS = 200


def bindir() -> Path | None:
    """The folder of ``initdb``/``postgres``/``pg_dump``: on PATH, else Debian's newest
    ``/usr/lib/postgresql/N/bin``."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


def installed() -> bool:
    """Whether a PostgreSQL server can be initialised and run here."""
    b = bindir()
    return b is not None and (b / "postgres").exists() and (os.geteuid() != 0 or _run_as() is not None)


def version() -> str:
    """The server's major version ('15'), '' when not installed."""
    b = bindir()
    if b is None:
        return ""
    out = subprocess.run([str(b / "postgres"), "--version"], capture_output=True, text=True).stdout
    return out.split()[-1].split(".")[0] if out else ""


def _run_as() -> pwd.struct_passwd | None:
    """The account the server runs as: ourselves, or ``postgres`` when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(RUN_AS_WHEN_ROOT)
    except KeyError:
        return None


def popen_user() -> dict[str, object]:
    """``subprocess.Popen`` arguments that run a server binary as :func:`_run_as`."""
    account = _run_as()
    if account is None:
        return {}
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def check_reachable(folder: Path) -> None:
    """Raise PermissionError naming the first ancestor of ``folder`` the server's account
    cannot enter (root's 0700 home, say), before ``initdb`` fails with a vaguer message."""
    account = _run_as()
    if account is None:
        return
    for parent in reversed(folder.absolute().parents):
        if not parent.exists():  # created later, by us, with modes we choose
            break
        st = parent.stat()
        if st.st_uid == account.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == account.pw_gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise PermissionError(
                f"PostgreSQL runs as user {account.pw_name} (it refuses root) and cannot enter {parent} "
                f"(mode {stat.S_IMODE(st.st_mode):o}); choose a state folder it can reach (--state-dir), "
                f"or allow it in: chmod o+x {parent}")


def password(state_dir: Path) -> str | None:
    """The superuser's password from ``STATE/pgpass`` (None before the first start)."""
    try:
        line = (state_dir / PGPASS_FILE).read_text().strip().splitlines()[0]
    except (OSError, IndexError):
        return None
    return line.rsplit(":", 1)[1]


def write_pgpass(state_dir: Path, port: int, secret: str) -> Path:
    """``host:port:*:user:password`` for libpq, mode 0600 from creation on."""
    return write_private(state_dir / PGPASS_FILE, f"{HOST}:{port}:*:{USER}:{secret}\n")


def initialise(data_dir: Path, state_dir: Path, port: int) -> None:
    """``initdb`` once (a cluster that exists is kept); the pgpass file follows the port."""
    secret = password(state_dir)
    if (data_dir / "PG_VERSION").exists():
        if secret is None:
            raise RuntimeError(f"{data_dir} holds a database but its password file {state_dir / PGPASS_FILE} is "
                               "gone; restore that file (or a backup: proxydml stack restore)")
        write_pgpass(state_dir, port, secret)
        return
    b = bindir()
    if b is None:
        raise RuntimeError(f"PostgreSQL is not installed: {INSTALL_HINT}")
    check_reachable(data_dir)
    secret = secrets.token_urlsafe(24)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    account = _run_as()
    if account is not None:
        os.chown(data_dir, account.pw_uid, account.pw_gid)
    # initdb reads the password from a file the server's account can read; removed right after.
    pwfile = write_private(data_dir.parent / f".{data_dir.name}.pw", secret + "\n")
    if account is not None:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    try:
        out = subprocess.run(
            [str(b / "initdb"), "-D", str(data_dir), "-U", USER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
             "--encoding=UTF8", "--locale=C"],
            capture_output=True, text=True, **popen_user(),  # type: ignore[arg-type]
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if out.returncode != 0:
        shutil.rmtree(data_dir, ignore_errors=True)  # nothing half-initialised is kept
        raise RuntimeError(f"initdb failed: {(out.stderr or out.stdout).strip()[-2000:]}")
    write_pgpass(state_dir, port, secret)


def wait_old_server_gone(data_dir: Path, timeout: float = 30.0) -> None:
    """After a crash (SIGKILL, power cut) wait until the old server's processes have exited.

    PostgreSQL refuses to start while the pid in ``postmaster.pid`` exists at all (a zombie
    not yet reaped counts) or while old backends still hold its shared memory; backends exit
    on their own within moments of noticing their server died.
    """
    try:
        old = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{old}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # Orphaned backends of that server: their parent is gone, they notice within a second.
    while _orphan_backends(data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)


def _orphan_backends(data_dir: Path) -> bool:
    """Whether a process of the server's account still has ``data_dir`` as its working folder."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == str(data_dir):
                    return True
            except OSError:
                continue
    return False


def command(data_dir: Path, port: int) -> list[str]:
    """The server in the foreground: TCP on 127.0.0.1:``port`` only, no Unix socket."""
    b = bindir()
    return [str(b / "postgres" if b else "postgres"), "-D", str(data_dir), "-p", str(port),
            "-c", f"listen_addresses={HOST}", "-c", "unix_socket_directories=",
            "-c", f"max_connections={MAX_CONNECTIONS}"]


def connect(state_dir: Path, port: int, dbname: str = "postgres", timeout: float = 2.0):  # noqa: ANN201
    """A psycopg2 connection as the superuser (autocommit)."""
    import psycopg2

    conn = psycopg2.connect(host=HOST, port=port, user=USER, dbname=dbname, password=password(state_dir),
                            connect_timeout=max(1, int(timeout)))
    conn.autocommit = True
    return conn


def healthy(state_dir: Path, port: int, timeout: float = 1.0) -> bool:
    """Whether the server accepts our login."""
    try:
        connect(state_dir, port, timeout=timeout).close()
        return True
    except Exception:  # psycopg2.OperationalError and friends: not up (yet)
        return False


def ensure_databases(state_dir: Path, port: int) -> None:
    """Create MLflow's databases when missing (idempotent)."""
    conn = connect(state_dir, port)
    try:
        with conn.cursor() as cur:
            for db in DATABASES:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{db}"')
    finally:
        conn.close()


def has_table(state_dir: Path, port: int, database: str, table: str) -> bool:
    """Whether ``database`` exists and holds ``table`` (False when the server is down)."""
    try:
        conn = connect(state_dir, port, database)
    except Exception:  # no such database, or no server: no table either
        return False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"public.{table}",))
            return bool(cur.fetchone()[0])
    finally:
        conn.close()


def uri(port: int, database: str) -> str:
    """A SQLAlchemy URI with no password in it (libpq reads it from $PGPASSFILE)."""
    return f"postgresql+psycopg2://{USER}@{HOST}:{port}/{database}"


def client_env(state_dir: Path) -> dict[str, str]:
    """What a client process (MLflow server, pg_dump) needs to log in."""
    return {"PGPASSFILE": str(state_dir / PGPASS_FILE)}


def dump(state_dir: Path, port: int, database: str, out: Path) -> None:
    """``pg_dump`` in its custom format (compressed, restorable table by table)."""
    b = bindir()
    env = {**os.environ, **client_env(state_dir)}
    subprocess.run([str(b / "pg_dump" if b else "pg_dump"), "-h", HOST, "-p", str(port), "-U", USER,
                    "--format=custom", "--no-owner", "-f", str(out), database], check=True, env=env,
                   capture_output=True)


def restore(state_dir: Path, port: int, database: str, dump_file: Path) -> None:
    """Replace ``database`` by the contents of ``dump_file`` (dropped and created anew)."""
    conn = connect(state_dir, port)
    try:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            cur.execute(f'CREATE DATABASE "{database}"')
    finally:
        conn.close()
    b = bindir()
    env = {**os.environ, **client_env(state_dir)}
    subprocess.run([str(b / "pg_restore" if b else "pg_restore"), "-h", HOST, "-p", str(port), "-U", USER,
                    "--no-owner", "--exit-on-error", "-d", database, str(dump_file)], check=True, env=env,
                   capture_output=True)
