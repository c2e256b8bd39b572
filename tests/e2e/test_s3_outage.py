"""The S3 server goes away in the middle of a checkpoint upload and comes back seconds later.

Ray Train stores its checkpoints on the stack's S3 server (moto over HTTP on 127.0.0.1) through
a loopback TCP relay. The relay cuts the connection that carries the second checkpoint's
``model.pt`` halfway through its body, refuses every connection for a few seconds, then listens
again on the same port. The run must complete, every checkpoint Ray registered must be whole
in the bucket, nothing half written may be left behind, MLflow must hold every epoch once,
and the workers' logs must say what happened while S3 was down.

Why a relay and not a restart of moto: moto 5.2 keeps the bucket in memory (a killed server
loses every object) and its only persistence, the request recorder, replays the recorded
requests into a fresh server, which is not a server coming back with its data. SIGSTOP of
moto would model a hung server, not an unreachable one. The relay makes the endpoint itself
go away (connections refused, open ones reset) while the storage behind it survives: what a
restarted MinIO or a network blip looks like to the client.

Two quick tests (the stack, no Ray) pin the two product mechanisms underneath:
``verify_upload`` catches the upload failure that ``pyarrow.fs.copy_files`` swallows, and
``retry_upload`` rides out an outage longer than the S3 client's own retries.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading

import pyarrow.fs
import pytest
import ray
import torch
from mlflow.tracking import MlflowClient
from ray.util.state import get_log, list_logs

from pipelines.checkpoint import CHECKPOINT_FILES, loss_shard_file
from pipelines.train import load_model
from services import training
from services.net import HOST, free_port
from services.runtime import UPLOAD_RETRY_ENV, retry_upload, verify_upload
from services.s3 import list_keys, retrying_s3_filesystem, s3_client
from services.stack import Stack

pytestmark = pytest.mark.e2e

EPOCHS = 3
WORKERS = 2
# Longer than a moment, shorter than the ~25 s each S3 request retries for on its own.
DOWN_S = 8.0
# The request that uploads rank 0's model.pt into a Ray checkpoint folder (a PutObject or an
# UploadPart of a multipart upload: both are PUTs of the key).
MODEL_PUT = re.compile(rb"PUT /[^ ?]*/(checkpoint_[^/ ?]+)/model\.pt[ ?]")
ANY_MODEL_PUT = re.compile(rb"PUT /[^ ?]*/model\.pt[ ?]")


class FlakyRelay:
    """A TCP relay on 127.0.0.1 in front of ``target_port`` that can go down and come back.

    - ``arm(pattern, nth, down_s)``: the request whose head matches ``pattern`` for the
      ``nth`` time is cut after half of its body went through; at that moment the listening
      socket closes (connections refused) and every open connection is dropped; ``down_s``
      seconds later the relay listens again on the same port.
    - ``drop(pattern)``: every request matching ``pattern`` has its connection cut after its
      head (other traffic passes) until ``drop(None)``.
    """

    def __init__(self, target_port: int) -> None:
        self.target = (HOST, target_port)
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._armed: re.Pattern[bytes] | None = None
        self._dropping: re.Pattern[bytes] | None = None
        self._nth = 0
        self._seen = 0
        self._down_s = 0.0
        self.cut: dict[str, object] = {}  # the cut request: checkpoint folder, object size
        self.went_down = threading.Event()
        self.came_back = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The same port again right after the outage, despite connections left in TIME_WAIT.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, self.port))
        listener.listen(64)
        listener.settimeout(0.2)  # the accept loop polls, so closing the listener ends it
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True).start()

    def go_down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            listener.close()
        for s in conns:
            _drop(s)
        self.went_down.set()

    def come_up(self) -> None:
        if not self._closed:
            self.start()
            self.came_back.set()

    def close(self) -> None:
        self._closed = True
        self.go_down()

    def arm(self, pattern: re.Pattern[bytes], nth: int, down_s: float) -> None:
        self._armed, self._nth, self._down_s = pattern, nth, down_s

    def drop(self, pattern: re.Pattern[bytes] | None) -> None:
        self._dropping = pattern

    # -- relaying --------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by go_down
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _drop(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _drop(client)
                    _drop(upstream)
                    return
                self._conns |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        cut_after: int | None = None  # bytes still to pass before this connection is cut
        outage = False
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if inspect and cut_after is None:
                    cut_after, outage = self._watch(data)
                if cut_after is not None:
                    dst.sendall(data[:cut_after])
                    cut_after -= min(cut_after, len(data))
                    if cut_after == 0:
                        if outage:
                            self.go_down()
                            threading.Timer(self._down_s, self.come_up).start()
                        return
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _drop(src)
            _drop(dst)

    def _watch(self, data: bytes) -> tuple[int | None, bool]:
        """(bytes of this stream to pass before the cut, whether the relay goes down then)."""
        head_end = data.find(b"\r\n\r\n")
        head = len(data) if head_end < 0 else head_end + 4
        if self._dropping is not None and self._dropping.search(data[:head]):
            return head, False
        match = self._armed.search(data[:head]) if self._armed is not None else None
        if match is None:
            return None, False
        self._seen += 1
        if self._seen != self._nth:
            return None, False
        self._armed = None  # one outage
        # The AWS SDK streams the body (aws-chunked); this header holds the object's size.
        size = re.search(rb"(?i)\r\nx-amz-decoded-content-length: *(\d+)", data[:head])
        declared = int(size.group(1)) if size else 0
        self.cut.update(checkpoint=match.group(1).decode(), size=declared)
        # The head now and half of the body (in this chunk or the next ones), then the cut.
        return head + max(declared // 2, 1), True


def _drop(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture
def relay(stack):
    r = FlakyRelay(stack.s3_port)
    r.start()
    yield r
    r.close()


def _bucket_keys(stack: Stack, prefix: str) -> list[str]:
    return list_keys(s3_client(stack.s3_endpoint, stack.credentials), stack.bucket, prefix)


def _relay_fs(stack: Stack, relay: FlakyRelay, max_attempts: int) -> pyarrow.fs.S3FileSystem:
    creds = stack.credentials
    return retrying_s3_filesystem(
        max_attempts, access_key=creds.access_key, secret_key=creds.secret_key, region=creds.region,
        endpoint_override=f"{HOST}:{relay.port}", scheme="http",
    )


def _local_checkpoint(tmp_path) -> os.PathLike[str]:
    d = tmp_path / "local"
    d.mkdir()
    for name, size in (("config.yaml", 300), ("model.pt", 200_000), ("trainer_state.json", 500)):
        (d / name).write_bytes(os.urandom(size))
    return d


def test_verify_upload_catches_the_failed_upload_copy_files_swallows(stack, relay, tmp_path):
    local = _local_checkpoint(tmp_path)
    fs = _relay_fs(stack, relay, max_attempts=2)
    dest = f"{stack.bucket}/verify/checkpoint_a"
    relay.drop(ANY_MODEL_PUT)  # every upload of model.pt fails; the other files go through
    try:
        pyarrow.fs.copy_files(str(local), dest, destination_filesystem=fs, use_threads=False)
    except OSError:
        pass  # a pyarrow that reports the failure is fine too; 25.0.1 returns success
    with pytest.raises(OSError, match=r"incomplete: model\.pt \(missing\)"):
        verify_upload(local, fs, dest)
    relay.drop(None)
    pyarrow.fs.copy_files(str(local), dest, destination_filesystem=fs, use_threads=False)
    verify_upload(local, fs, dest)  # complete now: no error


def test_retry_upload_rides_out_an_outage_longer_than_the_client_retries(stack, relay, tmp_path, caplog):
    local = _local_checkpoint(tmp_path)
    fs = _relay_fs(stack, relay, max_attempts=3)  # each request gives up after ~0.2 s
    dest = f"{stack.bucket}/retry/checkpoint_b"

    def upload() -> str:
        pyarrow.fs.copy_files(str(local), dest, destination_filesystem=fs, use_threads=False)
        verify_upload(local, fs, dest)
        return dest

    relay.go_down()
    with pytest.raises(OSError):  # no budget: one attempt, the error goes to Ray
        retry_upload(upload, label="checkpoint b (rank 0)", budget_s=0)
    threading.Timer(3.0, relay.come_up).start()
    caplog.set_level(logging.WARNING, logger="proxydml.checkpoint")
    assert retry_upload(upload, label="checkpoint b (rank 0)", budget_s=60) == dest
    assert relay.came_back.is_set()
    text = caplog.text
    assert "checkpoint b (rank 0): upload attempt 1 failed, storage unreachable? retrying in" in text
    assert re.search(r"checkpoint b \(rank 0\): uploaded after [2-9] attempt", text), text
    verify_upload(local, fs, dest)


@pytest.mark.ray
def test_s3_outage_during_checkpoint_upload_is_retried_and_leaves_no_half_checkpoint(
    ray_cluster, stack, relay, monkeypatch, tmp_path, digits_config
):
    # Ray storage goes through the relay; the MLflow server keeps its direct line to moto, so
    # what goes away is only the endpoint the Train workers and controller use.
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.credentials.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.credentials.secret_key)
    monkeypatch.setenv(UPLOAD_RETRY_ENV, "120")  # far above the outage; a failure stays quick
    cfg = digits_config(stack.tracking_uri, f"s3://{stack.bucket}/ray", "tracking.experiment=s3-outage-e2e",
                        "tracking.run_name=s3-outage", epochs=EPOCHS, steps=4, workers=WORKERS)
    relay.arm(MODEL_PUT, nth=2, down_s=DOWN_S)  # epoch 2's checkpoint, mid-upload

    outcome = training.train(cfg, log_model=False)

    assert relay.went_down.is_set() and relay.came_back.is_set(), "the outage never happened"
    cut = relay.cut["checkpoint"]
    run_prefix = f"ray/{cfg.run_name()}/"

    # Which checkpoints Ray registered (num_to_keep=2: the last two epochs).
    s3 = s3_client(stack.s3_endpoint, stack.credentials)
    snapshot = json.loads(s3.get_object(
        Bucket=stack.bucket, Key=f"{run_prefix}checkpoint_manager_snapshot.json")["Body"].read())
    registered = {r["checkpoint_dir_name"]: r["metrics"] for r in snapshot["checkpoint_results"]}
    assert sorted(int(m["epoch"]) for m in registered.values()) == [EPOCHS - 1, EPOCHS]
    assert cut in registered, (cut, registered)  # the cut upload was retried, not abandoned

    # Every checkpoint folder in the bucket is a registered one (no half-written leftover),
    # and each holds every rank's files, whole: each one loads.
    keys = _bucket_keys(stack, run_prefix)
    folders = {k[len(run_prefix):].split("/", 1)[0] for k in keys
               if k[len(run_prefix):].startswith("checkpoint_") and "/" in k[len(run_prefix):]}
    assert folders == set(registered), (folders, registered)
    expected = set(CHECKPOINT_FILES) | {loss_shard_file(r) for r in range(WORKERS)}
    for name, metrics in registered.items():
        files = {k.rsplit("/", 1)[1] for k in keys if k.startswith(f"{run_prefix}{name}/")} - {""}
        assert files == expected, (name, files)
        local = tmp_path / name
        local.mkdir()
        for f in files:
            s3.download_file(stack.bucket, f"{run_prefix}{name}/{f}", str(local / f))
            if f.endswith(".pt"):
                torch.load(local / f, map_location="cpu", weights_only=True)
        state = json.loads((local / "trainer_state.json").read_text())
        assert state["epoch"] == int(metrics["epoch"]) and state["world_size"] == WORKERS
        assert [h["epoch"] for h in state["history"]] == list(range(1, state["epoch"] + 1))
        assert state["resumes"] == 0  # ridden out in place: no worker-group restart
        load_model(local)
    # The object cut halfway has the size the worker announced for its local file.
    head = s3.head_object(Bucket=stack.bucket, Key=f"{run_prefix}{cut}/model.pt")
    assert head["ContentLength"] == relay.cut["size"] > 0

    assert outcome.metrics["epoch"] == EPOCHS
    client = MlflowClient(stack.tracking_uri)
    assert client.get_run(outcome.mlflow_run_id).info.status == "FINISHED"
    for key in ("loss", "recall_at_1", "map_at_r"):
        steps = [m.step for m in client.get_metric_history(outcome.mlflow_run_id, key)]
        assert steps == list(range(1, EPOCHS + 1)), (key, steps)

    # The worker said so while S3 was away. Read from the worker's own log file (what
    # `ray logs` shows): Ray's forwarding of it to the driver runs seconds behind on a loaded
    # machine, while the file holds the line before the upload returns.
    logs = _worker_stderr()
    print("".join(line + "\n" for line in logs.splitlines() if cut in line))  # -s: what a user saw
    assert re.search(rf"checkpoint {cut} \(rank 0\): upload attempt 1 (still running|failed)", logs), logs[-3000:]
    assert re.search(rf"checkpoint {cut} \(rank 0\): uploaded after", logs), logs[-3000:]


def _worker_stderr() -> str:
    """The stderr of every Ray worker process on this node, as Ray's log files hold it."""
    node = ray.get_runtime_context().get_node_id()
    names = [n for group in list_logs(node_id=node, glob_filter="worker-*.err").values() for n in group]
    return "".join(chunk for name in sorted(names) for chunk in get_log(filename=name, node_id=node))
