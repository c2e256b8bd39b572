"""A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: separate raylets
and object stores) with no shared state: S3 and MLflow from the local stack, each node its own
data cache ($PROXYDML_CACHE).

In order, on one cluster (started once; ~7 s):

1. node-local checkpoints or tracking are refused before anything starts;
2. an elastic ``1-2`` worker run (one worker per node) reads ``data.root=s3://...`` (each
   node's cache filled once, counted in the S3 server's request log), loses a node during
   epoch 2, continues on the worker left with its proxies merged onto it, finishes with one
   complete MLflow history, and ends where the same worker-count schedule replayed from
   checkpoints ends;
3. a 4-trial sweep loses a node (added back first) and finishes every trial;
4. ``proxydml submit`` ships the working directory and trains on both nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from mlflow.tracking import MlflowClient
from ray.util.state import list_actors

from pipelines.config import load_config
from services import runtime, sweep, training
from services.cli import main as cli_main
from services.s3 import s3_client
from services.stack import Stack
from tests.cluster.test_which_cluster import no_mlflow_runs
from tests.distributed import whole_run_workers as replay
from tests.distributed.launch import launch
from tests.distributed.test_whole_run import LOSS_REL, STATE_TOL
from tests.e2e.test_retrain import write_digits_snapshot

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

CPUS_PER_NODE = 2
EPOCHS = 4


@dataclass
class MultiNode:
    cluster: Any  # ray.cluster_utils.Cluster
    stack: Stack
    caches: dict[str, Path]  # node name -> its $PROXYDML_CACHE
    worker: Any  # the non-head node (ray._private.node.Node)
    root: Path

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_worker(self, name: str) -> Any:
        """A node with its own disk: its own data cache and Ray temp folder (on one machine the
        nodes would otherwise share the session folder, and a job's working_dir unpacked for
        this node's workers would replace the head's copy under the running job)."""
        self.caches[name] = self.root / f"cache-{name}"
        self.worker = self.cluster.add_node(num_cpus=CPUS_PER_NODE, temp_dir=str(self.root / f"tmp-{name}"),
                                            env_vars={"PROXYDML_CACHE": str(self.caches[name])})
        self.cluster.wait_for_nodes()
        return self.worker


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture(scope="module")
def multinode(stack):
    """Head (the driver's node) + one worker node, 2 CPUs each, torn down at the end.

    The environment set here reaches every Ray process (they inherit the raylets'): the stack's
    S3 endpoint and keys, the MLflow server, a private Ray temp folder (its
    ray_current_cluster must not reach other Ray users), and each node's own data cache.
    """
    from ray.cluster_utils import Cluster

    root = Path(tempfile.mkdtemp(prefix="pdml-mn-", dir="/tmp"))  # short: Ray's socket paths
    env = {**stack.client_env(with_credentials=True), "RAY_TMPDIR": str(root),
           "PROXYDML_CACHE": str(root / "cache-head"),
           # A restart after a lost node first asks for the old worker count (Ray's resource view
           # lags); the default 60 s wait for it to start would dominate the test.
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime.shutdown_ray()  # a session's local instance must not stand in for the cluster
    cluster = None
    try:
        started = time.monotonic()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE,
                                                                "dashboard_host": "127.0.0.1"})
        nodes = MultiNode(cluster, stack, {"head": root / "cache-head"}, None, root)
        nodes.add_worker("node1")
        runtime.ensure_ray(cluster.address)
        print(f"\ncluster of 2 nodes up in {time.monotonic() - started:.1f} s")
        yield nodes
    finally:
        runtime.shutdown_ray()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


def _actors(multinode: MultiNode, class_name: str) -> list[Any]:
    """Every actor of ``class_name`` the cluster has run, ended ones included."""
    return list_actors(address=multinode.address, filters=[("class_name", "=", class_name)], limit=10_000)


def _history(client: MlflowClient, run_id: str, key: str = "map_at_r") -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


# ---------------------------------------------------------------- 1. refusal ----------------
def test_node_local_state_is_refused_before_anything_starts(multinode, tmp_path, capsys):
    assert runtime.alive_nodes() == 2
    runs, uri = tmp_path / "runs", f"sqlite:///{tmp_path / 'mlflow.db'}"
    local = [f"tracking.storage_path={runs}", f"tracking.tracking_uri={uri}", "train.epochs=1"]
    cases = [
        (["train", "--address", multinode.address, *local],
         ["tracking.storage_path=", "tracking.tracking_uri=sqlite:///"]),
        (["tune", "--address", multinode.address, "--space", "digits_quick", "--samples", "2", *local],
         ["tracking.storage_path=", "tracking.tracking_uri=sqlite:///"]),
        # Checkpoints on S3 but the tracking store a local file: only that is named.
        (["train", "--address", multinode.address, "tracking.storage_path=s3://proxydml/refused",
          f"tracking.tracking_uri={uri}"], ["tracking.tracking_uri=sqlite:///"]),
    ]
    for argv, named in cases:
        capsys.readouterr()
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: the Ray cluster has 2 nodes and ") and "\n" not in err, err
        for setting in named:
            assert setting in err, (setting, err)
        assert ("tracking.storage_path=" in err) == ("tracking.storage_path=" in named[0])
    # Nothing left behind: no checkpoint folder, no MLflow run, no Ray Train run on the cluster.
    assert not runs.exists()
    assert no_mlflow_runs(uri)
    assert not _actors(multinode, "TrainController")
    assert not list(s3_client().list_objects_v2(Bucket="proxydml", Prefix="refused").get("Contents", []))


# ---------------------------------------------------------------- 2. elastic + S3 data -------
def _moto(stack: Stack, action: str) -> requests.Response:
    """moto's request recorder (``/moto-api/recorder/...``): what the S3 server was asked."""
    method = requests.get if action == "download-recording" else requests.post
    reply = method(f"{stack.s3_endpoint}/moto-api/recorder/{action}", timeout=30)
    reply.raise_for_status()
    return reply


def _object_gets(stack: Stack, prefix: str) -> dict[str, int]:
    """GET requests per object key under ``prefix`` since recording started."""
    counts: dict[str, int] = {}
    for line in _moto(stack, "download-recording").text.splitlines():
        entry = json.loads(line)
        path = entry["url"].split("://", 1)[-1].split("/", 1)[-1].split("?", 1)[0]
        if entry["method"] == "GET" and path.startswith(prefix):
            counts[path] = counts.get(path, 0) + 1
    return counts


def _wait_for(condition, what: str, thread: threading.Thread, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert thread.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _checkpoint_files(client: MlflowClient, run_id: str, dest: Path) -> Path:
    return Path(client.download_artifacts(run_id, "checkpoint", str(dest)))


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state = dict(torch.load(folder / "model.pt", weights_only=True))
    shards = [torch.load(f, weights_only=True) for f in [folder / "loss.pt", *sorted(folder.glob("loss.rank*.pt"))]]
    state["proxies"] = torch.cat([s["proxies"] for s in shards])
    return state


def _replay(schedule: dict[int, int], data_root: Path, extra: list[str], out: Path) -> Path:
    """The same run on a fixed worker count per epoch range (forked torch workers + gloo, no Ray), each
    range resuming from the checkpoint the previous one wrote: the elastic run's schedule."""
    starts = sorted(schedule)
    for i, first in enumerate(starts):
        last = starts[i + 1] - 1 if i + 1 < len(starts) else EPOCHS
        world = schedule[first]
        store = out.parent / f"store-{first}"
        launch(replay.train_worker, world, (world, str(store), str(data_root), str(out), [*extra, f"train.epochs={last}"]))
    return out / f"checkpoint_{EPOCHS:06d}"


def test_elastic_run_loses_a_node_and_finishes_from_its_checkpoint(multinode, tmp_path, capsys):
    stack = multinode.stack
    # The data set, uploaded with its manifest: 500 training images, ~10 steps an epoch.
    folder = write_digits_snapshot(tmp_path / "digits-png", "digits-png", train_per_class=100, test_per_class=40)
    assert cli_main(["data", "push", str(folder), "s3://proxydml/data/digits-png"]) == 0
    data_root = "s3://proxydml/data/digits-png"
    # The recipe of the whole-run equivalence tests (6 samples of 4 classes, digits has 5
    # training classes), on 1-2 workers of a whole node each: one per node, so losing a node
    # loses a worker and the run goes on with the other.
    extra = ["data.batch_size=24", "data.samples_per_class=6", "data.eval_batch_size=64",
             f"scaling.cpus_per_worker={CPUS_PER_NODE}"]
    cfg = load_config(None, replay.overrides(data_root, *extra, "scaling.num_workers=1-2", "scaling.max_failures=2",
                                             f"train.epochs={EPOCHS}", "tracking.run_name=elastic",
                                             "tracking.storage_path=s3://proxydml/cluster-runs",
                                             f"tracking.tracking_uri={stack.tracking_uri}"))
    _moto(stack, "reset-recording")
    _moto(stack, "start-recording")
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = training.train(cfg, log_model=False)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=train)
    thread.start()
    s3 = s3_client()
    # Ray Train writes this file once a reported checkpoint is registered: epoch 1 is safe on
    # S3 and epoch 2 is running. Then the second node goes, with its workers.
    _wait_for(lambda: s3.list_objects_v2(Bucket="proxydml", Prefix="cluster-runs/elastic/checkpoint_manager_snapshot.json")
              .get("KeyCount", 0) > 0, "the first checkpoint", thread)
    multinode.cluster.remove_node(multinode.worker)
    removed_at = time.monotonic() - started
    thread.join(timeout=600)
    seconds = time.monotonic() - started
    _moto(stack, "stop-recording")
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    print(f"\nelastic run: node removed at {removed_at:.0f} s, finished in {seconds:.0f} s")

    assert result.metrics["epoch"] == EPOCHS
    client = MlflowClient(stack.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "map_at_r", "recall_at_1"):
        assert _history(client, run.info.run_id, key) == list(range(1, EPOCHS + 1)), key  # complete, no duplicate
    schedule = {int(k.removeprefix("workers.epoch_")): int(v) for k, v in run.data.tags.items()
                if k.startswith("workers.epoch_")}
    resumed_at = max(schedule)
    assert schedule[1] == 2 and schedule[resumed_at] == 1 and 2 <= resumed_at <= EPOCHS, schedule
    ckpt = _checkpoint_files(client, run.info.run_id, tmp_path / "elastic")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 1 and state["resumes"] == 1
    assert sorted(p.name for p in ckpt.glob("loss*.pt")) == ["loss.pt"]  # both shards merged onto 1

    # Each node filled its cache once: every data file was read from S3 exactly twice (head:
    # the driver's preflight, its worker reuses it; node1: its worker). Workers of one node
    # waiting for one fill: test_pushed_data_set_is_fetched_once_per_node_and_verified.
    gets = _object_gets(stack, "proxydml/data/digits-png/")
    files = [k for k in gets if not k.endswith("/manifest.json")]
    assert len(files) == 700 and set(gets[k] for k in files) == {2}, sorted(set(gets.values()))
    for name in ("head", "node1"):
        [cached] = [p for p in (multinode.caches[name] / "data").iterdir() if p.is_dir()]
        assert (cached / ".complete").is_file() and len(list(cached.rglob("*.png"))) == 700

    # The same worker-count schedule replayed from checkpoints ends on the same model.
    local_copy = next(p for p in (multinode.caches["head"] / "data").iterdir() if p.is_dir())
    replayed = _replay(schedule, local_copy, extra, tmp_path / "replay")
    want, got = _state(replayed), _state(ckpt)
    assert set(got) == set(want)
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, atol=STATE_TOL, rtol=STATE_TOL, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(got[key], value), key
    replay_history = json.loads((replayed / "trainer_state.json").read_text())["history"]
    assert [h["loss"] for h in state["history"]] == pytest.approx([h["loss"] for h in replay_history], rel=LOSS_REL)


# ---------------------------------------------------------------- 3. sweep ------------------
SWEEP_EPOCHS = 10  # long enough that all four trials overlap (they start seconds apart)


def test_sweep_loses_a_node_and_finishes_every_trial(multinode, tmp_path):
    stack = multinode.stack
    if runtime.alive_nodes() < 2:
        multinode.add_worker("node2")
    # One-worker trials of one CPU: each trains in its Tune trial's own process, two per node.
    base = load_config("digits", ["scaling.num_workers=1", "scaling.cpus_per_worker=1", "scaling.max_failures=3",
                                  f"train.epochs={SWEEP_EPOCHS}",
                                  "train.max_steps_per_epoch=10", "tracking.storage_path=s3://proxydml/sweeps",
                                  f"tracking.tracking_uri={stack.tracking_uri}"])
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = sweep.run_sweep(base, "digits_quick", samples=4, scheduler="none", search="random",
                                                max_concurrent=4)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            outcome["error"] = exc

    client = MlflowClient(stack.tracking_uri)
    s3 = s3_client()
    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()

    def children() -> list:
        parents = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                     filter_string="tags.kind = 'sweep'")
        if not parents:
            return []
        exp = parents[0].info.experiment_id
        return client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")

    def trial_prefix(child) -> str:
        # The trial's folder in the sweep storage is named as its run (runtime._trial_dirname).
        return f"sweeps/{child.data.tags['sweep_name']}/{child.info.run_name}/"

    def all_running_with_a_checkpoint() -> bool:
        # Four trials of 1 CPU on 4 CPUs: two run on the node about to go. Each has epochs left
        # and logged epoch 2, so its epoch-1 checkpoint went to S3 (and Tune registered it) an
        # epoch ago: the two lost ones must resume from theirs.
        kids = children()
        return len(kids) == 4 and all(2 <= len(_history(client, c.info.run_id)) < SWEEP_EPOCHS for c in kids)

    _wait_for(all_running_with_a_checkpoint, "four running trials with a checkpoint each", thread)
    multinode.cluster.remove_node(multinode.worker)
    removed_at = time.monotonic() - started
    thread.join(timeout=900)
    assert "error" not in outcome, outcome.get("error")
    out = outcome["result"]
    print(f"\nsweep: node removed at {removed_at:.0f} s, finished in {time.monotonic() - started:.0f} s")

    assert len(out.trials) == 4, out.trials
    assert all(t["error"] is None and t["epochs"] == SWEEP_EPOCHS for t in out.trials), out.trials
    kids = children()
    resumes = []
    for child in kids:
        assert client.get_run(child.info.run_id).info.status == "FINISHED"
        assert _history(client, child.info.run_id) == list(range(1, SWEEP_EPOCHS + 1)), child.data.tags["trial_id"]
        listing = s3.list_objects_v2(Bucket="proxydml", Prefix=trial_prefix(child))
        states = sorted(o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith("trainer_state.json"))
        resumes.append(json.loads(s3.get_object(Bucket="proxydml", Key=states[-1])["Body"].read())["resumes"])
    # The trials that ran on the lost node resumed from their checkpoints on S3, elsewhere.
    assert len(kids) == 4 and sum(r >= 1 for r in resumes) >= 2, resumes


# ---------------------------------------------------------------- 4. submit -----------------
def test_submit_ships_the_working_directory_and_trains_on_both_nodes(multinode, tmp_path, capsys, monkeypatch):
    if runtime.alive_nodes() < 2:
        multinode.add_worker("node3")
    project = tmp_path / "project"
    project.mkdir()
    # A recipe that exists only in the submitting folder: the job finds it on the cluster. Two
    # workers of 2 CPUs on nodes of 2 CPUs: one per node (two processes fewer than 4 x 1 CPU).
    (project / "my_recipe.yaml").write_text("train: {epochs: 1, max_steps_per_epoch: 3}\n"
                                            f"scaling: {{num_workers: 2, cpus_per_worker: {CPUS_PER_NODE}}}\n")
    earlier = {a.actor_id for a in _actors(multinode, "RayTrainWorker")}
    monkeypatch.chdir(project)
    dashboard = "http://" + multinode.cluster.webui_url
    capsys.readouterr()
    code = cli_main(["submit", "--address", dashboard, "--", sys.executable, "-m", "services.cli", "train", "--config",
                     "my_recipe.yaml", "tracking.storage_path=s3://proxydml/submitted", "tracking.run_name=submitted"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "ended: SUCCEEDED" in out and "unseen-class retrieval" in out
    client = MlflowClient(multinode.stack.tracking_uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string="tags.ray_run_name = 'submitted'")
    assert run.info.status == "FINISHED" and run.data.tags["workers.epoch_1"] == "2"
    workers = _actors(multinode, "RayTrainWorker")
    assert len({a.node_id for a in workers if a.actor_id not in earlier}) == 2  # both nodes


def test_index_build_embeds_on_both_nodes_and_matches_one_node(multinode, tmp_path):
    """The gallery embedding pass (Ray Data) spreads its actors over both nodes -- seen in the
    index manifest, which counts the rows each node's actor embedded -- and the index it
    builds holds the same ids and vectors as a build embedded by one actor on one node."""
    import numpy as np
    import ray

    from pipelines.gallery import read_embeddings
    from pipelines.index import read_index
    from pipelines.tracking import LocalReporter
    from pipelines.train import run
    from services import registry
    from services.index import BuildRequest, build
    from services.mlflow_tracking import ensure_experiment

    if runtime.alive_nodes() < 2:
        multinode.add_worker("node4")
    uri = multinode.stack.tracking_uri
    run(load_config("digits", ["train.epochs=1", "train.max_steps_per_epoch=3", "scaling.num_workers=1"]),
        LocalReporter(tmp_path / "run"))
    client = MlflowClient(uri)
    run_id = client.create_run(ensure_experiment(client, "digits-index", uri)).info.run_id
    client.log_artifacts(run_id, str(sorted((tmp_path / "run").glob("checkpoint_*"))[-1]), "checkpoint")
    client.set_terminated(run_id)
    registry.register_version(client, "digits-index", run_id=run_id, tags={}, description="test", promote_it=True)

    def contents(concurrency: int | None, name: str) -> tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray]:
        result = build(BuildRequest(model="digits-index/1", gallery="unseen", tracking_uri=uri,
                                    concurrency=concurrency), log=lambda _: None)
        folder = Path(client.download_artifacts(result.index_run_id, "index", str(tmp_path / name)))
        manifest = json.loads((folder / "manifest.json").read_text())
        ids, vectors = zip(*[(i, v) for i, v, _ in read_embeddings(folder / "embeddings")])
        index = read_index(folder / "index.faiss")
        stored = index.index.reconstruct_n(0, index.ntotal) if hasattr(index, "index") else None
        return manifest["nodes"], np.concatenate(ids), np.concatenate(vectors), stored

    nodes_two, ids_two, vectors_two, index_two = contents(None, "two")
    nodes_one, ids_one, vectors_one, index_one = contents(1, "one")
    print(f"\nrows embedded per node: {sorted(nodes_two.values())}")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes_two) == 2 and set(nodes_two) <= alive and min(nodes_two.values()) > 0, nodes_two
    assert len(nodes_one) == 1 and sum(nodes_one.values()) == sum(nodes_two.values()) == len(ids_two)
    # Same ids in the same order; the same vectors bit for bit (same weights, same batches of
    # 64, the same CPU kernels on both nodes), so the same exact index.
    assert np.array_equal(ids_two, ids_one) and np.array_equal(ids_two, np.arange(len(ids_two)))
    assert np.array_equal(vectors_two, vectors_one)
    assert index_two is not None and np.array_equal(index_two, index_one)
