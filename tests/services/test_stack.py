"""The real local stack: S3 + an MLflow server as processes on 127.0.0.1, free ports.

One throw-away stack for the module (moto, sqlite: the cheapest to start); the tests run in
file order and the last one takes it down. The durable stack (PostgreSQL + Swift) is
exercised end to end in tests/e2e/test_tracking_stack.py. Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

import pytest

from services import postgres, swift
from services import stack as stack_module
from services.net import free_port
from services.procs import process_group_alive
from services.s3 import Credentials, ray_storage, s3_client
from services.stack import Stack, StackError

pytestmark = pytest.mark.e2e

# Test keys for the local moto server only (moto accepts any).
TEST_CREDENTIALS = Credentials("proxydml-test", "proxydml-test-secret")
S3_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
               "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(TEST_CREDENTIALS, start_timeout=90)


@pytest.fixture(scope="module")
def logged(stack, tmp_path_factory):
    """A run logged through the server by a client holding no S3 credentials."""
    import mlflow

    saved = {k: os.environ.pop(k) for k in S3_ENV_KEYS if k in os.environ}
    try:
        client = mlflow.MlflowClient(stack.tracking_uri)
        exp_id = client.create_experiment("stack-test")
        run_id = client.create_run(exp_id, run_name="stack-test").info.run_id
        client.log_metric(run_id, "recall_at_1", 0.75, step=1)
        artifact = tmp_path_factory.mktemp("art") / "embedding_report.txt"
        artifact.write_text("recall_at_1 0.75\n")
        client.log_artifact(run_id, str(artifact), artifact_path="reports")
        client.set_terminated(run_id)
    finally:
        os.environ.update(saved)
    return run_id


def test_artifact_logged_without_client_keys_lands_in_the_bucket(stack, logged):
    import mlflow

    run = mlflow.MlflowClient(stack.tracking_uri).get_run(logged)
    assert run.data.metrics["recall_at_1"] == 0.75
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server

    s3 = s3_client(stack.s3_endpoint, stack.credentials)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=stack.bucket, Prefix="artifacts/").get("Contents", [])]
    match = [k for k in keys if k.endswith(f"{logged}/artifacts/reports/embedding_report.txt")]
    assert match, keys
    body = s3.get_object(Bucket=stack.bucket, Key=match[0])["Body"].read()
    assert body == b"recall_at_1 0.75\n"


def test_ray_storage_filesystem_reads_and_writes_the_bucket(stack):
    path, fs = stack.ray_storage(prefix="ray-test")
    assert path == f"{stack.bucket}/ray-test"
    with fs.open_output_stream(f"{path}/run/marker.txt") as out:
        out.write(b"checkpoint shard 0")
    with fs.open_input_stream(f"{path}/run/marker.txt") as inp:
        assert inp.read() == b"checkpoint shard 0"
    # The same object through boto3, and through an endpoint string instead of the stack.
    s3 = s3_client(stack.s3_endpoint, stack.credentials)
    assert s3.get_object(Bucket=stack.bucket, Key="ray-test/run/marker.txt")["Body"].read() == b"checkpoint shard 0"
    path2, fs2 = ray_storage(stack.s3_endpoint, stack.bucket, "ray-test", credentials=stack.credentials)
    assert fs2.get_file_info(f"{path2}/run/marker.txt").size == len(b"checkpoint shard 0")


def test_mlflow_restart_keeps_records(stack, logged):
    import mlflow

    pid = int(stack.pid_file("mlflow").read_text())
    assert "stopped" in stack.stop_service("mlflow")
    assert not stack.is_running("mlflow") and not process_group_alive(pid)
    assert not stack.pid_file("mlflow").exists()
    assert stack.status()["mlflow"].running is False
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{stack.tracking_uri}/health", timeout=2)

    assert "started" in stack.start_service("mlflow")
    run = mlflow.MlflowClient(stack.tracking_uri).get_run(logged)
    assert run.data.metrics["recall_at_1"] == 0.75
    assert run.info.status == "FINISHED"


def test_up_twice_is_idempotent_and_status_reports_urls(stack, capsys):
    from services import cli

    pids = {n: stack.pid_file(n).read_text() for n in ("s3", "mlflow")}
    assert all("already running" in msg for msg in stack.up())
    # A fresh object on the same folder finds the ports and pids recorded by the first.
    again = Stack(stack.state_dir)
    assert again.tracking_uri == stack.tracking_uri and again.s3_endpoint == stack.s3_endpoint
    assert cli.main(["stack", "up", "--state-dir", str(stack.state_dir)]) == 0
    assert cli.main(["stack", "status", "--state-dir", str(stack.state_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("already running") == 2
    assert f"export MLFLOW_TRACKING_URI={stack.tracking_uri}" in out
    assert "SECRET" not in out and TEST_CREDENTIALS.secret_key not in out
    assert "mlflow  up" in out and stack.s3_endpoint in out
    assert {n: stack.pid_file(n).read_text() for n in ("s3", "mlflow")} == pids
    creds = Path(stack.state_dir) / "credentials.env"
    assert creds.stat().st_mode & 0o777 == 0o600


def test_port_in_use_is_a_clear_error_and_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for ports in ({"s3_port": port, "mlflow_port": free_port()}, {"s3_port": free_port(), "mlflow_port": port}):
            st = Stack(tmp_path / str(len(ports)), credentials=TEST_CREDENTIALS, s3_server="moto", store="sqlite",
                       **ports)
            with pytest.raises(StackError, match=f"port {port} on 127.0.0.1 is already in use"):
                st.up()
            assert not list(st.state_dir.glob("*.pid"))


def test_failed_start_shows_the_log_tail(stack, tmp_path):
    st = Stack(tmp_path, s3_port=stack.s3_port, mlflow_port=free_port(), credentials=TEST_CREDENTIALS,
               backend_store_uri="nosuchdb://nowhere", start_timeout=60)
    with pytest.raises(StackError, match=r"mlflow exited with code \d+ while starting; last lines of") as err:
        st.start_service("mlflow")
    assert "nosuchdb" in str(err.value)
    assert not st.pid_file("mlflow").exists()


def test_down_leaves_no_process_and_no_pid_file(stack):
    pids = [int(stack.pid_file(n).read_text()) for n in ("s3", "mlflow")]
    msgs = stack.down()
    assert all("stopped" in m for m in msgs)
    assert not list(Path(stack.state_dir).glob("*.pid"))
    assert not any(process_group_alive(p) for p in pids)  # server and its children (uvicorn)
    assert all(not s.running for s in stack.status().values())
    assert stack.down() == ["mlflow not running", "s3 not running"]


def test_secrets_stay_off_command_lines_and_reprs(tmp_path):
    st = Stack(tmp_path, s3_port=free_port(), mlflow_port=free_port(), credentials=TEST_CREDENTIALS,
               backend_store_uri="postgresql://mlflow:db-pass@127.0.0.1:5432/mlflow")
    cmd, env = st._mlflow_command(TEST_CREDENTIALS)
    assert not any("db-pass" in c or TEST_CREDENTIALS.secret_key in c for c in cmd)
    assert env["MLFLOW_BACKEND_STORE_URI"].endswith("@127.0.0.1:5432/mlflow")
    assert env["AWS_SECRET_ACCESS_KEY"] == TEST_CREDENTIALS.secret_key  # the server's env only
    assert "db-pass" not in st.status()["mlflow"].line()
    assert TEST_CREDENTIALS.secret_key not in repr(TEST_CREDENTIALS)


def test_auth_is_opt_in_remembered_and_keeps_its_secrets_off_command_lines(tmp_path, monkeypatch):
    plain = Stack(tmp_path / "plain", s3_port=free_port(), mlflow_port=free_port(), db_port=free_port(),
                  credentials=TEST_CREDENTIALS)
    cmd, env = plain._mlflow_command(TEST_CREDENTIALS)
    assert "--app-name" not in cmd and not any(k.startswith("MLFLOW_AUTH") for k in env)  # as before --auth
    with pytest.raises(StackError, match="without authentication: it has no users"):
        plain.add_user("ana", "reader")

    authed = Stack(tmp_path / "auth", s3_port=free_port(), mlflow_port=free_port(), db_port=free_port(),
                   credentials=TEST_CREDENTIALS, auth=True)
    authed.state_dir.mkdir()
    cmd, env = authed._mlflow_command(TEST_CREDENTIALS)
    assert cmd[cmd.index("--app-name") + 1] == "basic-auth" and "--enable-workspaces" in cmd
    user, password = authed.admin_login()
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == password and env["MLFLOW_FLASK_SERVER_SECRET_KEY"]
    assert not any(password in c for c in cmd)
    assert (authed.state_dir / "mlflow-admin.env").stat().st_mode & 0o777 == 0o600
    assert password not in (authed.state_dir / "basic_auth.ini").read_text()
    # MLflow creates the admin once: every later start passes the same password.
    assert authed._mlflow_command(TEST_CREDENTIALS)[1]["MLFLOW_AUTH_ADMIN_PASSWORD"] == password
    authed._save_state()
    assert Stack(authed.state_dir).auth is True and password not in (authed.state_dir / "stack.json").read_text()
    assert "postgresql+psycopg2://proxydml@127.0.0.1:" in (authed.state_dir / "basic_auth.ini").read_text()
    (authed.state_dir / "mlflow-admin.env").unlink()
    # The auth database holds its users (the table the auth app creates with the admin).
    monkeypatch.setattr(postgres, "has_table", lambda state, port, db, table: (db, table) == ("mlflow_auth", "users"))
    with pytest.raises(StackError, match="admin password .* is gone"):
        authed._mlflow_command(TEST_CREDENTIALS)


def test_the_default_stack_is_durable_and_refuses_rather_than_forgets(tmp_path, monkeypatch):
    st = Stack(tmp_path / "default")
    assert (st.store, st.s3_server, st.services) == ("postgresql", "swift", ("db", "s3", "mlflow"))
    assert "psycopg2://proxydml@127.0.0.1:" in Stack(tmp_path / "d2", db_port=5999).backend_store_uri
    assert "password" not in Stack(tmp_path / "d2", db_port=5999).backend_store_uri

    monkeypatch.setattr(swift, "installed", lambda: False)
    monkeypatch.setattr(stack_module.shutil, "which", lambda name: None)
    with pytest.raises(StackError, match="no durable S3-compatible server is installed: .*pip install swift"):
        Stack(tmp_path / "no-s3").up()
    monkeypatch.undo()
    monkeypatch.setattr(postgres, "installed", lambda: False)
    with pytest.raises(StackError, match=r"PostgreSQL, which is not installed here: .*apt-get install postgresql.*"
                                         r"--single-user"):
        Stack(tmp_path / "no-pg").up()
    with pytest.raises(StackError, match="--auth serves a team and keeps its users in PostgreSQL"):
        Stack(tmp_path / "auth-sqlite", store="sqlite", auth=True).up()
    for folder in ("no-s3", "no-pg", "auth-sqlite"):  # refused before anything was written
        assert not (tmp_path / folder).exists()


def test_a_state_folder_keeps_its_store_and_servers(tmp_path):
    first = Stack(tmp_path, store="sqlite", s3_server="moto", credentials=TEST_CREDENTIALS)
    first._save_state()
    again = Stack(tmp_path)
    assert (again.store, again.s3_server, again.services) == ("sqlite", "moto", ("s3", "mlflow"))
    assert again.backend_store_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_swift_keys_name_the_account_and_configs_keep_the_secret_private(tmp_path):
    with pytest.raises(ValueError, match="proxydml:USER"):
        swift.check_credentials(Credentials("plain-key", "secret-secret"))
    creds = swift.generate_credentials()
    swift.check_credentials(creds)
    swift.prepare(tmp_path, free_port(), creds)
    ports = swift.ring_ports(tmp_path)
    assert set(ports) == {"account", "container", "object"}
    suffix = (tmp_path / "swift.conf").read_text()
    swift.prepare(tmp_path, free_port(), creds)  # a restart keeps the placement of every object
    assert swift.ring_ports(tmp_path) == ports and (tmp_path / "swift.conf").read_text() == suffix
    proxy = tmp_path / "proxy-server.conf"
    assert creds.secret_key in proxy.read_text() and proxy.stat().st_mode & 0o777 == 0o600
    assert creds.secret_key not in " ".join(swift.command(tmp_path))


def test_postgres_refuses_a_folder_its_account_cannot_enter(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root hands the server to the postgres account")  # as a user it runs as that user
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp())  # pytest's own tmp_path sits under a 0700 folder
    try:
        base.chmod(0o755)
        postgres.check_reachable(base / "open" / "postgres")  # every ancestor can be entered
        locked = base / "locked"
        (locked / "inner").mkdir(parents=True)
        locked.chmod(0o700)
        with pytest.raises(PermissionError, match=f"cannot enter {locked} .*mode 700"):
            postgres.check_reachable(locked / "inner" / "postgres")
    finally:
        shutil.rmtree(base)
