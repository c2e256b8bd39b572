"""The local tracking stack on 127.0.0.1: PostgreSQL, a durable S3-compatible server, MLflow.

``proxydml stack up|down|status|backup|restore`` and the tests drive the same :class:`Stack`.
It keeps what it stores: every service keeps its data in the state folder, and ``stack up``
brings the same data back after ``down``, a crash or a reboot.

- ``db``: PostgreSQL (``services/postgres.py``), MLflow's tracking store and the auth app's
  user store. ``stack up --single-user`` uses a sqlite file instead (one user: sqlite takes
  one writer at a time), and $PROXYDML_STACK_BACKEND_STORE_URI points MLflow at a database
  the stack does not run.
- ``s3``: MinIO when a ``minio`` binary is on PATH, else OpenStack Swift with its S3 API
  (``services/swift.py``); both keep objects on disk. ``stack up`` refuses to start when
  neither is installed. moto (objects in memory) is only for throw-away test stacks
  (``s3_server="moto"``).
- ``mlflow``: ``mlflow server`` on that store with ``--artifacts-destination
  s3://BUCKET/artifacts``. The S3 endpoint and keys live only in the server's environment:
  clients upload artifacts through the server and need no S3 credentials.

With ``auth`` (``proxydml stack up --auth``) the MLflow server is stock
``mlflow server --app-name basic-auth --enable-workspaces``: every request needs a login, the
admin password is generated on first start into ``mlflow-admin.env`` (mode 0600, beside the S3
keys, never printed), and ``proxydml stack user add NAME --role ROLE`` creates users with the
roles of ``services/auth.py``. Without ``auth`` anyone who reaches the port can do anything:
that stack is for one machine only.

Everything (pid files, logs, the database, the objects, the 0600 credentials files,
``stack.json`` with the ports) lives in one state folder, default ``.proxydml/stack``. Every
server listens on 127.0.0.1 only and runs in its own session (``services/procs.py``), so
``down`` stops it with every child it spawned and the processes outlive the CLI.

:meth:`Stack.ray_storage` gives Ray Train a ``(storage_path, pyarrow S3FileSystem)`` pair on
the same S3 server. S3 clients, the retrying filesystem and the endpoint lookup live in
``services/s3.py`` (production code uses them without this module). Nothing here imports Ray
(only ``services/runtime.py`` may).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from services import auth, postgres, procs, swift
from services.net import HOST, free_port, port_in_use
from services.private_files import write_private
from services.s3 import Credentials, list_keys, ray_storage, s3_client
from services.snapshots import sha256_file
from services.uris import redact

if TYPE_CHECKING:
    import pyarrow.fs

DEFAULT_STATE_DIR = Path(".proxydml/stack")
DEFAULT_S3_PORT = 9000
DEFAULT_MLFLOW_PORT = 5000
DEFAULT_BUCKET = "proxydml"
SERVICES = ("db", "s3", "mlflow")  # start order; "db" only for a PostgreSQL store
STORES = ("postgresql", "sqlite")
S3_SERVERS = ("minio", "swift", "moto")
BACKEND_URI_ENV = "PROXYDML_STACK_BACKEND_STORE_URI"
CREDENTIALS_FILE = "credentials.env"
STATE_FILE = "stack.json"
BACKUP_MANIFEST = "backup.json"
# --auth: the admin login and the server's CSRF key (mode 0600), the auth app's config (no
# secret in it), and one MLflow credentials file per user added here.
ADMIN_FILE = "mlflow-admin.env"
AUTH_CONFIG_FILE = "basic_auth.ini"
AUTH_DB_FILE = "basic_auth.db"  # a user store of a stack started before --auth needed PostgreSQL
USERS_DIR = "users"
_FLASK_KEY_ENV = "MLFLOW_FLASK_SERVER_SECRET_KEY"
# Substrings of the command line that identify our servers: a pid file whose pid now belongs
# to an unrelated process (pid reuse after a reboot) must not be reported as up nor killed.
_CMDLINE_MARKERS = {"db": ("postgres",), "s3": ("moto", "minio", "services.swift"), "mlflow": ("mlflow",)}
# MLflow server sizing for a team's load on PostgreSQL (measured in tests/benchmarks/
# bench_tracking_load.py): 2 uvicorn workers on 2 cores, each with a 10 + 20 connection pool
# (30 s wait), well inside postgres.MAX_CONNECTIONS. sqlite serialises writers anyway: 1 worker.
MLFLOW_WORKERS = {"postgresql": 2, "sqlite": 1, "external": 1}
MLFLOW_POOL = {"MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "10", "MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW": "20"}


class StackError(RuntimeError):
    """A user-facing failure of the stack (port in use, server did not start, ...)."""


@dataclass(frozen=True)
class ServiceStatus:
    """One line of ``stack status``."""

    name: str
    running: bool
    pid: int | None
    url: str
    healthy: bool
    detail: str = ""

    def line(self) -> str:
        state = ("up" if self.healthy else "up (not answering)") if self.running else "down"
        pid = f"pid {self.pid}" if self.pid else ""
        extra = ", ".join(x for x in (self.detail, pid) if x)
        return f"{self.name:7s} {state:19s} {self.url}" + (f"  ({extra})" if extra else "")


def _http_answers(url: str, timeout: float = 1.0) -> bool:
    """Any HTTP response counts (an S3 server answers 403 to an anonymous request)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------- the stack -------------------


class Stack:
    """The local PostgreSQL + S3 + MLflow stack rooted at one state folder.

    Ports: an explicit value wins; ``None`` reuses the ports recorded by the last ``up`` in
    this state folder (so ``status``/``down`` need no flags), else the defaults 9000 / 5000
    (PostgreSQL: a free port, then kept); ``0`` picks a free port at start (tests).
    The store (``postgresql`` or ``sqlite``), the S3 server and ``auth`` are remembered the same
    way: a later plain ``up`` serves the same data with the same servers.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
        *,
        s3_port: int | None = None,
        mlflow_port: int | None = None,
        db_port: int | None = None,
        bucket: str | None = None,
        store: str | None = None,
        backend_store_uri: str | None = None,
        credentials: Credentials | None = None,
        s3_server: str | None = None,
        auth: bool | None = None,
        start_timeout: float = 120.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.state_dir = Path(state_dir).absolute()
        saved = self._load_state()
        self._ports = {
            "db": db_port if db_port is not None else int(saved.get("db_port", 0)),
            "s3": s3_port if s3_port is not None else int(saved.get("s3_port", DEFAULT_S3_PORT)),
            "mlflow": mlflow_port if mlflow_port is not None else int(saved.get("mlflow_port", DEFAULT_MLFLOW_PORT)),
        }
        self.bucket = bucket or saved.get("bucket") or DEFAULT_BUCKET
        # Not persisted: an external URI may carry a password and stack.json is not secret.
        self._external_uri = backend_store_uri or os.environ.get(BACKEND_URI_ENV)
        if store is not None and store not in STORES:
            raise StackError(f"unknown store {store!r}; expected one of {STORES}")
        # A state folder that holds a sqlite store keeps serving it (its runs live there).
        legacy = "sqlite" if (self.state_dir / "mlflow.db").exists() else None
        self.store = "external" if self._external_uri else (store or saved.get("store") or legacy or "postgresql")
        if s3_server is not None and s3_server not in S3_SERVERS:
            raise StackError(f"unknown S3 server {s3_server!r}; expected one of {S3_SERVERS}")
        self.s3_server = s3_server or saved.get("s3_server") or self._durable_s3_server()
        self._explicit_credentials = credentials
        # Like the ports, auth is remembered: a later plain ``up`` never drops authentication.
        self._saved_auth = bool(saved.get("auth", False))
        self.auth = self._saved_auth if auth is None else auth
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    @staticmethod
    def _durable_s3_server() -> str:
        """MinIO when installed, else Swift; '' when neither is (``up`` then refuses)."""
        if shutil.which("minio"):
            return "minio"
        return "swift" if swift.installed() else ""

    # -------------------------------------------------------------- properties --------------

    @property
    def services(self) -> tuple[str, ...]:
        """The services this stack runs, in start order."""
        return SERVICES if self.store == "postgresql" else SERVICES[1:]

    @property
    def s3_port(self) -> int:
        """The S3 server's port (raises StackError while a requested free port is unpicked)."""
        return self._port("s3")

    @property
    def mlflow_port(self) -> int:
        """The MLflow server's port."""
        return self._port("mlflow")

    @property
    def db_port(self) -> int:
        """PostgreSQL's port."""
        return self._port("db")

    @property
    def s3_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3-compatible server."""
        return f"http://{HOST}:{self.s3_port}"

    @property
    def tracking_uri(self) -> str:
        """``http://127.0.0.1:PORT`` of the MLflow server (what MLFLOW_TRACKING_URI should be)."""
        return f"http://{HOST}:{self.mlflow_port}"

    @property
    def backend_store_uri(self) -> str:
        """MLflow's tracking store (a PostgreSQL URI carries no password: see services/postgres.py)."""
        if self.store == "external":
            assert self._external_uri is not None
            return self._external_uri
        if self.store == "postgresql":
            return postgres.uri(self.db_port, "mlflow")
        return f"sqlite:///{self.state_dir / 'mlflow.db'}"

    @property
    def credentials(self) -> Credentials:
        """The S3 keys: those the running servers were started with, else explicit, else the
        ones this state folder was last started with, else generated keys.

        The stack's keys are its own: keys exported for another S3 (a cloud profile) are not
        taken, so a team's local server never serves under a cloud key.
        """
        saved = self._load_credentials()
        if saved is not None and (self._any_running() or self._explicit_credentials is None):
            return saved
        if self._explicit_credentials is None:
            self._explicit_credentials = (swift.generate_credentials() if self.s3_server == "swift"
                                          else Credentials.generate())
        return self._explicit_credentials

    def admin_login(self) -> tuple[str, str]:
        """(username, password) of the MLflow admin of an ``auth`` stack (from its 0600 file)."""
        values = _read_env_file(self.state_dir / ADMIN_FILE)
        if not values.get("MLFLOW_TRACKING_PASSWORD"):
            raise StackError(f"no admin login in {self.state_dir / ADMIN_FILE}: is this stack started with --auth?")
        return values.get("MLFLOW_TRACKING_USERNAME", auth.ADMIN_USERNAME), values["MLFLOW_TRACKING_PASSWORD"]

    def user_credentials_file(self, username: str) -> Path:
        """``STATE/users/NAME.credentials``: the MLflow credentials file written by :meth:`add_user`."""
        return self.state_dir / USERS_DIR / f"{auth.check_username(username)}.credentials"

    def add_user(self, username: str, role: str, *, experiments: tuple[str, ...] = (), models: tuple[str, ...] = (),
                 password: str | None = None) -> tuple[auth.UserResult, Path | None]:
        """Create or update a user of this ``auth`` stack (see :meth:`services.auth.AuthAdmin.add_user`).

        A new user without ``password`` gets a generated one. A password set here (generated or
        given) is written only to :meth:`user_credentials_file` (mode 0600, the format of
        ``~/.mlflow/credentials``). Returns the result and that file (None: password unchanged).
        """
        if not self.auth:
            raise StackError("this stack runs MLflow without authentication: it has no users "
                             "(proxydml stack down, then proxydml stack up --auth)")
        if not self.is_running("mlflow"):
            raise StackError("mlflow is not running: proxydml stack up --auth first")
        try:
            path = self.user_credentials_file(username)
            result = auth.AuthAdmin(self.tracking_uri, *self.admin_login()).add_user(
                username, role, password, experiments=experiments, models=models)
        except ValueError as exc:
            raise StackError(str(exc)) from exc
        if result.password is None:  # an existing user keeps its password
            return result, None
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_private(path, "[mlflow]\n"
                       f"mlflow_tracking_username = {username}\nmlflow_tracking_password = {result.password}\n")
        return result, path

    def pid_file(self, name: str) -> Path:
        """``STATE/<name>.pid``: present exactly while the service was started and not stopped."""
        return self.state_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        """``STATE/<name>.log``: the server's stdout and stderr, appended across restarts."""
        return self.state_dir / f"{name}.log"

    def client_env(self, with_credentials: bool = False) -> dict[str, str]:
        """What a user exports to use the stack: the tracking URI and the S3 endpoint (for Ray
        storage and boto3). Keys only when asked: MLflow clients never need them."""
        env = {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        if with_credentials:
            env.update(self.credentials.env())
        return env

    def ray_storage(self, prefix: str = "ray") -> tuple[str, pyarrow.fs.S3FileSystem]:
        """``(storage_path, filesystem)`` for Ray Train's RunConfig in this stack's bucket, with
        the stack's keys (see :func:`services.s3.ray_storage`)."""
        return ray_storage(self.s3_endpoint, self.bucket, prefix, self.credentials)

    # -------------------------------------------------------------- lifecycle ---------------

    def up(self) -> list[str]:
        """Start whatever is not running; returns one message per service. Idempotent."""
        self._check_servers()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.is_running("mlflow") and self.auth != self._saved_auth:
            raise StackError(f"mlflow is running {'without' if self._saved_auth is False else 'with'} authentication; "
                             f"stop it first (proxydml stack down --state-dir {self.state_dir})")
        # Check every port before starting anything, so a conflict leaves nothing half started.
        for name in self.services:
            if not self.is_running(name) and self._ports[name] and port_in_use(self._ports[name]):
                raise StackError(self._port_message(name))
        return [self.start_service(name) for name in self.services]

    def down(self) -> list[str]:
        """Stop MLflow, then S3, then the database (each may be mid-write for the one before)."""
        return [self.stop_service(name) for name in reversed(self.services)]

    def status(self) -> dict[str, ServiceStatus]:
        """Each service: running (pid alive), healthy (its endpoint answers), URL, and which
        server it is with where its data lives."""
        out = {}
        for name in self.services:
            pid = self._read_pid(name)
            running = pid is not None and self._is_ours(name, pid)
            healthy = running and self._healthy(name, timeout=1.0)
            out[name] = ServiceStatus(name, running, pid if running else None, self._url(name), healthy,
                                      self._detail(name))
        return out

    def _detail(self, name: str) -> str:
        if name == "db":
            return f"postgresql {postgres.version()}, data in {self.state_dir / 'postgres'}"
        if name == "s3":
            where = {"swift": f"objects in {self.state_dir / 'swift' / 'node'}",
                     "minio": f"objects in {self.state_dir / 'minio-data'}",
                     "moto": "objects in memory: lost when it stops"}
            return f"{self.s3_server}, {where.get(self.s3_server, '')}"
        if self.store == "sqlite":
            detail = f"store sqlite {self.state_dir / 'mlflow.db'} (one user)"
        else:
            detail = f"store {redact(self.backend_store_uri)}"
        return detail + (", basic-auth" if self.auth else "")

    def is_running(self, name: str) -> bool:
        """Whether the pid file names a live process that is this service's server."""
        pid = self._read_pid(name)
        return pid is not None and self._is_ours(name, pid)

    def start_service(self, name: str) -> str:
        """Start one service and wait until it answers; ``already running`` when it is."""
        self._check_name(name)
        if self.is_running(name):
            return f"{name} already running at {self._url(name)} (pid {self._read_pid(name)})"
        self._check_servers()
        self.pid_file(name).unlink(missing_ok=True)  # stale: its process is gone
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._ports[name] == 0:
            self._ports[name] = free_port()
        elif port_in_use(self._ports[name]):
            raise StackError(self._port_message(name))
        creds = self.credentials
        self._write_credentials(creds)
        self._save_state()
        cmd, env, extra = self._command(name, creds)
        log = self.log_file(name)
        started = time.monotonic()
        if name == "db":
            postgres.wait_old_server_gone(self.state_dir / "postgres")
        with log.open("ab") as fh:
            # The command line holds no secret (keys and passwords go through files and env only).
            fh.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            fh.flush()
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                cwd=self.state_dir, start_new_session=True, **extra,  # type: ignore[arg-type]
            )
        self._procs[name] = proc
        self.pid_file(name).write_text(f"{proc.pid}\n")
        try:
            self._wait_healthy(name, proc)
            if name == "db":
                postgres.ensure_databases(self.state_dir, self.db_port)
            elif name == "s3":
                self._ensure_bucket(creds)
            elif self.auth:
                auth.AuthAdmin(self.tracking_uri, *self.admin_login()).ensure_roles()
        except BaseException:
            self._terminate(name, proc.pid)
            raise
        return f"{name} started at {self._url(name)} (pid {proc.pid}) in {time.monotonic() - started:.1f} s"

    def stop_service(self, name: str) -> str:
        """Stop the service's process group (SIGKILL after ``stop_timeout``)."""
        self._check_name(name)
        pid = self._read_pid(name)
        if pid is None or not self._is_ours(name, pid):
            self.pid_file(name).unlink(missing_ok=True)
            return f"{name} not running"
        how = self._terminate(name, pid)
        return f"{name} stopped (pid {pid}{', killed' if how == 'killed' else ''})"

    def kill_service(self, name: str) -> None:
        """SIGKILL the service's whole process group, as a crash or a power cut would (tests,
        drills). The pid file stays, as it would; the next ``up`` finds it stale."""
        pid = self._read_pid(name)
        if pid is not None and self._is_ours(name, pid):
            procs.signal_group(pid, signal.SIGKILL)
            procs.wait_gone(pid, 10.0)
            if name == "s3" and self.s3_server == "swift":
                self._wait_ports_free(swift.ring_ports(self.state_dir / "swift").values())

    # -------------------------------------------------------------- backup ------------------

    def backup(self, dest: str | os.PathLike[str]) -> dict[str, Any]:
        """Copy the tracking database and every object of the bucket into ``dest`` (a new or
        empty folder), with a manifest of each object's size and sha256; returns the manifest.

        Written into ``dest.partial`` and renamed at the end: a failed backup leaves no folder
        that looks complete. The folder holds the stack's secrets (the MLflow admin login of an
        ``auth`` stack): it is created with mode 0700.
        """
        target = Path(dest).absolute()
        if target.exists() and any(target.iterdir()):
            raise StackError(f"backup folder {target} is not empty; give a new folder")
        self._require_running(("db", "s3") if self.store == "postgresql" else ("s3",), "backup")
        if self.store == "external":
            raise StackError("this stack's MLflow store is external ($PROXYDML_STACK_BACKEND_STORE_URI): back it up "
                             "with that database's own tools")
        work = target.with_name(target.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        (work / "db").mkdir(parents=True, mode=0o700)
        work.chmod(0o700)
        databases = []
        if self.store == "postgresql":
            for db in postgres.DATABASES:
                postgres.dump(self.state_dir, self.db_port, db, work / "db" / f"{db}.dump")
                databases.append(db)
        else:
            # sqlite's online backup: a consistent copy even while the server writes.
            src = sqlite3.connect(self.state_dir / "mlflow.db")
            dst = sqlite3.connect(work / "db" / "mlflow.sqlite")
            with dst:
                src.backup(dst)
            src.close()
            dst.close()
            databases.append("mlflow.sqlite")
        objects = {}
        s3 = s3_client(self.s3_endpoint, self.credentials)
        for key in list_keys(s3, self.bucket):
            path = work / "objects" / _safe_key(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(self.bucket, key, str(path))
            objects[key] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if (self.state_dir / ADMIN_FILE).exists():  # the admin login the restored user store expects
            shutil.copy2(self.state_dir / ADMIN_FILE, work / ADMIN_FILE)
        if (self.state_dir / USERS_DIR).is_dir():
            shutil.copytree(self.state_dir / USERS_DIR, work / USERS_DIR)
        manifest = {"format": 1, "store": self.store, "bucket": self.bucket, "auth": self.auth,
                    "databases": databases, "objects": objects}
        (work / BACKUP_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if target.exists():
            target.rmdir()
        work.rename(target)
        return manifest

    def restore(self, src: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a :meth:`backup` into this stack: the database is replaced, the objects are
        uploaded into the bucket (their checksums verified before anything is touched), and
        MLflow is restarted on the result. Returns the backup's manifest."""
        source = Path(src).absolute()
        try:
            manifest = json.loads((source / BACKUP_MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise StackError(f"{source} is not a stack backup (no readable {BACKUP_MANIFEST}: {exc})") from exc
        if manifest.get("store") != self.store:
            raise StackError(f"the backup holds a {manifest.get('store')} store and this stack runs {self.store}; "
                             f"restore into a stack with the same store (--single-user is sqlite)")
        for key, meta in manifest["objects"].items():  # verify everything before changing anything
            path = source / "objects" / _safe_key(key)
            if not path.is_file() or path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                raise StackError(f"backup object {key} is missing or damaged in {source}; nothing was restored")
        if manifest.get("auth") and not self.auth:
            self.auth = True
        if (source / ADMIN_FILE).exists():
            shutil.copy2(source / ADMIN_FILE, self.state_dir / ADMIN_FILE)
            (self.state_dir / ADMIN_FILE).chmod(0o600)
        if (source / USERS_DIR).is_dir():
            shutil.copytree(source / USERS_DIR, self.state_dir / USERS_DIR, dirs_exist_ok=True)
        self.stop_service("mlflow")
        for name in self.services[:-1]:
            self.start_service(name)
        if self.store == "postgresql":
            for db in manifest["databases"]:
                postgres.restore(self.state_dir, self.db_port, db, source / "db" / f"{db}.dump")
        else:
            shutil.copy2(source / "db" / "mlflow.sqlite", self.state_dir / "mlflow.db")
        s3 = s3_client(self.s3_endpoint, self.credentials)
        for key in manifest["objects"]:
            s3.upload_file(str(source / "objects" / _safe_key(key)), self.bucket, key)
        self.start_service("mlflow")
        return manifest

    # -------------------------------------------------------------- internals ---------------

    def _check_servers(self) -> None:
        """Refuse, naming what to install, rather than fall back to a store that forgets."""
        if not self.s3_server:
            raise StackError("no durable S3-compatible server is installed: the stack uses MinIO (a `minio` binary on "
                             "PATH) or OpenStack Swift (pip install swift, installed with proxydml)")
        if self.s3_server == "swift" and not swift.installed():
            raise StackError("this stack's objects are in OpenStack Swift, which is not installed: pip install swift")
        if self.store == "postgresql" and not postgres.installed():
            raise StackError(f"the stack's MLflow store is PostgreSQL, which is not installed here: "
                             f"{postgres.INSTALL_HINT}; or run a one-user stack on sqlite: proxydml stack up --single-user")
        if self.auth and self.store == "sqlite":
            raise StackError("stack up --auth serves a team and keeps its users in PostgreSQL; this stack runs sqlite "
                             "(--single-user). Back it up, then restore it into a PostgreSQL stack")

    def _require_running(self, names: tuple[str, ...], what: str) -> None:
        down = [n for n in names if not self.is_running(n)]
        if down:
            raise StackError(f"{what} needs {', '.join(down)} running: proxydml stack up --state-dir {self.state_dir}")

    @staticmethod
    def _wait_ports_free(ports: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while any(port_in_use(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _terminate(self, name: str, pid: int) -> str:
        # start_new_session made the server its group leader: pgid == pid.
        first = signal.SIGINT if name == "db" else signal.SIGTERM  # PostgreSQL: fast shutdown
        how = procs.stop_group(pid, self.stop_timeout, first)
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.poll()  # sets returncode; the pid was possibly reaped already
        self.pid_file(name).unlink(missing_ok=True)
        return how

    def _command(self, name: str, creds: Credentials) -> tuple[list[str], dict[str, str], dict[str, Any]]:
        """(command, environment, further Popen arguments) of one service."""
        if name == "db":
            try:
                postgres.initialise(self.state_dir / "postgres", self.state_dir, self.db_port)
            except (RuntimeError, PermissionError) as exc:
                raise StackError(str(exc)) from exc
            return postgres.command(self.state_dir / "postgres", self.db_port), self._base_env(), postgres.popen_user()
        if name == "s3":
            return (*self._s3_command(creds), {})
        return (*self._mlflow_command(creds), {})

    def _s3_command(self, creds: Credentials) -> tuple[list[str], dict[str, str]]:
        env = self._base_env()
        port = self._ports["s3"]
        if self.s3_server == "minio":
            data = self.state_dir / "minio-data"
            data.mkdir(exist_ok=True)
            env.update(MINIO_ROOT_USER=creds.access_key, MINIO_ROOT_PASSWORD=creds.secret_key,
                       MINIO_REGION=creds.region, MINIO_BROWSER="off")
            minio = shutil.which("minio") or "minio"
            return [minio, "server", str(data), "--address", f"{HOST}:{port}",
                    "--console-address", f"{HOST}:{free_port()}"], env
        if self.s3_server == "swift":
            root = self.state_dir / "swift"
            try:
                swift.prepare(root, port, creds)
            except ValueError as exc:
                raise StackError(str(exc)) from exc
            return swift.command(root), env
        # moto accepts any keys; it keeps objects in memory (lost when s3 restarts): tests only.
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)], env

    def _mlflow_command(self, creds: Credentials) -> tuple[list[str], dict[str, str]]:
        env = self._base_env()
        env.update(creds.env())
        env.update(
            MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint,
            # No job runner: it adds processes and memory a tracking server does not need.
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
            **MLFLOW_POOL,
        )
        if self.store == "postgresql":
            env.update(postgres.client_env(self.state_dir))
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--artifacts-destination", f"s3://{self.bucket}/artifacts",
            "--host", HOST, "--port", str(self._ports["mlflow"]), "--workers", str(MLFLOW_WORKERS[self.store]),
        ]
        if self.auth:
            cmd += ["--app-name", "basic-auth", "--enable-workspaces"]
            env.update(self._auth_server_env())
        if urlsplit(self.backend_store_uri).password:
            # A database password stays out of the command line (ps, the log header).
            env["MLFLOW_BACKEND_STORE_URI"] = self.backend_store_uri
        else:
            cmd[4:4] = ["--backend-store-uri", self.backend_store_uri]
        return cmd, env

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Never let an SDK fall back to the cloud metadata address (not loopback).
        env["AWS_EC2_METADATA_DISABLED"] = "true"
        env["MLFLOW_DISABLE_TELEMETRY"] = "true"  # the servers report nothing outside
        env["DO_NOT_TRACK"] = "true"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                    "MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD",
                    _FLASK_KEY_ENV, *auth.CREDENTIAL_ENV):
            env.pop(key, None)  # only the stack's own keys and settings reach the servers
        # No proxy for loopback (a corporate HTTP_PROXY would swallow 127.0.0.1 requests).
        env["NO_PROXY"] = env["no_proxy"] = ",".join(
            x for x in (env.get("NO_PROXY"), "127.0.0.1", "localhost") if x
        )
        return env

    def _auth_server_env(self) -> dict[str, str]:
        """The basic-auth app's settings: its config file (no secret) and, through the
        environment only, the admin password and the CSRF key, generated on first start."""
        secrets_file = self.state_dir / ADMIN_FILE
        values = _read_env_file(secrets_file)
        if not values.get("MLFLOW_TRACKING_PASSWORD"):
            if self._has_user_store():
                # MLflow creates the admin once, with the password it is given then.
                raise StackError(f"{self.state_dir} holds a user store but its admin password "
                                 f"({secrets_file}) is gone; restore that file, or delete the user store to "
                                 "start over without users")
            values = {"MLFLOW_TRACKING_USERNAME": auth.ADMIN_USERNAME,
                      "MLFLOW_TRACKING_PASSWORD": auth.generate_password(),
                      _FLASK_KEY_ENV: auth.generate_password()}
            _write_env_file(secrets_file, values)
        config = self.state_dir / AUTH_CONFIG_FILE
        config.write_text(
            "# Written by proxydml stack up --auth. No secret here: the admin password reaches the server\n"
            "# through MLFLOW_AUTH_ADMIN_PASSWORD (see mlflow-admin.env, mode 0600).\n"
            "[mlflow]\n"
            # Members of the workspace (trainers, maintainers) read what they are not granted;
            # readers hold explicit READ grants and no membership (services/auth.py).
            "default_permission = READ\n"
            f"database_uri = {self._auth_database_uri()}\n"
            f"admin_username = {values.get('MLFLOW_TRACKING_USERNAME', auth.ADMIN_USERNAME)}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "grant_default_workspace_access = false\n"
            # A verified login is remembered for 60 s (per server worker; we run one): each
            # check is a scrypt hash, measured ~0.4 s of CPU per request here without it.
            # Password and user changes through the API take effect at once all the same.
            "auth_cache_ttl_seconds = 60\n"
        )
        return {"MLFLOW_AUTH_CONFIG_PATH": str(config),
                "MLFLOW_AUTH_ADMIN_PASSWORD": values["MLFLOW_TRACKING_PASSWORD"],
                _FLASK_KEY_ENV: values.get(_FLASK_KEY_ENV) or auth.generate_password()}

    def _has_user_store(self) -> bool:
        """Whether the auth app already created its users (it creates the admin only once)."""
        if self.store == "postgresql":
            return postgres.has_table(self.state_dir, self.db_port, "mlflow_auth", "users")
        return (self.state_dir / AUTH_DB_FILE).exists()

    def _auth_database_uri(self) -> str:
        if self.store == "postgresql":  # no password in the URI: libpq reads $PGPASSFILE
            return postgres.uri(self.db_port, "mlflow_auth")
        return f"sqlite:///{self.state_dir / AUTH_DB_FILE}"  # an external store keeps the old layout

    def _wait_healthy(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"{name} exited with code {proc.returncode} while starting; "
                    f"last lines of {self.log_file(name)}:\n{procs.tail(self.log_file(name))}"
                )
            if self._healthy(name, timeout=1.0):
                return
            time.sleep(0.25)
        raise StackError(
            f"{name} did not answer at {self._url(name)} within {self.start_timeout:.0f} s; "
            f"last lines of {self.log_file(name)}:\n{procs.tail(self.log_file(name))}"
        )

    def _healthy(self, name: str, timeout: float) -> bool:
        if name == "db":
            return postgres.healthy(self.state_dir, self.db_port, timeout)
        if name == "mlflow":
            try:
                with urllib.request.urlopen(f"{self.tracking_uri}/health", timeout=timeout) as r:
                    return r.status == 200
            except (OSError, ValueError):
                return False
        if self.s3_server == "minio":
            return _http_answers(f"{self.s3_endpoint}/minio/health/live", timeout)
        if self.s3_server == "swift":
            try:
                with urllib.request.urlopen(f"{self.s3_endpoint}/healthcheck", timeout=timeout) as r:
                    return r.status == 200
            except (OSError, ValueError):
                return False
        return _http_answers(f"{self.s3_endpoint}/", timeout)

    def _ensure_bucket(self, creds: Credentials) -> None:
        s3 = s3_client(self.s3_endpoint, creds)
        try:
            s3.head_bucket(Bucket=self.bucket)
        except s3.exceptions.ClientError:
            s3.create_bucket(Bucket=self.bucket)

    def _any_running(self) -> bool:
        return any(self.is_running(n) for n in self.services)

    def _is_ours(self, name: str, pid: int) -> bool:
        if not procs.pid_alive(pid):
            return False
        cmdline = procs.cmdline(pid)
        return not cmdline or any(m in cmdline for m in _CMDLINE_MARKERS[name])

    def _read_pid(self, name: str) -> int | None:
        try:
            return int(self.pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None

    def _port(self, name: str) -> int:
        if self._ports[name] == 0:
            raise StackError(f"{name} has no port yet: it is picked when the service starts")
        return self._ports[name]

    def _url(self, name: str) -> str:
        if name == "db":
            return f"postgresql://{HOST}:{self._ports['db']}"
        return self.s3_endpoint if name == "s3" else self.tracking_uri

    def _port_message(self, name: str) -> str:
        flag = "--s3-port" if name == "s3" else "--mlflow-port"
        return (f"port {self._ports[name]} on {HOST} is already in use by another process, so {name} "
                f"cannot start; stop that process or choose another port ({flag} N)")

    def _check_name(self, name: str) -> None:
        if name not in self.services:
            raise ValueError(f"unknown service {name!r}; this stack runs {self.services}")

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        # Only non-secret facts: ports, bucket, server kinds.
        state = {"s3_port": self._ports["s3"], "mlflow_port": self._ports["mlflow"], "db_port": self._ports["db"],
                 "bucket": self.bucket, "s3_server": self.s3_server, "auth": self.auth}
        if self.store != "external":
            state["store"] = self.store
        self._saved_auth = self.auth
        (self.state_dir / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    def _load_credentials(self) -> Credentials | None:
        path = self.state_dir / CREDENTIALS_FILE
        return Credentials.from_env(_read_env_file(path)) if path.exists() else None

    def _write_credentials(self, creds: Credentials) -> None:
        _write_env_file(self.state_dir / CREDENTIALS_FILE, creds.env())


def _safe_key(key: str) -> str:
    """An object key as a relative path inside a backup (a key that climbs out is refused)."""
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts) or not parts:
        raise StackError(f"object key {key!r} cannot be stored as a file; rename it before backing up")
    return "/".join(parts) + ("/.object" if key.endswith("/") else "")


def _write_env_file(path: Path, values: dict[str, str]) -> None:
    """A shell-sourceable ``export KEY=VALUE`` file, mode 0600 (the stack's secrets files)."""
    write_private(path, "".join(f"export {k}={v}\n" for k, v in values.items()))


def _read_env_file(path: Path) -> dict[str, str]:
    """The KEY=VALUE pairs of a file written by :func:`_write_env_file` ({} when missing)."""
    values = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            values[key.strip()] = value.strip()
    except OSError:
        return {}
    return values


# ---------------------------------------------------------------- CLI -------------------------


def cli(action: str, state_dir: str | None = None, s3_port: int | None = None,
        mlflow_port: int | None = None, *, auth_on: bool = False, single_user: bool = False,
        folder: str | None = None) -> int:
    """``proxydml stack up [--auth] [--single-user]|down|status|backup DIR|restore DIR``;
    returns the exit code (errors raise StackError).

    ``auth_on``: ``up --auth``; without it ``up`` keeps what this state folder had.
    ``single_user``: a new stack on sqlite instead of PostgreSQL.
    """
    if single_user and auth_on:
        raise StackError("--auth serves a team and needs PostgreSQL; --single-user is sqlite: choose one")
    stack = Stack(state_dir or DEFAULT_STATE_DIR, s3_port=s3_port, mlflow_port=mlflow_port,
                  auth=True if auth_on else None, store="sqlite" if single_user else None)
    if action == "up":
        started = time.monotonic()
        for msg in stack.up():
            print(msg, flush=True)
        print(f"stack up in {time.monotonic() - started:.1f} s; state in {stack.state_dir}")
        if stack.store == "sqlite":
            print("# sqlite store: for one user (it takes one writer at a time); a team runs PostgreSQL "
                  "(the default without --single-user)")
        if stack.s3_server == "moto":
            print("# moto keeps objects in memory: they are lost when the stack stops")
        if stack.auth:
            print("\n# MLflow asks every client for a login (basic auth). The admin login is in "
                  f"{stack.state_dir / ADMIN_FILE} (mode 0600; the password is not shown).")
            print("# Add users:  proxydml stack user add NAME --role reader|trainer|maintainer "
                  f"(their login: {stack.state_dir / USERS_DIR}/NAME.credentials, mode 0600)")
            print("# Clients read MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, else ~/.mlflow/credentials.")
        else:
            print("\n# No authentication: anyone who reaches the port can do anything. For this machine only;"
                  " a team uses: proxydml stack up --auth")
        print("\n# MLflow clients need only the tracking URI (artifacts go through the server):")
        for key, value in stack.client_env().items():
            print(f"export {key}={value}")
        print("# Ray checkpoints in the same bucket: the endpoint, the keys (mode 0600 file), then")
        print(f"export AWS_ENDPOINT_URL={stack.s3_endpoint}")
        print(f". {stack.state_dir / CREDENTIALS_FILE}")
        print(f"#   proxydml train tracking.storage_path=s3://{stack.bucket}/ray")
        return 0
    if action == "down":
        for msg in stack.down():
            print(msg)
        return 0
    if action == "status":
        statuses = stack.status().values()
        for st in statuses:
            print(st.line())
        return 0 if all(st.healthy for st in statuses) else 3
    if action == "backup":
        assert folder is not None
        started = time.monotonic()
        manifest = stack.backup(folder)
        size = sum(o["size"] for o in manifest["objects"].values())
        print(f"backup of {stack.state_dir} in {folder}: {', '.join(manifest['databases'])} and "
              f"{len(manifest['objects'])} objects ({size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s")
        return 0
    if action == "restore":
        assert folder is not None
        started = time.monotonic()
        manifest = stack.restore(folder)
        print(f"restored {folder} into {stack.state_dir}: {', '.join(manifest['databases'])} and "
              f"{len(manifest['objects'])} objects in {time.monotonic() - started:.1f} s")
        for st in stack.status().values():
            print(st.line())
        return 0
    raise ValueError(f"unknown stack action {action!r}")


def cli_user_add(state_dir: str | None, username: str, role: str, *, experiments: list[str] | None = None,
                 models: list[str] | None = None, tracking_uri: str | None = None,
                 password_env: str | None = None) -> int:
    """``proxydml stack user add NAME --role ROLE``: on this stack (admin login from its 0600
    file), or on the basic-auth server at ``tracking_uri`` (admin login from the environment).

    ``password_env``: take the password from that environment variable instead of generating
    one (never from the command line, where ``ps`` and shell history would show it).
    """
    password = None
    if password_env:
        password = os.environ.get(password_env)
        if not password:
            raise StackError(f"--password-env {password_env}: ${password_env} is not set")
    if tracking_uri:
        try:
            result = auth.AuthAdmin(tracking_uri).add_user(username, role, password, experiments=experiments or (),
                                                           models=models or (), generate=False)
        except ValueError as exc:
            raise StackError(str(exc)) from exc
        path = None
    else:
        stack = Stack(state_dir or DEFAULT_STATE_DIR)
        result, path = stack.add_user(username, role, experiments=tuple(experiments or ()),
                                      models=tuple(models or ()), password=password)
    print(f"user {result.username}: {'created' if result.created else 'updated'}, role {result.role} "
          f"({auth.ROLES[result.role].summary})")
    for grant in result.grants:
        print(f"  grant: {grant}")
    if path is not None:
        print(f"  login: {path} (mode 0600; hand it over, the user copies it to ~/.mlflow/credentials)")
    elif result.password is not None:
        print(f"  password: set from ${password_env}")
    else:
        print("  password unchanged")
    return 0
