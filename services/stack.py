"""The local tracking stack: an S3-compatible server and an MLflow server on 127.0.0.1.

``proxydml stack up|down|status`` and the tests drive the same :class:`Stack`:

- ``s3``: MinIO when a ``minio`` binary is on PATH, else moto's standalone S3 server (PyPI);
  the bucket is created with boto3 once the endpoint answers.
- ``mlflow``: ``mlflow server`` with a sqlite store under the state folder (or the URI in
  $PROXYDML_STACK_BACKEND_STORE_URI, e.g. PostgreSQL) and ``--artifacts-destination
  s3://BUCKET/artifacts``. The S3 endpoint and keys live only in the server's environment:
  clients upload artifacts through the server and need no S3 credentials.

With ``auth`` (``proxydml stack up --auth``) the MLflow server is stock
``mlflow server --app-name basic-auth --enable-workspaces``: every request needs a login, the
admin password is generated on first start into ``mlflow-admin.env`` (mode 0600, beside the S3
keys, never printed), and ``proxydml stack user add NAME --role ROLE`` creates users with the
roles of ``services/auth.py``. Without ``auth`` anyone who reaches the port can do anything:
that stack is for one machine only.

Everything (pid files, logs, the sqlite store, the 0600 credentials files, ``stack.json`` with
the ports) lives in one state folder, default ``.proxydml/stack``. Every server listens on
127.0.0.1 only. Each service runs in its own session (process group), so ``down`` stops the
server with every child it spawned (MLflow's uvicorn) and the processes outlive the CLI.

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
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from services import auth
from services.net import HOST, free_port, port_in_use
from services.s3 import Credentials, ray_storage, s3_client
from services.uris import redact

if TYPE_CHECKING:
    import pyarrow.fs

DEFAULT_STATE_DIR = Path(".proxydml/stack")
DEFAULT_S3_PORT = 9000
DEFAULT_MLFLOW_PORT = 5000
DEFAULT_BUCKET = "proxydml"
SERVICES = ("s3", "mlflow")
BACKEND_URI_ENV = "PROXYDML_STACK_BACKEND_STORE_URI"
CREDENTIALS_FILE = "credentials.env"
STATE_FILE = "stack.json"
# --auth: the admin login and the server's CSRF key (mode 0600), the auth app's config (no
# secret in it), its user store, and one MLflow credentials file per user added here.
ADMIN_FILE = "mlflow-admin.env"
AUTH_CONFIG_FILE = "basic_auth.ini"
AUTH_DB_FILE = "basic_auth.db"
USERS_DIR = "users"
_FLASK_KEY_ENV = "MLFLOW_FLASK_SERVER_SECRET_KEY"
# Substrings of the command line that identify our servers: a pid file whose pid now belongs
# to an unrelated process (pid reuse after a reboot) must not be reported as up nor killed.
_CMDLINE_MARKERS = {"s3": ("moto", "minio"), "mlflow": ("mlflow",)}


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


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- processes -------------------


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


def _pid_alive(pid: int) -> bool:
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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_group_alive(pgid):
            return True
        time.sleep(0.1)
    return not process_group_alive(pgid)


# ---------------------------------------------------------------- the stack -------------------


class Stack:
    """The local S3 + MLflow stack rooted at one state folder.

    Ports: an explicit value wins; ``None`` reuses the ports recorded by the last ``up`` in
    this state folder (so ``status``/``down`` need no flags), else the defaults 9000 / 5000;
    ``0`` picks a free port at start (tests).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
        *,
        s3_port: int | None = None,
        mlflow_port: int | None = None,
        bucket: str | None = None,
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
            "s3": s3_port if s3_port is not None else int(saved.get("s3_port", DEFAULT_S3_PORT)),
            "mlflow": mlflow_port if mlflow_port is not None else int(saved.get("mlflow_port", DEFAULT_MLFLOW_PORT)),
        }
        self.bucket = bucket or saved.get("bucket") or DEFAULT_BUCKET
        # Not persisted: a PostgreSQL URI carries a password and stack.json is not secret.
        self.backend_store_uri = (
            backend_store_uri or os.environ.get(BACKEND_URI_ENV) or f"sqlite:///{self.state_dir / 'mlflow.db'}"
        )
        self._explicit_credentials = credentials
        self.s3_server = s3_server or saved.get("s3_server") or ("minio" if shutil.which("minio") else "moto")
        # Like the ports, auth is remembered: a later plain ``up`` never drops authentication.
        self._saved_auth = bool(saved.get("auth", False))
        self.auth = self._saved_auth if auth is None else auth
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -------------------------------------------------------------- properties --------------

    @property
    def s3_port(self) -> int:
        """The S3 server's port (raises StackError while a requested free port is unpicked)."""
        return self._port("s3")

    @property
    def mlflow_port(self) -> int:
        """The MLflow server's port."""
        return self._port("mlflow")

    @property
    def s3_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3-compatible server."""
        return f"http://{HOST}:{self.s3_port}"

    @property
    def tracking_uri(self) -> str:
        """``http://127.0.0.1:PORT`` of the MLflow server (what MLFLOW_TRACKING_URI should be)."""
        return f"http://{HOST}:{self.mlflow_port}"

    @property
    def credentials(self) -> Credentials:
        """The S3 keys: those the running servers were started with, else explicit, else
        $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY, else generated test keys."""
        if self._any_running():
            saved = self._load_credentials()
            if saved is not None:
                return saved
        creds = self._explicit_credentials or Credentials.from_env() or self._load_credentials()
        if creds is None:
            creds = Credentials.generate()
        self._explicit_credentials = self._explicit_credentials or creds  # stable for this object
        return creds

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
        _write_private(path, "[mlflow]\n"
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
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.is_running("mlflow") and self.auth != self._saved_auth:
            raise StackError(f"mlflow is running {'without' if self._saved_auth is False else 'with'} authentication; "
                             f"stop it first (proxydml stack down --state-dir {self.state_dir})")
        # Check every port before starting anything, so a conflict leaves nothing half started.
        for name in SERVICES:
            if not self.is_running(name) and self._ports[name] and port_in_use(self._ports[name]):
                raise StackError(self._port_message(name))
        return [self.start_service(name) for name in SERVICES]

    def down(self) -> list[str]:
        """Stop MLflow then S3 (MLflow may be mid-upload); removes the pid files."""
        return [self.stop_service(name) for name in reversed(SERVICES)]

    def status(self) -> dict[str, ServiceStatus]:
        """Each service: running (pid alive), healthy (its endpoint answers) and URL."""
        out = {}
        for name in SERVICES:
            pid = self._read_pid(name)
            running = pid is not None and self._is_ours(name, pid)
            url = self.s3_endpoint if name == "s3" else self.tracking_uri
            healthy = running and self._healthy(name, timeout=1.0)
            detail = self.s3_server if name == "s3" else f"store {redact(self.backend_store_uri)}"
            if name == "mlflow" and self.auth:
                detail += ", basic-auth"
            out[name] = ServiceStatus(name, running, pid if running else None, url, healthy, detail)
        return out

    def is_running(self, name: str) -> bool:
        """Whether the pid file names a live process that is this service's server."""
        pid = self._read_pid(name)
        return pid is not None and self._is_ours(name, pid)

    def start_service(self, name: str) -> str:
        """Start one service and wait until it answers; ``already running`` when it is."""
        self._check_name(name)
        if self.is_running(name):
            return f"{name} already running at {self._url(name)} (pid {self._read_pid(name)})"
        self.pid_file(name).unlink(missing_ok=True)  # stale: its process is gone
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._ports[name] == 0:
            self._ports[name] = free_port()
        elif port_in_use(self._ports[name]):
            raise StackError(self._port_message(name))
        creds = self.credentials
        self._write_credentials(creds)
        self._save_state()
        cmd, env = self._s3_command(creds) if name == "s3" else self._mlflow_command(creds)
        log = self.log_file(name)
        started = time.monotonic()
        with log.open("ab") as fh:
            # The command line holds no secret (keys go through the environment only).
            fh.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            fh.flush()
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                cwd=self.state_dir, start_new_session=True,
            )
        self._procs[name] = proc
        self.pid_file(name).write_text(f"{proc.pid}\n")
        try:
            self._wait_healthy(name, proc)
            if name == "s3":
                self._ensure_bucket(creds)
            elif self.auth:
                auth.AuthAdmin(self.tracking_uri, *self.admin_login()).ensure_roles()
        except BaseException:
            self._terminate(name, proc.pid)
            raise
        return f"{name} started at {self._url(name)} (pid {proc.pid}) in {time.monotonic() - started:.1f} s"

    def stop_service(self, name: str) -> str:
        """SIGTERM to the service's process group, SIGKILL after ``stop_timeout``."""
        self._check_name(name)
        pid = self._read_pid(name)
        if pid is None or not self._is_ours(name, pid):
            self.pid_file(name).unlink(missing_ok=True)
            return f"{name} not running"
        how = self._terminate(name, pid)
        return f"{name} stopped (pid {pid}{', killed' if how == 'killed' else ''})"

    # -------------------------------------------------------------- internals ---------------

    def _terminate(self, name: str, pid: int) -> str:
        # start_new_session made the server its group leader: pgid == pid.
        _signal_group(pid, signal.SIGTERM)
        how = "terminated"
        if not _wait_gone(pid, self.stop_timeout):
            _signal_group(pid, signal.SIGKILL)
            how = "killed"
            _wait_gone(pid, 5.0)
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.poll()  # sets returncode; the pid was possibly reaped by _reap already
        self.pid_file(name).unlink(missing_ok=True)
        return how

    def _s3_command(self, creds: Credentials) -> tuple[list[str], dict[str, str]]:
        env = self._base_env()
        port = self._ports["s3"]
        if self.s3_server == "minio":
            data = self.state_dir / "minio-data"
            data.mkdir(exist_ok=True)
            env.update(MINIO_ROOT_USER=creds.access_key, MINIO_ROOT_PASSWORD=creds.secret_key,
                       MINIO_REGION=creds.region, MINIO_BROWSER="off")
            minio = shutil.which("minio") or "minio"
            cmd = [minio, "server", str(data), "--address", f"{HOST}:{port}",
                   "--console-address", f"{HOST}:{free_port()}"]
        else:
            # moto accepts any keys; it keeps objects in memory (lost when s3 restarts).
            cmd = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
        return cmd, env

    def _mlflow_command(self, creds: Credentials) -> tuple[list[str], dict[str, str]]:
        env = self._base_env()
        env.update(creds.env())
        env.update(
            MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint,
            # One worker and no job runner: 12 s and ~0.4 GB instead of 27 s and 2.4 GB (STACK.md).
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        )
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--artifacts-destination", f"s3://{self.bucket}/artifacts",
            "--host", HOST, "--port", str(self._ports["mlflow"]), "--workers", "1",
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
            if (self.state_dir / AUTH_DB_FILE).exists():
                # MLflow creates the admin once, with the password it is given then.
                raise StackError(f"{self.state_dir / AUTH_DB_FILE} exists but its admin password "
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
            f"database_uri = sqlite:///{self.state_dir / AUTH_DB_FILE}\n"
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

    def _wait_healthy(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"{name} exited with code {proc.returncode} while starting; "
                    f"last lines of {self.log_file(name)}:\n{_tail(self.log_file(name))}"
                )
            if self._healthy(name, timeout=1.0):
                return
            time.sleep(0.25)
        raise StackError(
            f"{name} did not answer at {self._url(name)} within {self.start_timeout:.0f} s; "
            f"last lines of {self.log_file(name)}:\n{_tail(self.log_file(name))}"
        )

    def _healthy(self, name: str, timeout: float) -> bool:
        if name == "mlflow":
            try:
                with urllib.request.urlopen(f"{self.tracking_uri}/health", timeout=timeout) as r:
                    return r.status == 200
            except (OSError, ValueError):
                return False
        if self.s3_server == "minio":
            return _http_answers(f"{self.s3_endpoint}/minio/health/live", timeout)
        return _http_answers(f"{self.s3_endpoint}/", timeout)

    def _ensure_bucket(self, creds: Credentials) -> None:
        s3 = s3_client(self.s3_endpoint, creds)
        try:
            s3.head_bucket(Bucket=self.bucket)
        except s3.exceptions.ClientError:
            s3.create_bucket(Bucket=self.bucket)

    def _any_running(self) -> bool:
        return any(self.is_running(n) for n in SERVICES)

    def _is_ours(self, name: str, pid: int) -> bool:
        if not _pid_alive(pid):
            return False
        cmdline = _cmdline(pid)
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
        return self.s3_endpoint if name == "s3" else self.tracking_uri

    def _port_message(self, name: str) -> str:
        flag = "--s3-port" if name == "s3" else "--mlflow-port"
        return (f"port {self._ports[name]} on {HOST} is already in use by another process, so {name} "
                f"cannot start; stop that process or choose another port ({flag} N)")

    @staticmethod
    def _check_name(name: str) -> None:
        if name not in SERVICES:
            raise ValueError(f"unknown service {name!r}; expected one of {SERVICES}")

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        # Only non-secret facts: ports, bucket, server kind.
        state = {"s3_port": self._ports["s3"], "mlflow_port": self._ports["mlflow"],
                 "bucket": self.bucket, "s3_server": self.s3_server, "auth": self.auth}
        self._saved_auth = self.auth
        (self.state_dir / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    def _load_credentials(self) -> Credentials | None:
        path = self.state_dir / CREDENTIALS_FILE
        return Credentials.from_env(_read_env_file(path)) if path.exists() else None

    def _write_credentials(self, creds: Credentials) -> None:
        _write_env_file(self.state_dir / CREDENTIALS_FILE, creds.env())


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` with mode 0600 from creation on (never world-readable, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)  # an older file may have had wider bits


def _write_env_file(path: Path, values: dict[str, str]) -> None:
    """A shell-sourceable ``export KEY=VALUE`` file, mode 0600 (the stack's secrets files)."""
    _write_private(path, "".join(f"export {k}={v}\n" for k, v in values.items()))


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
        mlflow_port: int | None = None, *, auth_on: bool = False) -> int:
    """``proxydml stack up [--auth]|down|status``; returns the exit code (errors raise StackError).

    ``auth_on``: ``up --auth``; without it ``up`` keeps what this state folder had.
    """
    stack = Stack(state_dir or DEFAULT_STATE_DIR, s3_port=s3_port, mlflow_port=mlflow_port,
                  auth=True if auth_on else None)
    if action == "up":
        started = time.monotonic()
        for msg in stack.up():
            print(msg, flush=True)
        print(f"stack up in {time.monotonic() - started:.1f} s; state in {stack.state_dir}")
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
