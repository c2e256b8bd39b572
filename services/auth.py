"""Who may do what on the MLflow tracking server: roles, users, logins and clear refusals.

The server is stock MLflow: ``mlflow server --app-name basic-auth --enable-workspaces``
(the ``mlflow[auth]`` extra). Nothing here re-implements authentication; this module

- defines ProxyDML's three roles as MLflow RBAC roles in the ``default`` workspace
  (:data:`ROLES`) and adds users to them (:class:`AuthAdmin`, ``proxydml stack user add``);
- reads the login the way every MLflow client does -- $MLFLOW_TRACKING_USERNAME /
  $MLFLOW_TRACKING_PASSWORD, else ``[mlflow]`` in ``~/.mlflow/credentials`` -- never from a
  config that gets logged (:func:`current_user`, :func:`worker_credentials`);
- turns a 401 or 403 into one line that names the user and the missing permission
  (:class:`AuthError`, :func:`guard`, :func:`require_permission`). A refusal is never an
  outage: callers raise it at once instead of retrying.

Why workspaces are on: without them MLflow lets *every* authenticated user create
experiments and registered models (and become their owner), so a "reader" could still log
runs into an experiment of its own, or register a model name before its maintainers do. With
them, creating anything needs the workspace-wide ``USE`` grant, which readers do not get.

What MLflow cannot express: a version created in a registered model and an alias moved on it
need the same permission (``EDIT`` on the model). So a trainer gets ``READ`` on the models
its maintainers own (it cannot register into them, and cannot move ``champion``) and proposes
candidates of model NAME as versions of a second registered model, ``NAME.candidates``
(:func:`candidates_model`; ``EDIT`` there via ``stack user add --role trainer --model NAME``).
A maintainer serves one by copying it into NAME (``proxydml models promote``).

Importing this module is cheap (MLflow is imported inside the functions that talk to a
server): ``services/cli.py`` imports it on every command.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from services.uris import redact

EXIT_NOPERM = 77  # sysexits EX_NOPERM: "permission denied" -- what a cron wrapper should see
ADMIN_USERNAME = "admin"
WORKSPACE = "default"  # MLflow's default workspace: clients that name none use it
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
CREDENTIALS_HINT = ("export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or put them under [mlflow] "
                    "in ~/.mlflow/credentials")
# MLflow's permission levels, weakest first (DENY and NO_PERMISSIONS grant nothing).
LEVELS = ("NO_PERMISSIONS", "READ", "USE", "EDIT", "MANAGE")
CANDIDATES_SUFFIX = ".candidates"
_USERNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


def candidates_model(name: str) -> str:
    """The registered model where trainers propose versions of model ``name``."""
    return f"{name}{CANDIDATES_SUFFIX}"


@dataclass(frozen=True)
class Role:
    """One ProxyDML role: an MLflow role ``proxydml-<name>`` holding ``grants``.

    ``grants`` are ``(resource_type, pattern, permission)``; per-user grants for named
    experiments or models are added by :meth:`AuthAdmin.add_user`.
    """

    name: str
    summary: str
    grants: tuple[tuple[str, str, str], ...]

    @property
    def mlflow_name(self) -> str:
        return f"proxydml-{self.name}"


_READ_ALL = (("experiment", "*", "READ"), ("registered_model", "*", "READ"))
# workspace USE = may create experiments and models (and owns what it creates).
ROLES: dict[str, Role] = {
    "reader": Role("reader", "views every experiment, run and model; creates and changes nothing", _READ_ALL),
    "trainer": Role("trainer", "creates runs in its experiments (created by it, or given with --experiment); "
                    "proposes candidates of --model NAME (EDIT on NAME.candidates); registers versions "
                    "in no model it did not create", (("workspace", "*", "USE"), *_READ_ALL)),
    "maintainer": Role("maintainer", "registers versions and moves aliases (MANAGE on --model, default every "
                       "model); runs retraining in any experiment",
                       (("workspace", "*", "USE"), ("experiment", "*", "EDIT"), ("registered_model", "*", "READ"))),
}


class AuthError(RuntimeError):
    """MLflow refused a request (401 or 403). The message is one line naming the user and what
    is missing; ``proxydml`` prints it and exits with :data:`EXIT_NOPERM`."""

    exit_code = EXIT_NOPERM


# ---------------------------------------------------------------- logins ----------------------


def current_user() -> str | None:
    """The MLflow username of this process: the environment, else ``~/.mlflow/credentials``."""
    from mlflow.utils.credentials import read_mlflow_creds

    return read_mlflow_creds().username or None


def worker_credentials() -> dict[str, str]:
    """This process's MLflow login as environment variables, for the processes it starts.

    Read with MLflow's own lookup (environment, else ``~/.mlflow/credentials``), so a Ray
    worker logs as the user who opened the run, wherever its node is. Empty without a login.
    """
    from mlflow.utils.credentials import read_mlflow_creds

    creds = read_mlflow_creds()
    env = {"MLFLOW_TRACKING_USERNAME": creds.username, "MLFLOW_TRACKING_PASSWORD": creds.password,
           "MLFLOW_TRACKING_TOKEN": os.environ.get("MLFLOW_TRACKING_TOKEN")}
    return {k: v for k, v in env.items() if v}


def use_credentials(env: Mapping[str, str]) -> None:
    """Make ``env`` (from :func:`worker_credentials`) this process's MLflow login.

    Process-local: it changes ``os.environ`` of the calling worker only, and nothing logs it.
    """
    os.environ.update({k: v for k, v in env.items() if k in CREDENTIAL_ENV})


def check_username(name: str) -> str:
    """A plain user name (it is also a file name under the stack's ``users/`` folder)."""
    if not _USERNAME_RE.match(name or ""):
        raise ValueError(f"user name {name!r} must be 1-64 characters of letters, digits, '.', '_', '@' or '-'")
    return name


def generate_password() -> str:
    """A fresh random password (~144 bits)."""
    return secrets.token_urlsafe(18)


# ---------------------------------------------------------------- refusals --------------------


def auth_status(exc: BaseException) -> int | None:
    """401 or 403 when ``exc`` (or what caused it) is MLflow refusing the login, else None.

    MLflow's REST client raises ``MlflowException`` with ``UNAUTHENTICATED`` or
    ``PERMISSION_DENIED``; the artifact proxy raises ``requests.HTTPError``.
    """
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        code = getattr(current, "error_code", None)
        if code == "UNAUTHENTICATED":
            return 401
        if code == "PERMISSION_DENIED":
            return 403
        status = getattr(getattr(current, "response", None), "status_code", None)
        if status in (401, 403):
            return int(status)
        current, seen = current.__cause__ or current.__context__, seen + 1
    return None


@dataclass(frozen=True)
class Need:
    """What a refused request needed: ``permission`` on ``resource`` to ``purpose``; ``grant``
    is the ``stack user add`` arguments that give it (empty: none to suggest)."""

    permission: str
    resource: str
    purpose: str
    grant: str = ""


def refusal(status: int, uri: str, need: Need | None, user: str | None = None, detail: str = "") -> AuthError:
    """The one-line :class:`AuthError` for a 401/403 from the server at ``uri`` (``detail``:
    what was refused, when no :class:`Need` says it)."""
    user = user if user is not None else current_user()
    where = f"MLflow at {redact(uri)}" if uri else "the MLflow server"
    if status == 401:
        if not user:
            return AuthError(f"{where} requires a login (401) and no credentials are set: {CREDENTIALS_HINT}")
        return AuthError(f"{where} did not accept the password of user {user!r} (401): check "
                         "MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials")
    if need is None:
        return AuthError(f"{where} refused user {user!r} (403 permission denied){' ' + detail if detail else ''}; "
                         f"ask an admin for the permission: proxydml stack user add {user} --role ROLE")
    line = f"{where} refused user {user!r} (403): {need.permission} permission on {need.resource} is needed to {need.purpose}"
    if need.grant:
        line += f"; an admin grants it with: proxydml stack user add {user} {need.grant}"
    return AuthError(line)


def as_auth_error(exc: BaseException) -> AuthError | None:
    """``exc`` as an :class:`AuthError` when it is a 401/403 (else None): the CLI's last resort
    for a refusal no call site explained, named by the REST endpoint that was refused."""
    if isinstance(exc, AuthError):
        return exc
    status = auth_status(exc)
    if status is None:
        return None
    if status == 401:
        return refusal(401, "", None)
    endpoint = re.search(r"endpoint (\S+)", str(exc))
    return refusal(403, "", None, detail=f"calling {endpoint.group(1)}" if endpoint else "")


@contextmanager
def guard(uri: str, need: Need) -> Iterator[None]:
    """Inside: a 401/403 from MLflow becomes the :class:`AuthError` naming ``need``."""
    try:
        yield
    except AuthError:
        raise
    except Exception as exc:
        status = auth_status(exc)
        if status is None:
            raise
        raise refusal(status, uri, need) from exc


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def permission_of(uri: str, resource_type: str, resource_id: str, user: str) -> str | None:
    """``user``'s effective permission on one resource, as the server resolves it; None when
    the server has no basic-auth app (nothing to check). 401 raises :class:`AuthError`."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    resp = http_request(get_default_host_creds(uri), "/api/3.0/mlflow/users/permissions/get", "GET",
                        max_retries=0, timeout=30, params={"username": user, "resource_type": resource_type,
                                                            "resource_id": resource_id})
    if resp.status_code in (401, 403):
        raise refusal(resp.status_code, uri, None, user)
    try:
        return str(resp.json()["permission"]) if resp.status_code == 200 else None
    except (ValueError, KeyError):  # not the auth app's answer (a 404 page): no authentication
        return None


def is_admin(uri: str, user: str) -> bool:
    """Whether ``user`` is an MLflow admin (admins bypass every permission check)."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    resp = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/users/get", "GET", max_retries=0,
                        timeout=30, params={"username": user})
    return resp.status_code == 200 and bool(resp.json().get("user", {}).get("is_admin"))


def require_permission(uri: str, resource_type: str, resource_id: str, level: str, need: Need) -> None:
    """Refuse now (:class:`AuthError`) when this login holds less than ``level`` on an
    existing resource, before any work that would fail on it later (training, a lock).

    Passes for a local store, a server without authentication and MLflow admins. Without a
    login it passes too: the first real request then answers 401, which callers report.
    """
    if not _is_remote(uri):
        return
    user = current_user()
    if not user:
        return
    have = permission_of(uri, resource_type, resource_id, user)
    if have is None or LEVELS.index(have if have in LEVELS else "NO_PERMISSIONS") >= LEVELS.index(level):
        return
    if is_admin(uri, user):
        return
    raise refusal(403, uri, need, user)


# ---------------------------------------------------------------- administration -------------


def _admin_client(uri: str, username: str | None, password: str | None) -> Any:
    """MLflow's ``AuthServiceClient`` logged in as the given admin (else this process's login)."""
    import warnings

    with warnings.catch_warnings():  # the server package's import-time deprecation noise (Starlette's)
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import MlflowHostCreds, http_request, verify_rest_response

    class _Client(AuthServiceClient):
        # The stock client reads the login from the environment; the stack's admin login
        # lives in a 0600 file and must not be put into this process's environment.
        def _request(self, endpoint: str, method: str, *, expected_status: int = 200, **kwargs: Any) -> Any:
            creds = (MlflowHostCreds(uri, username=username, password=password) if username
                     else get_default_host_creds(uri))
            resp = verify_rest_response(http_request(creds, endpoint, method, max_retries=2, timeout=60, **kwargs),
                                        endpoint, expected_status=expected_status)
            return {} if resp.status_code == 204 or not resp.content else resp.json()

    return _Client(uri)


@dataclass
class UserResult:
    """What :meth:`AuthAdmin.add_user` did."""

    username: str
    role: str
    created: bool
    grants: list[str]
    password: str | None = None  # set only when this call set it (new user, or a given one)

    def __repr__(self) -> str:  # never the password
        return f"UserResult({self.username!r}, role={self.role!r}, created={self.created}, grants={self.grants})"


class AuthAdmin:
    """Users and roles on one basic-auth MLflow server, as an admin.

    ``username``/``password``: the admin login (the local stack passes its own); None = this
    process's MLflow login (a remote server: ``--tracking-uri`` with the admin's env vars).
    """

    def __init__(self, uri: str, username: str | None = None, password: str | None = None) -> None:
        self.uri = uri
        self.admin = _admin_client(uri, username, password)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with guard(self.uri, Need("admin", "the MLflow server", what)):
            return fn(*args, **kwargs)

    def ensure_roles(self) -> dict[str, int]:
        """Create the ProxyDML roles (and their grants) that are missing. Returns name -> role id."""
        existing = {r.name: r for r in self._call("list roles", self.admin.list_roles, WORKSPACE)}
        ids = {}
        for role in ROLES.values():
            found = existing.get(role.mlflow_name)
            if found is None:
                found = self._call("create roles", self.admin.create_role, WORKSPACE, role.mlflow_name, role.summary)
            have = {(p.resource_type, p.resource_pattern, p.permission)
                    for p in self._call("list role permissions", self.admin.list_role_permissions, found.id)}
            for grant in role.grants:
                if grant not in have:
                    self._call("grant role permissions", self.admin.add_role_permission, found.id, *grant)
            ids[role.name] = found.id
        return ids

    def add_user(self, username: str, role: str, password: str | None = None, *,
                 experiments: Iterable[str] = (), models: Iterable[str] = (), generate: bool = True) -> UserResult:
        """Create ``username`` (or update an existing one) with exactly one ProxyDML ``role``.

        ``password``: a new user gets it, or a generated one (``generate=False``: refused, for a
        caller with nowhere to keep it); an existing user keeps its own unless one is given. ``experiments`` (trainer): EDIT on each, created when missing. ``models``
        (maintainer): MANAGE on each, none = every model; (trainer): EDIT on each one's
        candidates model (:func:`candidates_model`, created when missing). Bad input raises ValueError.
        """
        from mlflow.exceptions import MlflowException

        check_username(username)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of: {', '.join(ROLES)}")
        experiments, models = list(experiments), list(models)
        if experiments and role != "trainer":
            raise ValueError(f"--experiment is for trainers (a {role} needs no per-experiment grant)")
        if models and role == "reader":
            raise ValueError("--model is for trainers and maintainers (a reader only reads models)")
        ids = self.ensure_roles()
        try:
            self.admin.get_user(username)
            created = False
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise AuthError(f"cannot look up user {username!r}: {exc}") from exc
            created = True
        if created:
            if not password and not generate:
                raise ValueError(f"user {username!r} is new: give its password with --password-env VAR "
                                 "(a generated one would be kept nowhere)")
            password = password or generate_password()
            self._call("create users", self.admin.create_user, username, password)
        elif password:
            self._call("change passwords", self.admin.update_user_password, username, password)
        # Exactly one ProxyDML role: a changed role replaces the old one.
        for other in self._call("list user roles", self.admin.list_user_roles, username):
            if other.name.startswith("proxydml-") and other.name != ROLES[role].mlflow_name:
                self._call("unassign roles", self.admin.unassign_role, username, other.id)
        if ids[role] not in {r.id for r in self._call("list user roles", self.admin.list_user_roles, username)}:
            self._call("assign roles", self.admin.assign_role, username, ids[role])
        grants = []
        for name in experiments:
            exp_id = self._experiment_id(name)
            self._grant(username, "experiment", exp_id, "EDIT")
            grants.append(f"EDIT on experiment {name!r} (id {exp_id})")
        if role == "trainer":
            for name in models:
                pool = candidates_model(name)
                self._model(pool)
                self._grant(username, "registered_model", pool, "EDIT")
                grants.append(f"EDIT on model {pool!r} (proposes candidates of {name!r})")
        if role == "maintainer":
            for name in models or ["*"]:
                self._grant(username, "registered_model", name, "MANAGE")
                grants.append("MANAGE on every registered model" if name == "*" else f"MANAGE on model {name!r}")
        return UserResult(username, role, created, grants, password)

    def _grant(self, username: str, resource_type: str, resource_id: str, level: str) -> None:
        """Grant ``level`` to the user on one resource; an earlier grant there is replaced."""
        from mlflow.exceptions import MlflowException

        try:
            self._call("grant permissions", self.admin.grant_user_permission, username, resource_type, resource_id,
                       level)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            self._call("revoke permissions", self.admin.revoke_user_permission, username, resource_type, resource_id)
            self._call("grant permissions", self.admin.grant_user_permission, username, resource_type, resource_id,
                       level)

    def _model(self, name: str) -> None:
        """Registered model ``name``, created (owned by the admin) when missing."""
        from mlflow.exceptions import MlflowException

        try:
            self._call("create registered models", self.admin._request,
                       "/api/2.0/mlflow/registered-models/create", "POST", json={"name": name})
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise

    def _experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created (owned by the admin) when missing."""
        resp = self._call("read experiments", self.admin._request, "/api/2.0/mlflow/experiments/search", "POST",
                          json={"filter": f"name = '{name}'", "max_results": 1})
        found = resp.get("experiments") or []
        if found:
            return str(found[0]["experiment_id"])
        resp = self._call("create experiments", self.admin._request, "/api/2.0/mlflow/experiments/create", "POST",
                          json={"name": name})
        return str(resp["experiment_id"])
