"""MLflow model registry helpers: versions, the ``champion`` alias, rollback, and a lock.

Aliases carry the deployment state of a registered model (``services/aliases.py``): ``champion``,
``previous-champion`` and ``serving``.

Every change that touches more than one registry object (create a version, then move two
aliases) undoes what it did when a later step fails, so that a model is never left
half-registered: either the version exists with its tags and the aliases moved as decided,
or the version is gone (or, when even the delete fails, tagged ``registration=failed``) and
the aliases are back where they were.

The lock (:class:`TrackingLock`) lives on the tracking server too, so that every machine that
can retrain a model sees it. See its docstring for what it guarantees and where it races.

On a server with authentication, moving ``champion`` (promotion, rollback) needs the
maintainer's MANAGE permission on the registered model (:func:`require_maintainer`, checked
before anything changes); a refusal is one :class:`services.auth.AuthError` line.

This module never imports Ray.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow.entities import LoggedModel  # noqa: E402
from mlflow.entities.model_registry import ModelVersion, RegisteredModel  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from services import auth, procs  # noqa: E402
from services.aliases import CHAMPION, PREVIOUS, SERVING  # noqa: E402

CANDIDATES_SUFFIX, candidates_of = auth.CANDIDATES_SUFFIX, auth.candidates_model  # why: see services.auth
FAILED_TAG = "registration"  # value "failed" on a version whose registration was undone
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A version's scores ride on it as tags "candidate.<metric>" (the model it registers) and
# "champion.<metric>" (the one it was compared with), so `models list` shows them without a run.
CANDIDATE_SCORES, CHAMPION_SCORES = "candidate.", "champion."


def score_tags(prefix: str, scores: dict[str, float] | None) -> dict[str, str]:
    """``{"<prefix><metric>": "0.123456"}``: scores as version tags (MLflow tags are strings)."""
    return {f"{prefix}{k}": f"{v:.6f}" for k, v in (scores or {}).items()}


def scores_in_tags(tags: dict[str, str], prefix: str) -> dict[str, float]:
    """The inverse of :func:`score_tags`."""
    return {k[len(prefix):]: float(v) for k, v in tags.items() if k.startswith(prefix)}


class RegistryError(ValueError):
    """A user-facing registry problem (unknown model, no champion, bad name)."""


def check_model_name(name: str) -> str:
    """Registered model names are also part of run names and lock names: keep them plain."""
    if not _NAME_RE.match(name or ""):
        raise RegistryError(
            f"model name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    return name


def maintainer_need(name: str) -> auth.Need:
    """What moving the aliases of model ``name`` needs, for :mod:`services.auth` messages."""
    return auth.Need("MANAGE", f"registered model {name!r}", "register versions and move its "
                     f"{CHAMPION!r} alias (role maintainer)", f"--role maintainer --model {name}")


def trainer_need(name: str) -> auth.Need:
    """What proposing a candidate of model ``name`` needs, for :mod:`services.auth` messages."""
    return auth.Need("EDIT", f"registered model {candidates_of(name)!r}",
                     f"propose candidate versions of {name!r} (role trainer)", f"--role trainer --model {name}")


def require_maintainer(client: MlflowClient, name: str) -> None:
    """Raise :class:`services.auth.AuthError` unless this login may promote and roll back the
    existing model ``name`` (a server without authentication: always)."""
    auth.require_permission(client.tracking_uri, "registered_model", name, "MANAGE", maintainer_need(name))


def _code(exc: BaseException) -> str:
    return getattr(exc, "error_code", "") or ""


def _missing(exc: BaseException) -> bool:
    # A missing model answers RESOURCE_DOES_NOT_EXIST; a missing alias INVALID_PARAMETER_VALUE.
    return isinstance(exc, MlflowException) and _code(exc) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def get_model(client: MlflowClient, name: str) -> RegisteredModel | None:
    """The registered model, or None when no model has that name."""
    try:
        return client.get_registered_model(name)
    except MlflowException as exc:
        if _code(exc) == "RESOURCE_DOES_NOT_EXIST":
            return None
        # MLflow's basic auth answers 403, not 404, for a name that does not exist (it cannot
        # resolve the permissions of nothing). A search (filtered by permission, never 403)
        # tells the two apart: a model that is there and refused is a real refusal.
        if _code(exc) == "PERMISSION_DENIED" and not client.search_registered_models(f"name = '{name}'"):
            return None
        raise


def require_model(client: MlflowClient, name: str) -> RegisteredModel:
    """The registered model, or a RegistryError listing the known ones."""
    # With authentication MLflow answers 403, not 404, for a model that does not exist.
    with auth.guard(client.tracking_uri, auth.Need("READ", f"registered model {name!r}", "read it (MLflow also "
                                                   "refuses the name of a model that does not exist)")):
        model = get_model(client, name)
    if model is None:
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise RegistryError(
            f"no registered model named {name!r}" + (f" (known: {', '.join(known)})" if known else " (none registered)")
        )
    return model


def version_by_alias(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    """The version an alias points to, or None (no such model or alias)."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if _missing(exc) or (_code(exc) == "PERMISSION_DENIED" and get_model(client, name) is None):
            return None
        raise


def champion(client: MlflowClient, name: str) -> ModelVersion | None:
    return version_by_alias(client, name, CHAMPION)


def versions(client: MlflowClient, name: str, tags: dict[str, str] | None = None) -> list[ModelVersion]:
    """Versions of ``name`` (optionally with all of ``tags``), newest first."""
    filt = f"name = '{name}'"
    for key, value in (tags or {}).items():
        filt += f" and tags.`{key}` = '{value}'"
    found = list(client.search_model_versions(filt))
    # Some stores ignore tag filters they cannot express: check again on the client.
    found = [v for v in found if all(v.tags.get(k) == val for k, val in (tags or {}).items())]
    return sorted(found, key=lambda v: int(v.version), reverse=True)


def aliases_of(client: MlflowClient, name: str) -> dict[str, str]:
    """alias -> version of one registered model ({} when it does not exist)."""
    model = get_model(client, name)
    return {str(k): str(v) for k, v in (model.aliases if model else {}).items()}


def logged_models_of_run(client: MlflowClient, run_id: str, artifact_name: str = "model") -> list[LoggedModel]:
    """Every model a run logged as ``artifact_name`` (MLflow 3 ``LoggedModel`` entities, oldest
    first): a run resumed before it finished logs its model again."""
    exp_id = client.get_run(run_id).info.experiment_id
    try:
        found = [m for m in client.search_logged_models([exp_id], filter_string=f"source_run_id = '{run_id}'")
                 if m.name == artifact_name]
    except MlflowException:
        return []
    return sorted(found, key=lambda m: m.creation_timestamp or 0)


def logged_model_of_run(client: MlflowClient, run_id: str, artifact_name: str = "model") -> tuple[str, str | None]:
    """(model URI, logged model id) of the newest model a run logged as ``artifact_name``, or
    its ``runs:/`` URI and None when it logged none as a ``LoggedModel``."""
    found = logged_models_of_run(client, run_id, artifact_name)
    if found:
        return found[-1].model_uri, found[-1].model_id
    return f"runs:/{run_id}/{artifact_name}", None


def download_checkpoint(client: MlflowClient, run_id: str, folder: Path) -> None:
    """A training run's model into ``folder``: its ``checkpoint/`` config.yaml and model.pt
    (not optimizer.pt: it can be large). FileNotFoundError when the run has none."""
    try:
        for name in ("config.yaml", "model.pt"):
            client.download_artifacts(run_id, f"checkpoint/{name}", str(folder))
    except (MlflowException, OSError) as exc:  # a local store raises OSError for a missing file
        raise FileNotFoundError(f"run {run_id} has no checkpoint/ artifacts") from exc


# ---------------------------------------------------------------- registration ---------------


def set_aliases(client: MlflowClient, name: str, wanted: dict[str, str | None]) -> None:
    """Point each alias at a version (None: remove it)."""
    for alias, version in wanted.items():
        if version is None:
            try:
                client.delete_registered_model_alias(name, alias)
            except MlflowException as exc:
                if not _missing(exc):
                    raise
        else:
            client.set_registered_model_alias(name, alias, str(version))


def promote(client: MlflowClient, name: str, version: str) -> dict[str, str]:
    """Make ``version`` the champion; the replaced champion becomes ``previous-champion``.

    If moving the second alias fails, the first is put back. Returns the aliases before.
    """
    before = aliases_of(client, name)
    old = before.get(CHAMPION)
    wanted: dict[str, str | None] = {}
    if old is not None and old != str(version):
        wanted[PREVIOUS] = old
    wanted[CHAMPION] = str(version)
    try:
        set_aliases(client, name, wanted)
    except BaseException:
        restore_aliases(client, name, before, keys=tuple(wanted))
        raise
    return before


def restore_aliases(client: MlflowClient, name: str, before: dict[str, str], keys: tuple[str, ...]) -> None:
    """Best effort: put ``keys`` back to their values in ``before`` (errors are swallowed)."""
    for alias in keys:
        try:
            set_aliases(client, name, {alias: before.get(alias)})
        except Exception:  # the original error is the one to report
            pass


@dataclass
class Registration:
    version: ModelVersion
    promoted: bool
    aliases_before: dict[str, str]


def register_version(
    client: MlflowClient, name: str, *, run_id: str, tags: dict[str, str], description: str,
    promote_it: bool, model_tags: dict[str, str] | None = None,
    hook: Callable[[str], None] | None = None,
) -> Registration:
    """Create a version of ``name`` from the model ``run_id`` logged, and promote it if asked.

    All of it or nothing: on any failure after the version exists the version is deleted
    (tagged ``registration=failed`` when even that fails), a model created here is deleted
    again, and the aliases are restored. ``hook(step)`` is called between steps (tests
    inject failures there).
    """
    with auth.guard(client.tracking_uri, maintainer_need(name)):
        return _register_version(client, name, run_id=run_id, tags=tags, description=description,
                                 promote_it=promote_it, model_tags=model_tags, hook=hook)


def _register_version(
    client: MlflowClient, name: str, *, run_id: str, tags: dict[str, str], description: str,
    promote_it: bool, model_tags: dict[str, str] | None, hook: Callable[[str], None] | None,
) -> Registration:
    step = hook or (lambda _step: None)
    source, model_id = logged_model_of_run(client, run_id)
    created_model = _ensure_model(client, name, model_tags)
    version: ModelVersion | None = None
    before: dict[str, str] | None = None
    try:
        step("create_version")
        # Tags go in with the version in one call: no window where it exists untagged.
        version = client.create_model_version(
            name, source=source, run_id=run_id, tags=tags, description=description, model_id=model_id,
        )
        step("created")
        if promote_it:
            before = aliases_of(client, name)
            step("promote")
            promote(client, name, str(version.version))
            step("promoted")
        return Registration(version, promote_it, before or {})
    except BaseException:
        _undo(client, name, version, created_model, before)
        raise


def _ensure_model(client: MlflowClient, name: str, tags: dict[str, str] | None = None) -> bool:
    """Create registered model ``name`` when missing; True when this call created it."""
    if get_model(client, name) is not None:
        return False
    if name.endswith(CANDIDATES_SUFFIX):
        served = name.removesuffix(CANDIDATES_SUFFIX)
        description = (f"Candidate versions of {served!r} proposed by trainers (`proxydml models propose`); "
                       f"a maintainer serves one with `proxydml models promote {served} --candidate V`.")
    else:
        description = ("ProxyDML image embedder (proxy-based deep metric learning); "
                       "'champion' alias = the version to serve, 'previous-champion' = rollback target.")
    try:
        client.create_registered_model(name, tags=tags or {}, description=description)
        return True
    except MlflowException as exc:  # created concurrently: fine, it is the same model
        if _code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
        return False


def _undo(client: MlflowClient, name: str, version: ModelVersion | None, created_model: bool,
          aliases_before: dict[str, str] | None) -> None:
    if aliases_before is not None:  # aliases first: they must not point at a version being deleted
        restore_aliases(client, name, aliases_before, keys=(CHAMPION, PREVIOUS))
    if version is not None:
        try:
            client.delete_model_version(name, version.version)
        except Exception:
            try:  # could not delete it: at least mark it so nothing picks it up
                client.set_model_version_tag(name, version.version, FAILED_TAG, "failed")
            except Exception:
                pass
    if created_model:
        try:
            if not client.search_model_versions(f"name = '{name}'"):
                client.delete_registered_model(name)
        except Exception:
            pass


def propose(client: MlflowClient, name: str, *, run_id: str, tags: dict[str, str],
            description: str = "") -> ModelVersion:
    """Register the model ``run_id`` logged as a new version of ``NAME.candidates``.

    A trainer's way to offer a model for ``name`` without the power to serve it: ``name`` and
    its aliases are not touched. All or nothing, like :func:`register_version`.
    """
    check_model_name(name)
    if name.endswith(CANDIDATES_SUFFIX):
        raise RegistryError(f"model name {name!r}: propose to the served model; its candidates live in "
                            f"{candidates_of(name.removesuffix(CANDIDATES_SUFFIX))!r}")
    with auth.guard(client.tracking_uri, trainer_need(name)):
        return _register_version(client, candidates_of(name), run_id=run_id, tags={"candidate_for": name, **tags},
                                 description=description, promote_it=False,
                                 model_tags={"candidates_for": name}, hook=None).version


def promote_candidate(client: MlflowClient, name: str, candidate: str) -> tuple[ModelVersion, dict[str, str]]:
    """Copy version ``candidate`` of ``NAME.candidates`` into ``name`` and make it the champion.

    The maintainer's decision (MANAGE on ``name``, checked before anything changes). All or
    nothing: when the alias move fails the copied version is deleted again. Returns the new
    version of ``name`` and its aliases before.
    """
    pool = candidates_of(name)
    require_maintainer(client, name)
    with auth.guard(client.tracking_uri, maintainer_need(name)):
        try:
            source = client.get_model_version(pool, str(candidate))
        except MlflowException as exc:
            if _missing(exc):
                raise RegistryError(f"model {pool!r} has no version {candidate}") from exc
            raise
        if source.tags.get(FAILED_TAG) == "failed":
            raise RegistryError(f"version {candidate} of {pool!r} is a failed registration")
        created_model = _ensure_model(client, name)
        copy: ModelVersion | None = None
        before: dict[str, str] | None = None
        try:
            # What MlflowClient.copy_model_version does, without its progress lines on stderr:
            # the same run, tags and description; the source is the candidate's registry URI.
            copy = client.create_model_version(
                name, source=f"models:/{pool}/{source.version}", run_id=source.run_id,
                tags={**source.tags, "promoted_from": f"{pool}/{source.version}"},
                description=source.description, model_id=source.model_id,
            )
            before = aliases_of(client, name)
            promote(client, name, str(copy.version))
        except BaseException:
            _undo(client, name, copy, created_model, before)
            raise
        return copy, before


def rollback(client: MlflowClient, name: str, to: str | None = None) -> tuple[str | None, str]:
    """Point ``champion`` back at ``previous-champion`` (or at version ``to``), and ``serving``
    with it when that version has a published index.

    The version that was champion becomes ``previous-champion``, so a rollback can itself be
    rolled back. Returns (old champion, new champion). Needs the maintainer permission
    (:func:`require_maintainer`), checked before anything changes.
    """
    require_model(client, name)
    require_maintainer(client, name)
    with auth.guard(client.tracking_uri, maintainer_need(name)):
        return _rollback(client, name, to)


def _rollback(client: MlflowClient, name: str, to: str | None) -> tuple[str | None, str]:
    before = aliases_of(client, name)
    old = before.get(CHAMPION)
    target = str(to) if to is not None else before.get(PREVIOUS)
    if target is None:
        raise RegistryError(f"model {name!r} has no {PREVIOUS!r} alias to roll back to; give --to VERSION")
    try:
        target_version = client.get_model_version(name, target)
    except MlflowException as exc:
        raise RegistryError(f"model {name!r} has no version {target}") from exc
    if target == old:
        raise RegistryError(f"version {target} of {name!r} is already the champion")
    wanted: dict[str, str | None] = {CHAMPION: target, PREVIOUS: old}
    if SERVING in before and (target_version.tags or {}).get("index_uri"):
        # Serving follows the champion back when the restored version has its published index
        # (it served before); otherwise serving stays on a version that can answer.
        wanted[SERVING] = target
    try:
        set_aliases(client, name, wanted)
    except BaseException:
        restore_aliases(client, name, before, keys=tuple(wanted))
        raise
    client.set_model_version_tag(name, target, "restored_by_rollback_at", _iso(time.time()))
    return old, target


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# ---------------------------------------------------------------- lock ------------------------


class LockHeld(RuntimeError):
    """Another process holds the lock; the message names the owner and the expiry."""


class TrackingLock:
    """A lease on the tracking server: one experiment named ``proxydml-lock/<purpose>/<key>``.

    Why an experiment: MLflow offers no compare-and-set on tags, but experiment names are
    unique in every database-backed store, so ``create_experiment`` is an atomic
    "create if absent" on the server -- two acquirers can never both succeed. The holder
    stores ``owner`` (host:pid), ``token``, ``acquired_at`` and ``expires_at`` as experiment
    tags (set in the same call) and renews ``expires_at`` from a heartbeat thread.

    Release renames the experiment out of the way and deletes it (a deleted experiment keeps
    its name reserved, a renamed one does not).

    A lock whose ``expires_at`` has passed (its owner crashed or hung), or whose owner ran on
    this host and no longer exists, is broken by the next acquirer: rename + delete of that
    experiment id, then one more atomic create.

    Race windows (documented, not closed):

    - Expiry is judged against the breaker's clock: clock skew between hosts shortens or
      lengthens the lease by the skew. A dead same-host owner is judged by its pid (a reused
      pid only makes the lock look alive until the TTL).
    - A holder that cannot renew for longer than ``ttl_s`` (an MLflow outage longer than the
      TTL, a stopped process) can be displaced while it still runs. It finds out at its next
      :meth:`verify` -- retraining calls it right before registering -- and aborts; between that
      check and the last alias move (a few requests, well under a second) a displaced holder
      and the new one can still interleave registrations.
    - Breaking a stale lock is rename-then-create: two breakers may both rename the same stale
      experiment, but only one of their creates succeeds.
    """

    PREFIX = "proxydml-lock"

    def __init__(self, client: MlflowClient, key: str, *, purpose: str = "retrain", ttl_s: float = 900.0,
                 heartbeat_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lock ttl must be > 0, got {ttl_s}")
        self.client = client
        self.name = f"{self.PREFIX}/{purpose}/{key}"
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(ttl_s / 5, 0.5)
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.experiment_id: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renew_errors = 0

    # -- state -----------------------------------------------------------------------------
    def _tags(self) -> dict[str, str]:
        now = self.clock()
        return {"owner": self.owner, "token": self.token, "acquired_at": _iso(now),
                "acquired_at_s": f"{now:.3f}", "expires_at_s": f"{now + self.ttl_s:.3f}",
                "expires_at": _iso(now + self.ttl_s), "mlflow.note.content":
                "ProxyDML lock: exists while a job holds it; safe to ignore."}

    def _expiry(self, exp: Any) -> float:
        tags = exp.tags or {}
        try:
            return float(tags["expires_at_s"])
        except (KeyError, ValueError):
            # Tags not (yet) readable: count the lease from the experiment's creation.
            created = (getattr(exp, "creation_time", None) or 0) / 1000.0
            return created + self.ttl_s

    def describe(self, exp: Any) -> str:
        tags = exp.tags or {}
        return (f"lock {self.name} held by {tags.get('owner', 'unknown')} since {tags.get('acquired_at', '?')}, "
                f"expires {tags.get('expires_at', '?')} unless renewed")

    # -- acquire / release ---------------------------------------------------------------------
    def acquire(self) -> TrackingLock:
        """Take the lock or raise :class:`LockHeld`. Starts the heartbeat."""
        for _ in range(3):
            try:
                self.experiment_id = self.client.create_experiment(self.name, tags=self._tags())
                break
            except MlflowException as exc:
                if _code(exc) != "RESOURCE_ALREADY_EXISTS":
                    raise
            exp = self.client.get_experiment_by_name(self.name)
            if exp is None:  # released between our create and our read: try again
                continue
            if exp.lifecycle_stage == "deleted" or self._expiry(exp) < self.clock() or _owner_gone(exp.tags or {}):
                self._retire(exp.experiment_id, "stale")
                continue
            raise LockHeld(self.describe(exp))
        else:
            raise LockHeld(f"lock {self.name} changed hands repeatedly while acquiring; try again")
        if self.heartbeat_s:
            self._thread = threading.Thread(target=self._beat, name=f"lock-{self.name}", daemon=True)
            self._thread.start()
        return self

    def _retire(self, experiment_id: str, why: str) -> None:
        """Free the name: rename (frees it) then delete (hides it). Errors: someone else did it."""
        try:
            self.client.rename_experiment(experiment_id, f"{self.name}/{why}-{experiment_id}-{uuid.uuid4().hex[:8]}")
        except MlflowException:
            return
        try:
            self.client.delete_experiment(experiment_id)
        except MlflowException:
            pass

    def held(self) -> bool:
        """Whether the lock experiment is still ours (not broken by someone else)."""
        if self.experiment_id is None:
            return False
        exp = self.client.get_experiment_by_name(self.name)
        return exp is not None and exp.experiment_id == self.experiment_id and (exp.tags or {}).get("token") == self.token

    def verify(self) -> None:
        """Raise LockHeld when the lock was lost (expired and taken by another process)."""
        if not self.held():
            raise LockHeld(f"lost {self.name} (not renewed within {self.ttl_s:.0f} s and taken over); "
                           "stopping before registering anything")

    def renew(self) -> None:
        if self.experiment_id is None:
            return
        now = self.clock()
        # Renew only our own experiment id: after a takeover this writes to the retired one.
        self.client.set_experiment_tag(self.experiment_id, "expires_at_s", f"{now + self.ttl_s:.3f}")
        self.client.set_experiment_tag(self.experiment_id, "expires_at", _iso(now + self.ttl_s))

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
            except Exception:  # an outage: keep trying; verify() decides before registering
                self.renew_errors += 1

    def release(self) -> None:
        """Stop renewing and free the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.experiment_id is not None and self.held():
            self._retire(self.experiment_id, "released")
        self.experiment_id = None

    def __enter__(self) -> TrackingLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _owner_gone(tags: dict[str, str]) -> bool:
    """The owner ran on this host and its process no longer exists (killed, crashed).

    Lets a crashed retrain be resumed right away on the same machine instead of waiting for
    the TTL. Owners on other hosts are judged by the TTL only.
    """
    host, _, pid = tags.get("owner", "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not procs.pid_alive(int(pid))


def current_lock(client: MlflowClient, key: str, purpose: str = "retrain") -> dict[str, str] | None:
    """Tags of the live lock on ``key`` (None when free)."""
    exp = client.get_experiment_by_name(f"{TrackingLock.PREFIX}/{purpose}/{key}")
    if exp is None or exp.lifecycle_stage == "deleted":
        return None
    return dict(exp.tags or {})
