"""A searchable champion: `proxydml index build` (embedded in process on this one-node cluster,
else by Ray Data) + faiss, published in MLflow, and
`proxydml search`, on the tiny emoji set with the demo recipe's model.

The model is trained once for the module (the demo recipe, one short epoch at 32 px, in this
process) and registered as the champion of a local MLflow store; every command runs through
the CLI's entry point in this process, on the session's Ray cluster.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.config import load_config
from pipelines.tracking import LocalReporter
from services import aliases, registry
from services.cli import main
from services.index import BuildRequest, IndexBuildError, build
from services.mlflow_tracking import ensure_experiment, local_store
from services.snapshots import sha256_file

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.emoji]
MODEL = "emoji-demo"


@pytest.fixture(scope="module")
def champion(tiny, tmp_path_factory):
    """(tracking uri, checkpoint folder): the demo recipe trained briefly on the tiny set,
    logged as a run's checkpoint and registered as version 1, the champion."""
    from pipelines.train import run

    tmp = tmp_path_factory.mktemp("index")
    uri, _ = local_store(tmp / "mlruns")
    cfg = load_config("emoji_proxy_nca_pp_demo", [
        f"data.root={tiny}", "data.image_size=32", "data.eval_resize=32", "data.batch_size=40",
        "data.samples_per_class=5", "data.loader_workers=0", "train.epochs=1", "train.max_steps_per_epoch=3",
        "train.recall_ks=[1]", "scaling.num_workers=1",
    ])
    run(cfg, LocalReporter(tmp / "run"))
    ckpt = sorted((tmp / "run").glob("checkpoint_*"))[-1]
    client = MlflowClient(uri)
    exp = ensure_experiment(client, "emoji-index", uri)
    run_id = client.create_run(exp, run_name="emoji-demo-train").info.run_id
    client.log_artifacts(run_id, str(ckpt), "checkpoint")
    client.set_terminated(run_id)
    registry.register_version(client, MODEL, run_id=run_id, tags={}, description="test", promote_it=True)
    return uri, ckpt


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_exact_index_of_the_unseen_half_searches_as_the_evaluation_scores(champion, ray_cluster, capsys):
    uri, ckpt = champion
    code, out, err = _cli(capsys, "index", "build", "--model", f"{MODEL}@champion", "--gallery", "unseen",
                          "--serve", "--tracking-uri", uri)
    assert code == 0, err
    client = MlflowClient(uri)
    version = client.get_model_version(MODEL, "1")
    tags = version.tags
    # 32 unseen classes x 5 designs, exact (Flat) below the ANN threshold: recall 1 by construction.
    assert tags["index_factory"] == "Flat" and tags["gallery_images"] == "160"
    assert float(tags["ann_recall_at_10"]) == 1.0
    assert tags["index_uri"] == f"runs:/{tags['index_run_id']}/index"
    assert registry.aliases_of(client, MODEL)[aliases.SERVING] == "1"
    index_run = client.get_run(tags["index_run_id"])
    assert index_run.info.status == "FINISHED" and index_run.data.tags["kind"] == "index"
    # The published files are the ones the manifest lists, byte for byte.
    local = Path(client.download_artifacts(index_run.info.run_id, "index", str(ckpt.parent / "published")))
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["files"]["index.faiss"] == tags["index_sha256"] == sha256_file(local / "index.faiss")
    for rel, sha in manifest["files"].items():
        assert sha256_file(local / rel) == sha, rel
    assert manifest["images"] == 160 and manifest["skipped"] == 0 and sum(manifest["nodes"].values()) == 160

    # Every gallery image searched, itself left out: the same R@1 as `proxydml eval`.
    from pipelines.data import build_datasets

    cfg = load_config(str(ckpt / "config.yaml"))
    test = build_datasets(cfg.data).test
    paths = [str(p) for p, _ in test.samples]
    code, out, err = _cli(capsys, "search", "--model", MODEL, "-k", "5", "--json", "--tracking-uri", uri, *paths)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["version"] == "1"
    hits = 0
    for query, result in zip(paths, answer["results"]):
        assert result["query"] == query
        others = [h for h in result["hits"] if h["path"] != query]
        own = [h for h in result["hits"] if h["path"] == query]
        assert own and own[0]["score"] == pytest.approx(1.0, abs=1e-5), (query, result["hits"])  # the query finds itself
        hits += others[0]["class"] == test.names[test.samples[paths.index(query)][1]]
    code, out, err = _cli(capsys, "eval", "--checkpoint", str(ckpt), "--json", "train.recall_ks=[1]")
    assert code == 0, err
    assert hits / len(paths) == json.loads(out)["recall_at_1"]


def test_a_gallery_on_one_node_is_embedded_in_process_as_the_ray_data_pool_embeds_it(champion, ray_cluster):
    """One node without GPUs and no --concurrency: the gallery is embedded in the calling
    process, no Ray Data actor started, with the ids, checksums and vectors (to the bit: the
    same batches on the same CPU kernels) of a pool of one actor."""
    import numpy as np
    import ray
    from ray.util.state import list_actors

    from services import runtime
    from services.index import load_version, parse_model_ref, resolve_gallery, resolve_version

    uri, _ = champion
    client = MlflowClient(uri)
    cfg, state = load_version(client, resolve_version(client, parse_model_ref(f"{MODEL}/1")))
    items, _ = resolve_gallery("unseen", cfg)
    assert runtime.alive_nodes() == 1 and len(items) == 160

    def embedders() -> int:
        return len(list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000,
                               filters=[("class_name", "=", "MapWorker(MapBatches(_RayGalleryEmbedder))")]))

    def embed(concurrency: int | None) -> dict[str, np.ndarray]:
        batches = list(runtime.embed_gallery(items, cfg, state, batch_size=cfg.data.eval_batch_size,
                                             concurrency=concurrency))
        return {k: np.concatenate([b[k] for b in batches]) for k in ("id", "ok", "sha256", "node", "vector")}

    before = embedders()
    here = embed(None)
    assert embedders() == before
    pool = embed(1)
    assert embedders() == before + 1
    assert np.array_equal(here["id"], np.arange(len(items))) and np.array_equal(here["id"], pool["id"])
    assert here["ok"].all() and np.array_equal(here["sha256"], pool["sha256"])
    assert set(here["node"]) == set(pool["node"]) == {ray.get_runtime_context().get_node_id()}
    np.testing.assert_array_equal(here["vector"], pool["vector"])


def test_bad_galleries_and_factories_fail_in_one_line_and_publish_nothing(champion, ray_cluster, tiny, tmp_path,
                                                                          capsys):
    uri, _ = champion
    client = MlflowClient(uri)
    before = client.get_model_version(MODEL, "1").tags
    runs_before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    folder = tmp_path / "gallery"
    good = sorted(p for p in tiny.rglob("*.png") if ".cache" not in p.parts)[:12]
    for i, p in enumerate(good):
        dest = folder / f"class{i % 3}" / p.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest)
    broken = folder / "class0" / "broken.png"
    broken.write_bytes(b"not a png")

    code, _, err = _cli(capsys, "index", "build", "--model", MODEL, "--gallery", str(folder), "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and str(broken) in err and "--skip-bad" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _cli(capsys, "index", "build", "--model", MODEL, "--gallery", str(tmp_path / "empty"),
                        "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and "no images" in err
    code, _, err = _cli(capsys, "index", "build", "--model", MODEL, "--gallery", str(folder), "--factory", "HNSW-bad",
                        "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and "'HNSW-bad': faiss rejects it" in err
    # Nothing published: no index run, the version's tags as they were.
    assert client.get_model_version(MODEL, "1").tags == before
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == runs_before

    # --skip-bad: the broken file is counted, the rest indexed (an explicit factory).
    result = build(BuildRequest(model=f"{MODEL}/1", gallery=str(folder), tracking_uri=uri, skip_bad=True,
                                factory="IDMap,Flat"), log=lambda _: None)
    assert (result.images, result.skipped, result.factory) == (12, 1, "IDMap,Flat")


def test_search_without_an_index_and_unknown_models_say_what_to_do(champion, capsys, tiny):
    uri, ckpt = champion
    client = MlflowClient(uri)
    run_id = client.get_model_version(MODEL, "1").run_id
    client.create_model_version(MODEL, source=f"runs:/{run_id}/model", run_id=run_id)  # version 2, no index
    image = str(next(p for p in tiny.rglob("*.png") if ".cache" not in p.parts))
    code, _, err = _cli(capsys, "search", "--model", f"{MODEL}/2", image, "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and f"proxydml index build --model {MODEL}/2" in err
    code, _, err = _cli(capsys, "search", "--model", "no-such-model", image, "--tracking-uri", uri)
    assert code == 2 and "no registered model 'no-such-model'" in err
    code, _, err = _cli(capsys, "search", "--model", MODEL, "--alias", "nightly", image, "--tracking-uri", uri)
    assert code == 2 and "has no alias 'nightly'" in err
    # `serve` checks the same before any replica starts: one line, exit 2.
    code, _, err = _cli(capsys, "serve", "--model", "no-such-model", "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and "no registered model 'no-such-model'" in err
    code, _, err = _cli(capsys, "serve", "--model", MODEL, "--alias", "nightly", "--tracking-uri", uri)
    assert code == 2 and err.count("\n") == 1 and "has no alias 'nightly'" in err


def test_a_build_that_fails_midway_leaves_serving_and_tags_alone(champion, ray_cluster, tiny, tmp_path):
    uri, _ = champion
    client = MlflowClient(uri)
    before = client.get_model_version(MODEL, "1").tags
    aliases_before = registry.aliases_of(client, MODEL)

    def unreadable(step: str) -> None:
        if step == "uploaded":
            raise OSError("the artifact store went away")

    with pytest.raises(OSError):
        build(BuildRequest(model=f"{MODEL}/1", gallery="unseen", tracking_uri=uri, serve=True),
              log=lambda _: None, hook=unreadable)
    assert client.get_model_version(MODEL, "1").tags == before
    assert registry.aliases_of(client, MODEL) == aliases_before
    failed = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string="tags.kind = 'index' and attributes.status = 'FAILED'")
    assert len(failed) == 1


def test_model_reference_errors(champion):
    uri, _ = champion
    with pytest.raises(IndexBuildError, match="give NAME, NAME@ALIAS or NAME/VERSION"):
        build(BuildRequest(model="a@b/3", gallery="unseen", tracking_uri=uri))


def _http(url: str, body: bytes | None = None) -> tuple[int, dict | bytes]:
    """(status, JSON or raw bytes) of a GET, or of a POST when ``body`` is given."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, ctype, data = reply.status, reply.headers.get("content-type", ""), reply.read()
    except urllib.error.HTTPError as exc:
        status, ctype, data = exc.code, exc.headers.get("content-type", ""), exc.read()
    return status, json.loads(data) if ctype.startswith("application/json") else data


def test_serve_answers_follows_serving_and_refuses_bad_requests(champion, ray_cluster, tiny, tmp_path, browser):
    import subprocess
    import sys
    import threading
    import time

    import ray

    from services.net import free_port

    uri, ckpt = champion
    client = MlflowClient(uri)
    if not client.get_model_version(MODEL, "1").tags.get("gallery", "").startswith("unseen"):
        # Run alone, or after another test indexed a folder with version 1: the unseen half again.
        build(BuildRequest(model=f"{MODEL}/1", gallery="unseen", tracking_uri=uri, serve=True), log=lambda _: None)
    served = registry.aliases_of(client, MODEL)[aliases.SERVING]
    # A second version with its own index of a folder gallery: its hits' paths say which index answered.
    run_id = client.get_model_version(MODEL, "1").run_id
    other = str(client.create_model_version(MODEL, source=f"runs:/{run_id}/model", run_id=run_id).version)
    from pipelines.data import build_datasets

    unseen = build_datasets(load_config(str(ckpt / "config.yaml")).data).test
    folder = tmp_path / f"gallery-v{other}"  # the unseen images of 12 classes, copied: class = sub-folder
    for i, (path, label) in enumerate(unseen.samples[:60]):
        (folder / unseen.names[label]).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / unseen.names[label] / f"{i:03d}.png")
    build(BuildRequest(model=f"{MODEL}/{other}", gallery=str(folder), tracking_uri=uri), log=lambda _: None)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", MODEL, "--tracking-uri", uri, "--port", str(port),
         "--challenger", other, "--poll-s", "0.5", "--address", ray.get_runtime_context().gcs_address],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _http(base + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert proc.poll() is None and _http(base + "/healthz")[0] == 200, proc.stdout.read() if proc.poll() else ""

        status, examples = _http(base + "/examples")
        assert status == 200 and len(examples) == 12 and len({e["class"] for e in examples}) == 12
        query = Path(examples[0]["path"])  # an image of the served gallery
        status, answer = _http(f"{base}/search?k=5", query.read_bytes())
        assert status == 200 and answer["version"] == served and len(answer["hits"]) == 5
        assert answer["hits"][0]["score"] == pytest.approx(1.0, abs=1e-4)  # a gallery image finds itself
        # Bad uploads: 400; another model, an unknown alias or version: 404 -- each with its reason.
        status, answer = _http(f"{base}/search?k=5", b"not an image")
        assert status == 400 and "cannot decode image upload" in answer["error"]
        assert _http(f"{base}/search?k=0", query.read_bytes())[0] == 400
        assert _http(f"{base}/search", b"")[0] == 400
        status, answer = _http(f"{base}/search?model=no-such-model", query.read_bytes())
        assert status == 404 and "no-such-model" in answer["error"]
        status, answer = _http(f"{base}/search?alias=nightly", query.read_bytes())
        assert status == 404 and "nightly" in answer["error"]
        assert _http(f"{base}/search?version=99", query.read_bytes())[0] == 404

        # The page: an example picked, both columns filled, thumbnails marked right or wrong.
        browser.get(base + "/")
        wait_until = time.monotonic() + 60
        while browser.execute_script("return document.body.dataset.ready") != "1" and time.monotonic() < wait_until:
            time.sleep(0.2)
        browser.find_element("css selector", "#examples img").click()
        while browser.execute_script("return document.body.dataset.done") != "1" and time.monotonic() < wait_until:
            time.sleep(0.2)
        script = ("return ['#col-serving', '#col-challenger'].map(c => [document.querySelector(c + ' h2').textContent,"
                  " document.querySelectorAll(c + ' .hit.right').length, document.querySelectorAll(c + ' .hit.wrong')"
                  ".length, Array.from(document.querySelectorAll(c + ' .hit img')).filter(i => i.complete &&"
                  " i.naturalWidth > 0).length])")
        columns = browser.execute_script(script)
        while any(loaded < 8 for *_, loaded in columns) and time.monotonic() < wait_until:  # thumbnails loading
            time.sleep(0.2)
            columns = browser.execute_script(script)
        assert columns[0][0] == f"serving: version {served}" and columns[1][0] == f"{other}: version {other}", columns
        assert all(right + wrong == 8 and loaded == 8 for _, right, wrong, loaded in columns), columns
        assert columns[0][1] >= 1 and columns[1][1] >= 1  # classes known on both sides: some marked right
        shot = tmp_path / "serve-page.png"
        shot.write_bytes(browser.get_screenshot_as_png())
        assert shot.stat().st_size > 20_000

        # Move `serving` while requests run: answers switch within seconds and never mix versions.
        answers: list[tuple[float, str, list[str]]] = []
        done = threading.Event()

        def ask() -> None:
            while not done.is_set():
                status, answer = _http(f"{base}/search?k=3", query.read_bytes())
                assert status == 200
                answers.append((time.monotonic(), answer["version"], [h["path"] for h in answer["hits"]]))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(2)
        moved_at = time.monotonic()
        assert registry.aliases_of(client, MODEL)[aliases.SERVING] == served
        from services.index import move_serving

        assert move_serving(client, MODEL, other, min_recall=0.0, log=lambda _: None)
        while time.monotonic() < moved_at + 30 and not (answers and answers[-1][1] == other):
            time.sleep(0.2)
        time.sleep(1)
        done.set()
        asker.join()
        switched = next(t for t, version, _ in answers if version == other)
        assert switched - moved_at < 10, "serving moved but answers did not follow within 10 s"
        for _, version, paths in answers:
            assert version in (served, other)
            assert all(p.startswith(str(folder)) == (version == other) for p in paths), (version, paths)
        assert [v for _, v, _ in answers] == sorted((v for _, v, _ in answers), key=lambda v: v == other)
    finally:
        proc.send_signal(2)  # SIGINT: the CLI shuts Serve down and exits 0
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and f"serving {MODEL}" in out and "stopped" in out, out
    registry.set_aliases(client, MODEL, {aliases.SERVING: served})
