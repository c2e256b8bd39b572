"""The team dashboard behind a login: ``proxydml stack up --auth`` (stock ``mlflow server
--app-name basic-auth --enable-workspaces`` on 127.0.0.1, artifacts on moto S3) with the three
roles of ``services/auth.py``, driven through the CLI as each role.

One stack for the module; the tests run in file order and build on each other:

1. the admin password stays in its 0600 file; users are added with ``stack user add``;
2. without a login every REST endpoint the CLI uses answers 401, and so does the UI (Chromium);
3. a trainer trains on 2 Ray workers (its login reaches the workers, not the config);
4. a reader sees the runs and the report but cannot log (one line, no run, Ray untouched);
5. a maintainer's ``retrain`` promotes;
6. a trainer cannot move ``champion`` (``models rollback`` refused, alias unchanged), even
   through MLflow's own client; a maintainer can;
7. no password anywhere: params, tags, artifacts, Ray's train state and job records, the
   server, Ray and worker logs, the CLI's output.

Only 127.0.0.1 is contacted. Timings print with ``-s``.
"""

from __future__ import annotations

import configparser
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from services import auth, registry, runtime
from services.cli import main as cli_main
from services.mlflow_tracking import MlflowTracker, end_run
from services.s3 import Credentials, s3_client
from services.snapshots import sha256_file
from services.stack import ADMIN_FILE, AUTH_CONFIG_FILE, STATE_FILE, Stack
from tests.e2e.test_retrain import write_digits_snapshot

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
S3 = Credentials("proxydml-auth-key", "proxydml-auth-S3-secret")
TEAM = "proxydml-team-digits"
MODEL = "digits-team-embedder"
USERS = {"rd": "reader", "tr": "trainer", "mt": "maintainer"}
TRAIN = ["--config", "digits", "train.epochs=2", "train.max_steps_per_epoch=4", f"tracking.experiment={TEAM}"]
# The maintainer's retrain: one worker is enough to show promotion (the 2-worker run is the trainer's).
RETRAIN = ["data.batch_size=64", "data.samples_per_class=16", "data.random_flip=false", "scaling.num_workers=1",
           "model.embedding_dim=32", "train.epochs=1", "train.max_steps_per_epoch=6"]
TIMINGS: dict[str, float] = {}
SHARED: dict[str, str] = {}
OUTPUTS: list[str] = []  # everything the CLI printed, scanned for passwords at the end


@pytest.fixture(scope="module")
def stack(make_stack):
    t0 = time.monotonic()
    st = make_stack(S3, auth=True, store="postgresql")  # --auth keeps users in PostgreSQL
    TIMINGS["stack up --auth (PostgreSQL + moto + mlflow basic-auth)"] = time.monotonic() - t0
    return st


@pytest.fixture(scope="module")
def users(stack):
    """name -> password. The trainer through the CLI, the others through Stack.add_user."""
    t0 = time.monotonic()
    code = cli_main(["stack", "user", "add", "tr", "--role", "trainer", "--experiment", TEAM, "--model", MODEL,
                     "--state-dir", str(stack.state_dir)])
    assert code == 0
    stack.add_user("rd", "reader")
    stack.add_user("mt", "maintainer", models=(MODEL,))
    TIMINGS["3 users added"] = time.monotonic() - t0
    out = {}
    for name in USERS:
        path = stack.user_credentials_file(name)
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        parser = configparser.ConfigParser()
        parser.read(path)  # the format of ~/.mlflow/credentials
        assert parser["mlflow"]["mlflow_tracking_username"] == name
        out[name] = parser["mlflow"]["mlflow_tracking_password"]
    return out


@pytest.fixture(autouse=True)
def no_credentials_file(tmp_path, monkeypatch):
    """No ~/.mlflow/credentials of this machine may supply a login: each test sets its own."""
    import mlflow.utils.credentials

    monkeypatch.setattr(mlflow.utils.credentials, "_get_credentials_path", lambda: str(tmp_path / "none"))
    for key in auth.CREDENTIAL_ENV:
        monkeypatch.delenv(key, raising=False)


def login(monkeypatch, users: dict[str, str] | None, name: str | None) -> None:
    """This process's MLflow login (None: none at all), the way users set it."""
    for key in auth.CREDENTIAL_ENV:
        monkeypatch.delenv(key, raising=False)
    if name is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", name)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", users[name] if users else "")


def admin(stack: Stack) -> MlflowClient:
    """An MLflow client logged in as the stack's admin (for checks only)."""
    user, password = stack.admin_login()
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
    return MlflowClient(stack.tracking_uri)


def _cli(capsys, argv: list[str]) -> tuple[int, str, str, float]:
    capsys.readouterr()
    t0 = time.monotonic()
    code = cli_main(argv)
    out = capsys.readouterr()
    OUTPUTS.extend((out.out, out.err))
    return code, out.out, out.err, time.monotonic() - t0


def _one_line_refusal(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def no_ray(monkeypatch):
    """Any attempt to start Ray or Train workers fails the test: refusals come before."""
    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started although MLflow had refused the login")

    monkeypatch.setattr(runtime, "ensure_ray", forbidden)
    monkeypatch.setattr(runtime, "fit", forbidden)


# ---------------------------------------------------------------- 1. the stack --------------


def test_admin_password_is_generated_private_and_never_shown(stack, users, capsys, monkeypatch):
    secrets_file = stack.state_dir / ADMIN_FILE
    assert secrets_file.stat().st_mode & 0o777 == 0o600
    user, password = stack.admin_login()
    assert user == auth.ADMIN_USERNAME and len(password) >= 20
    for name in (STATE_FILE, AUTH_CONFIG_FILE, "mlflow.log"):
        assert password not in (stack.state_dir / name).read_text()
    # Not on any command line of the server or its children (ps shows those to every user).
    pgid = int(stack.pid_file("mlflow").read_text())
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (proc / "stat").exists():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    assert password.encode() not in (proc / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
    # `up` again (with or without --auth): already running, authentication kept, nothing shown.
    code, out, err, _ = _cli(capsys, ["stack", "up", "--auth", "--state-dir", str(stack.state_dir)])
    assert code == 0 and out.count("already running") == 3 and "basic auth" in out  # db, s3, mlflow
    assert password not in out + err and all(p not in out + err for p in users.values())
    assert Stack(stack.state_dir).auth is True
    code, out, _, _ = _cli(capsys, ["stack", "status", "--state-dir", str(stack.state_dir)])
    assert code == 0 and "basic-auth" in out
    # A user added again keeps its password (no file rewritten); bad input is one clear line.
    code, out, err, _ = _cli(capsys, ["stack", "user", "add", "rd", "--role", "reader",
                                      "--state-dir", str(stack.state_dir)])
    assert code == 0 and "updated" in out and "password unchanged" in out
    code, _, err, _ = _cli(capsys, ["stack", "user", "add", "rd", "--role", "reader", "--model", MODEL,
                                    "--state-dir", str(stack.state_dir)])
    assert code == 2 and _one_line_refusal(err) == "error: --model is for trainers and maintainers (a reader only reads models)"
    # Another basic-auth server (compose, Kubernetes): --tracking-uri, admin login from the
    # environment, the new user's password from an environment variable (never argv).
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    remote = ["stack", "user", "add", "ci-bot", "--role", "trainer", "--tracking-uri", stack.tracking_uri]
    code, _, err, _ = _cli(capsys, remote)
    assert code == 2 and "give its password with --password-env" in _one_line_refusal(err)
    monkeypatch.setenv("CI_BOT_PASSWORD", "ci-bot-password-0123456789")
    code, out, err, _ = _cli(capsys, [*remote, "--password-env", "CI_BOT_PASSWORD"])
    assert code == 0 and "user ci-bot: created, role trainer" in out and "set from $CI_BOT_PASSWORD" in out, err
    login(monkeypatch, {"ci-bot": "ci-bot-password-0123456789"}, "ci-bot")
    assert MlflowClient(stack.tracking_uri).search_experiments() is not None


# ---------------------------------------------------------------- 2. no login ---------------

# (method, path) of every REST call the CLI's commands make: train/tune (experiments, runs,
# params, metrics, tags, artifacts through the proxy, logged models), report (reads + artifact
# upload), retrain and models (registry, aliases, versions, permissions).
CLI_ENDPOINTS = [
    ("GET", "/api/2.0/mlflow/experiments/get-by-name?experiment_name=x"),
    ("GET", "/api/2.0/mlflow/experiments/get?experiment_id=0"),
    ("POST", "/api/2.0/mlflow/experiments/create"),
    ("POST", "/api/2.0/mlflow/experiments/search"),
    ("POST", "/api/2.0/mlflow/experiments/update"),
    ("POST", "/api/2.0/mlflow/experiments/delete"),
    ("POST", "/api/2.0/mlflow/experiments/set-experiment-tag"),
    ("POST", "/api/2.0/mlflow/runs/create"),
    ("POST", "/api/2.0/mlflow/runs/search"),
    ("GET", "/api/2.0/mlflow/runs/get?run_id=0"),
    ("POST", "/api/2.0/mlflow/runs/update"),
    ("POST", "/api/2.0/mlflow/runs/log-batch"),
    ("POST", "/api/2.0/mlflow/runs/set-tag"),
    ("GET", "/api/2.0/mlflow/metrics/get-history?run_id=0&metric_key=loss"),
    ("GET", "/api/2.0/mlflow/artifacts/list?run_id=0"),
    ("GET", "/api/2.0/mlflow-artifacts/artifacts/0/0/artifacts/config.yaml"),
    ("PUT", "/api/2.0/mlflow-artifacts/artifacts/0/0/artifacts/config.yaml"),
    ("POST", "/api/2.0/mlflow/logged-models"),
    ("POST", "/api/2.0/mlflow/logged-models/search"),
    ("GET", "/api/2.0/mlflow/registered-models/get?name=x"),
    ("GET", "/api/2.0/mlflow/registered-models/search"),
    ("POST", "/api/2.0/mlflow/registered-models/create"),
    ("POST", "/api/2.0/mlflow/model-versions/create"),
    ("GET", "/api/2.0/mlflow/model-versions/search"),
    ("GET", "/api/2.0/mlflow/model-versions/get?name=x&version=1"),
    ("POST", "/api/2.0/mlflow/model-versions/set-tag"),
    ("DELETE", "/api/2.0/mlflow/model-versions/delete"),
    ("GET", "/api/2.0/mlflow/registered-models/alias?name=x&alias=champion"),
    ("POST", "/api/2.0/mlflow/registered-models/alias"),
    ("DELETE", "/api/2.0/mlflow/registered-models/alias"),
    ("GET", "/api/3.0/mlflow/users/permissions/get?username=x&resource_type=experiment&resource_id=0"),
    ("POST", "/api/2.0/mlflow/users/create"),
    ("GET", "/ajax-api/2.0/mlflow/experiments/search"),  # what the UI calls
    ("GET", "/"),
]


def test_without_a_login_every_endpoint_the_cli_uses_answers_401(stack, users, tmp_path, capsys, monkeypatch,
                                                                 no_ray):
    for method, path in CLI_ENDPOINTS:
        data = b"{}" if method in ("POST", "PUT", "DELETE") else None
        req = urllib.request.Request(stack.tracking_uri + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(req, timeout=10)
        assert answer.value.code == 401, (method, path, answer.value.code)
        assert answer.value.headers.get("WWW-Authenticate", "").startswith("Basic"), (method, path)
    # A wrong password is a 401 too.
    req = urllib.request.Request(stack.tracking_uri + "/api/2.0/mlflow/experiments/search", data=b"{}",
                                 headers={"Authorization": "Basic cmQ6d3Jvbmc=", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(req, timeout=10)
    with urllib.request.urlopen(stack.tracking_uri + "/health", timeout=10) as health:  # open by design
        assert health.status == 200

    # The CLI: one line, exit 77, no traceback, nothing started.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.tracking_uri)
    for argv in (["models", "list"], ["report", TEAM, "--out", str(tmp_path / "r.html")],
                 ["train", *TRAIN, f"tracking.storage_path={tmp_path / 'runs'}"]):
        code, _, err, seconds = _cli(capsys, argv)
        line = _one_line_refusal(err)
        assert code == auth.EXIT_NOPERM and "requires a login (401) and no credentials are set" in line, (argv, err)
        TIMINGS[f"refused without login: {argv[0]}"] = seconds
    login(monkeypatch, {"rd": "not-the-password"}, "rd")
    code, _, err, _ = _cli(capsys, ["models", "list"])
    assert code == auth.EXIT_NOPERM and "did not accept the password of user 'rd' (401)" in _one_line_refusal(err)


def test_mlflow_ui_answers_401_in_headless_chromium(browser, stack, users):
    for page in ("/", "/#/experiments/0", "/ajax-api/2.0/mlflow/experiments/search"):
        browser.get(stack.tracking_uri + page)
        status = browser.execute_script(
            "return performance.getEntriesByType('navigation').map(e => e.responseStatus)[0]")
        assert status == 401, (page, status)
        assert TEAM not in browser.find_element("tag name", "body").text


# ---------------------------------------------------------------- 3. trainer ----------------


@pytest.mark.ray
def test_trainer_trains_on_two_workers_and_the_run_is_complete(ray_cluster, stack, users, tmp_path_factory,
                                                                capsys, monkeypatch):
    login(monkeypatch, users, "tr")
    storage = tmp_path_factory.mktemp("trainer-runs")
    SHARED["storage"] = str(storage)
    code, out, err, TIMINGS["trainer: train, 2 workers"] = _cli(capsys, [
        "train", *TRAIN, "scaling.num_workers=2", f"tracking.tracking_uri={stack.tracking_uri}",
        f"tracking.storage_path={storage}"])
    assert code == 0, err
    run_id = out.split("MLflow run  : ")[1].split()[0]
    SHARED["run"] = run_id

    client = MlflowClient(stack.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    # Rank 0 logged every epoch (its login came from the driver, not from the config).
    for key in ("loss", "recall_at_1", "map_at_r"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "checkpoint", "plots"} <= top
    assert {a.path for a in client.list_artifacts(run_id, "checkpoint")} >= {"checkpoint/model.pt"}
    assert registry.logged_model_of_run(client, run_id)[1] is not None  # mlflow.pytorch model
    assert "tracking.tracking_uri" in run.data.params and "MLFLOW_TRACKING" not in str(run.data.params)


def test_trainer_sweeps_and_every_trial_logs_as_the_trainer(ray_cluster, stack, users, tmp_path, capsys,
                                                            monkeypatch):
    login(monkeypatch, users, "tr")
    code, out, err, TIMINGS["trainer: tune, 2 trials"] = _cli(capsys, [
        "tune", *TRAIN[:2], "--space", "digits_quick", "--samples", "2", "--scheduler", "none", "--search", "random",
        *TRAIN[2:], "train.epochs=1", "train.max_steps_per_epoch=3", "scaling.num_workers=2",
        f"tracking.tracking_uri={stack.tracking_uri}", f"tracking.storage_path={tmp_path / 'sweeps'}"])
    assert code == 0, err
    parent_id = out.split("MLflow parent run: ")[1].split()[0]
    client = MlflowClient(stack.tracking_uri)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 2
    for child in children:
        # Each trial is a 2-worker Ray Train run whose rank-0 worker logged its epoch with the
        # trainer's login (from the driver; the server refuses any request without one).
        assert child.info.status == "FINISHED" and child.data.tags["world_size"] == "2"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "map_at_r")] == [1]
        assert "MLFLOW_TRACKING" not in str(child.data.params)


# ---------------------------------------------------------------- 4. reader -----------------


def test_reader_sees_runs_and_the_report_but_cannot_log(stack, users, tmp_path, capsys, monkeypatch, no_ray):
    run_id = SHARED["run"]
    login(monkeypatch, users, "rd")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.tracking_uri)
    client = MlflowClient(stack.tracking_uri)
    exp = client.get_experiment_by_name(TEAM)
    runs_before = client.search_runs([exp.experiment_id])
    assert run_id in {r.info.run_id for r in runs_before}
    assert client.get_metric_history(run_id, "map_at_r")

    # The report: the page is written; logging it is skipped with one note.
    code, out, err, _ = _cli(capsys, ["report", TEAM, "--out", str(tmp_path / "report.html")])
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    assert run_id in page and "map_at_r" in page
    assert err.count("note: report not logged to MLflow") == 1 and "'rd'" in err

    # Logging: refused in one line naming the user and the permission, before Ray (no_ray).
    for experiment, needed in ((TEAM, f"EDIT permission on experiment '{TEAM}'"),
                               ("proxydml-reader-own", "workspace USE (role trainer or maintainer)")):
        train = ["train", "--config", "digits", f"tracking.experiment={experiment}",
                 f"tracking.storage_path={tmp_path / 'runs'}"]
        code, _, err, seconds = _cli(capsys, train)
        line = _one_line_refusal(err)
        assert code == auth.EXIT_NOPERM and "refused user 'rd' (403)" in line and needed in line, line
        TIMINGS[f"reader refused: train into {experiment}"] = seconds
    assert client.get_experiment_by_name("proxydml-reader-own") is None
    assert len(client.search_runs([exp.experiment_id])) == len(runs_before)  # no run created

    # Under the CLI: a refusal is not an outage. The tracker gives up at once (no backoff
    # loop), drops the record, and says why; closing a run is not retried 30 times either.
    tracker = MlflowTracker(run_id, stack.tracking_uri)
    sends = []
    send = tracker.client.log_batch
    tracker.client.log_batch = lambda *a, **k: sends.append(1) or send(*a, **k)
    tracker.log_metrics({"reader_metric": 1.0}, step=1)
    tracker.log_metrics({"reader_metric": 2.0}, step=2)
    with pytest.warns(UserWarning, match="dropped, not retried"), pytest.raises(auth.AuthError, match="'rd'"):
        tracker.flush(timeout=120)  # an outage would keep retrying: flush would time out instead
    assert len(sends) == 1 and tracker.delivered == 0 and tracker.pending() == 0  # one attempt, both dropped
    assert tracker.close(timeout=5) is False
    t0 = time.monotonic()
    with pytest.raises(auth.AuthError, match="refused user 'rd'"):
        end_run(run_id, stack.tracking_uri, "FAILED")
    assert time.monotonic() - t0 < 5
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "reader_metric" not in run.data.metrics


# ---------------------------------------------------------------- 5. maintainer -------------


@pytest.mark.ray
def test_maintainer_retrain_promotes(ray_cluster, stack, users, tmp_path_factory, capsys, monkeypatch):
    login(monkeypatch, users, "mt")
    snapshot = write_digits_snapshot(tmp_path_factory.mktemp("snapshot") / "A", "digits-auth-A", train_per_class=40)
    code, out, err, TIMINGS["maintainer: retrain (1 worker)"] = _cli(capsys, [
        "retrain", "--model", MODEL, "--data", str(snapshot), "--tracking-uri", stack.tracking_uri,
        "--config", "digits", *RETRAIN, f"tracking.storage_path={SHARED['storage']}"])
    assert code == 0, err
    assert "decision: PROMOTED to champion -- no champion yet" in out, out
    # The promotion built the champion's index as the maintainer, and moved `serving` to it.
    assert "index: v1 Flat, ANN recall@10 1.0000; serving -> v1" in out, out
    client = MlflowClient(stack.tracking_uri)
    assert registry.aliases_of(client, MODEL) == {"champion": "1", "serving": "1"}
    # A reader's login reads what a search server loads: the version's index, checked by sha256.
    login(monkeypatch, users, "rd")
    tags = MlflowClient(stack.tracking_uri).get_model_version(MODEL, "1").tags
    index_file = Path(MlflowClient(stack.tracking_uri).download_artifacts(
        tags["index_run_id"], "index/index.faiss", str(tmp_path_factory.mktemp("reader-index"))))
    assert sha256_file(index_file) == tags["index_sha256"]


# ---------------------------------------------------------------- 6. promotion is guarded ---


def test_trainer_cannot_move_champion_a_maintainer_can(stack, users, tmp_path, capsys, monkeypatch, no_ray):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.tracking_uri)
    # The maintainer registers the trainer's run as version 2 and promotes it.
    login(monkeypatch, users, "mt")
    client = MlflowClient(stack.tracking_uri)
    registry.register_version(client, MODEL, run_id=SHARED["run"], tags={"source": "trainer run"},
                              description="the trainer's 2-worker run", promote_it=True)
    before = registry.aliases_of(client, MODEL)
    assert before == {"champion": "2", "previous-champion": "1", "serving": "1"}

    login(monkeypatch, users, "tr")
    code, _, err, seconds = _cli(capsys, ["models", "rollback", MODEL])
    line = _one_line_refusal(err)
    assert code == auth.EXIT_NOPERM and "refused user 'tr' (403)" in line
    assert f"MANAGE permission on registered model '{MODEL}'" in line and "--role maintainer" in line
    TIMINGS["trainer refused: models rollback"] = seconds
    code, _, err, seconds = _cli(capsys, ["retrain", "--model", MODEL, "--data", str(tmp_path), "--config", "digits"])
    assert code == auth.EXIT_NOPERM and f"registered model '{MODEL}'" in _one_line_refusal(err)  # before anything
    TIMINGS["trainer refused: retrain"] = seconds
    # Not only the CLI's preflight: the server itself refuses the trainer's alias moves.
    client = MlflowClient(stack.tracking_uri)
    for move in (lambda: client.set_registered_model_alias(MODEL, "champion", "1"),
                 lambda: client.delete_registered_model_alias(MODEL, "champion"),
                 lambda: client.set_registered_model_alias(MODEL, "serving", "2"),
                 # MLflow checks a new version with the alias permission (EDIT on the model):
                 # so a trainer proposes candidates in MODEL.candidates (below).
                 lambda: client.create_model_version(MODEL, f"runs:/{SHARED['run']}/model", run_id=SHARED["run"])):
        with pytest.raises(MlflowException) as refused:
            move()
        assert auth.auth_status(refused.value) == 403
    assert registry.aliases_of(client, MODEL) == before
    # The trainer proposes its run as a candidate of MODEL: a version of MODEL.candidates, with
    # the run's scores; MODEL itself (versions, aliases) is untouched.
    versions_before = len(registry.versions(client, MODEL))
    code, out, err, _ = _cli(capsys, ["models", "propose", MODEL, "--run", SHARED["run"], "--note", "2-worker run"])
    assert code == 0 and f"proposed as v1 of {MODEL}.candidates" in out, err
    [candidate] = registry.versions(client, registry.candidates_of(MODEL))
    assert candidate.run_id == SHARED["run"] and candidate.tags["proposed_by"] == "tr"
    assert candidate.tags["candidate_for"] == MODEL and float(candidate.tags["candidate.map_at_r"]) > 0
    assert registry.aliases_of(client, MODEL) == before and len(registry.versions(client, MODEL)) == versions_before
    # ...but cannot serve it.
    code, _, err, _ = _cli(capsys, ["models", "promote", MODEL, "--candidate", "1"])
    assert code == auth.EXIT_NOPERM and f"MANAGE permission on registered model '{MODEL}'" in _one_line_refusal(err)
    assert registry.aliases_of(client, MODEL) == before
    # A reader can do neither.
    login(monkeypatch, users, "rd")
    code, _, err, _ = _cli(capsys, ["models", "propose", MODEL, "--run", SHARED["run"]])
    assert code == auth.EXIT_NOPERM and f"EDIT permission on registered model '{MODEL}.candidates'" in _one_line_refusal(err)
    assert len(registry.versions(client, registry.candidates_of(MODEL))) == 1  # nothing half-registered

    # A reader is refused too; the maintainer rolls back.
    login(monkeypatch, users, "rd")
    code, _, err, _ = _cli(capsys, ["models", "rollback", MODEL])
    assert code == auth.EXIT_NOPERM and "refused user 'rd'" in _one_line_refusal(err)
    with pytest.raises(MlflowException) as refused:
        MlflowClient(stack.tracking_uri).set_registered_model_alias(MODEL, "serving", "2")
    assert auth.auth_status(refused.value) == 403
    login(monkeypatch, users, "mt")
    code, out, err, _ = _cli(capsys, ["models", "rollback", MODEL])
    assert code == 0 and "champion v2 -> v1" in out, err
    assert registry.aliases_of(MlflowClient(stack.tracking_uri), MODEL) == {
        "champion": "1", "previous-champion": "2", "serving": "1"}
    # The maintainer serves the trainer's candidate: copied into MODEL as a new version, champion.
    code, out, err, _ = _cli(capsys, ["models", "promote", MODEL, "--candidate", "1"])
    assert code == 0 and "now v3, the champion (previous-champion = v1)" in out, err
    client = MlflowClient(stack.tracking_uri)
    assert registry.aliases_of(client, MODEL) == {"champion": "3", "previous-champion": "1", "serving": "1"}
    served = client.get_model_version(MODEL, "3")
    assert served.run_id == SHARED["run"] and served.tags["promoted_from"] == f"{MODEL}.candidates/1"
    assert served.tags["proposed_by"] == "tr"
    code, out, err, _ = _cli(capsys, ["models", "rollback", MODEL])  # and rolls back as usual
    assert code == 0 and "champion v3 -> v1" in out, err


# ---------------------------------------------------------------- 7. no password anywhere ---


def _ray_records() -> str:
    """What Ray recorded of this session's jobs and actors, and the Train V2 run state (the
    train-loop config of every run) when state tracking is on, as text."""
    import ray
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    from ray.train.v2._internal.state.state_actor import get_state_actor
    from ray.util.state import list_actors, list_jobs

    # This session's dashboard, by address: another Ray instance may run on the machine.
    dashboard = "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]
    texts = [str(list_jobs(address=dashboard, detail=True)),
             str(list_actors(address=dashboard, detail=True, limit=10000))]
    req = urllib.request.Request(dashboard + "/api/jobs/", headers=get_auth_headers_if_auth_enabled({}))
    with urllib.request.urlopen(req, timeout=30) as resp:
        texts.append(resp.read().decode(errors="replace"))
    state = get_state_actor()  # None unless RAY_TRAIN_ENABLE_STATE_TRACKING=1 when Ray started
    if state is not None:
        runs = str(ray.get(state.get_train_runs.remote()))
        assert "mlflow_run_id" in runs  # the train-loop config is in there
        texts.append(runs)
    return "\n".join(texts)


@pytest.mark.ray
def test_no_password_in_runs_artifacts_ray_or_logs(ray_cluster, stack, users):
    import ray

    secrets = {f"password of {name}": pw for name, pw in users.items()}
    secrets["admin password"] = stack.admin_login()[1]
    secrets["S3 secret key"] = S3.secret_key
    found: list[str] = []

    def scan(where: str, data: bytes | str) -> None:
        blob = data.encode() if isinstance(data, str) else data
        found.extend(f"{what} in {where}" for what, pw in secrets.items() if pw.encode() in blob)

    client = admin(stack)
    try:
        for exp in client.search_experiments(view_type=3):
            for run in client.search_runs([exp.experiment_id], run_view_type=3):
                scan(f"run {run.info.run_id} params/tags/metrics",
                     f"{run.data.params} {run.data.tags} {list(run.data.metrics)}")
        for model in client.search_registered_models():
            scan(f"model {model.name}", f"{model.tags} {model.description}")
            for version in client.search_model_versions(f"name = '{model.name}'"):
                scan(f"{model.name} v{version.version}", f"{version.tags} {version.description} {version.source}")
    finally:
        for key in auth.CREDENTIAL_ENV:
            os.environ.pop(key, None)
    s3 = s3_client(stack.s3_endpoint, S3)
    objects = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket):
        for obj in page.get("Contents", []):
            objects += 1
            scan(f"s3://{stack.bucket}/{obj['Key']}", s3.get_object(Bucket=stack.bucket, Key=obj["Key"])["Body"].read())
    assert objects > 20  # artifacts, checkpoints and models of 2 runs are there
    # Ray: what it recorded (train state = the train-loop config, jobs, actors) and every
    # file of this session (raylet, runtime_env agent, worker stdout/stderr), and the Train
    # storage (checkpoints, config.yaml).
    scan("Ray's job, actor and train-run records", _ray_records())
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    storage = Path(SHARED["storage"])
    files = [p for root in (session / "logs", storage) for p in root.rglob("*") if p.is_file()]
    assert any(p.name.startswith("worker-") for p in files)
    for path in files:
        scan(str(path), path.read_bytes())
    # The servers' logs and the stack's non-secret state.
    for name in ("mlflow.log", "s3.log", "db.log", STATE_FILE, AUTH_CONFIG_FILE):
        scan(name, (stack.state_dir / name).read_bytes())
    scan("the CLI's output", "\n".join(OUTPUTS))
    assert not found, found
    print("\nauth e2e timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))
    print(f"scanned: {objects} S3 objects, {len(files)} Ray log and storage files")


# ---------------------------------------------------------------- without --auth ------------


def test_readme_says_the_stack_without_auth_is_for_one_machine():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("stack up --auth"):]
    assert "one machine only" in text[:text.index("stack up --auth")]  # said before --auth is shown
    assert all(f"--role {role}" in section for role in USERS.values())
    infra = (ROOT / "infra" / "README.md").read_text()
    assert "TLS" in infra and "reverse proxy" in infra
