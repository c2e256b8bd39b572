"""A real browser renders the dashboard: the HTML report and the MLflow UI of a run.

Headless Chromium (Debian ``chromium`` + ``chromium-driver``) driven by Selenium; a real
``mlflow server`` on 127.0.0.1 with a sqlite store. The browser resolves no host name but
127.0.0.1 (``--host-resolver-rules``), so neither the report nor the MLflow UI can reach out.
Missing Chromium is a failure with the install commands, never a skip: CI installs it.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines import plots
from services import report
from services.net import free_port

pytestmark = pytest.mark.e2e

SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
              "DO_NOT_TRACK": "true"}
RUN_NAMES = ("alpha-proxy-anchor", "beta-proxy-isa")
SYSTEM_METRICS = {"system/network_receive_megabytes": 812.5, "system/disk_usage_percentage": 61.0,
                  "system/cpu_utilization_percentage": 93.0, "system/system_memory_usage_megabytes": 5120.0}
FINAL_R1 = {"alpha-proxy-anchor": 0.6123, "beta-proxy-isa": 0.7351}


def assert_not_blank(png: bytes, what: str, min_colours: int = 16) -> None:
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert rgb.shape[0] >= 100 and rgb.shape[1] >= 100, f"{what}: screenshot {rgb.shape}"
    assert rgb.astype(float).std() > 8.0, f"{what}: screenshot is blank"
    colours = len(np.unique(rgb.reshape(-1, 3), axis=0))
    assert colours >= min_colours, f"{what}: screenshot has only {colours} colours"


def wait_for(driver, predicate, timeout: float, what: str):
    """Poll ``predicate(driver)`` until truthy (React pages render after load)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate(driver)
        except Exception as exc:  # noqa: BLE001 - element not there yet, page navigating
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    text = driver.find_element("tag name", "body").text[:1500]
    pytest.fail(f"{what} not seen within {timeout:.0f} s (last: {last!r}); page text:\n{text}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1:FREE (one worker, no job runner), its own process group."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", (root / "artifacts").as_uri(), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        env={**os.environ, **SERVER_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"mlflow server not up in 120 s:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        # The server and its uvicorn child share the session we gave them: stop the group.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()


@pytest.fixture(scope="module")
def logged(server, tmp_path_factory):
    """Two runs logged through the server, each with plots; the experiment report built."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    tmp = tmp_path_factory.mktemp("runs")
    client = MlflowClient(server)
    exp_id = client.create_experiment("proxydml-browser")
    ids = {}
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(5).repeat_interleave(6)
    emb = torch.randn(5, 8, generator=g)[labels] + 0.3 * torch.randn(30, 8, generator=g)
    images = torch.rand(30, 3, 16, 16, generator=g)
    for i, name in enumerate(RUN_NAMES):
        run_id = client.create_run(exp_id, run_name=name,
                                   tags={"loss": name.split("-", 1)[1], "world_size": "2"}).info.run_id
        client.log_param(run_id, "loss.name", name.split("-", 1)[1].replace("-", "_"))
        history = [{"epoch": 1, "loss": 2.0 - i * 0.1, "recall_at_1": 0.5, "map_at_r": 0.2},
                   {"epoch": 2, "loss": 1.5 - i * 0.1, "recall_at_1": FINAL_R1[name], "map_at_r": 0.3}]
        for row in history:
            for key in ("loss", "recall_at_1", "map_at_r"):
                client.log_metric(run_id, key, row[key], step=int(row["epoch"]))
        # What a 2-worker run records besides: timings, a cross-family score, system metrics.
        for key, value in {**SYSTEM_METRICS, "epoch_time_s": 41.5, "xgroup_recall_at_1": 0.58}.items():
            client.log_metric(run_id, key, value, step=2)
        folder = tmp / name
        plots.plot_learning_curves(history, folder / plots.LEARNING_CURVES)
        plots.plot_retrieval_grid(emb, labels, lambda j: images[j], folder / plots.RETRIEVAL_GRID, num_queries=4,
                                  k=3)
        client.log_artifacts(run_id, str(folder), "plots")
        client.set_terminated(run_id)
        ids[name] = run_id
    out = tmp / "report.html"
    rep = report.build_report(["proxydml-browser"], out=out, tracking_uri=server)
    assert len(rep.logged_to) == 1
    return {"exp_id": exp_id, "ids": ids, "report": out, "report_run": rep.logged_to[0]}


def test_report_renders_in_chromium(browser, logged):
    browser.get(logged["report"].as_uri())
    wait_for(browser, lambda d: d.execute_script("return document.readyState") == "complete", 30, "page load")
    text = browser.find_element("tag name", "body").text
    for name in RUN_NAMES:
        assert name in text
    assert "0.7351" in text and "0.6123" in text
    # Every embedded PNG decoded by the browser: 2 plots per run + the comparison curves.
    sizes = wait_for(browser, lambda d: d.execute_script(
        "const im = Array.from(document.images);"
        "return im.length && im.every(i => i.complete && i.naturalWidth > 0) ? im.map(i => i.naturalWidth) : null"),
        30, "images decoded")
    assert len(sizes) == 5 and min(sizes) > 200, sizes
    assert_not_blank(browser.get_screenshot_as_png(), "report page")
    grid = browser.find_element("css selector", f'img[alt="beta-proxy-isa: {plots.RETRIEVAL_GRID}"]')
    browser.execute_script("arguments[0].scrollIntoView()", grid)
    assert_not_blank(grid.screenshot_as_png, "retrieval grid in the report", min_colours=32)


def test_mlflow_ui_shows_the_run_and_its_metric(browser, server, logged):
    run_id = logged["ids"]["beta-proxy-isa"]
    browser.get(f"{server}/#/experiments/{logged['exp_id']}/runs/{run_id}")
    # The UI is a React app: the text arrives after the page load, from its REST calls.
    wait_for(browser, lambda d: all(s in d.find_element("tag name", "body").text for s in ("beta-proxy-isa", "0.7351")),
             90, "run name and recall_at_1 in the MLflow run page")
    assert_not_blank(browser.get_screenshot_as_png(), "MLflow run page")


def test_mlflow_ui_shows_a_plot_artifact(browser, server, logged):
    run_id = logged["ids"]["alpha-proxy-anchor"]
    browser.get(f"{server}/#/experiments/{logged['exp_id']}/runs/{run_id}/artifacts/plots/{plots.LEARNING_CURVES}")
    # The artifact viewer fetches the PNG through the server and shows it as an <img>.
    wait_for(browser, lambda d: d.execute_script(
        "return Math.max(0, ...Array.from(document.images).filter(i => i.complete).map(i => i.naturalWidth))") > 800,
        90, "plots/learning_curves.png rendered in the artifact viewer")
    assert plots.LEARNING_CURVES in browser.find_element("tag name", "body").text
    assert_not_blank(browser.get_screenshot_as_png(), "MLflow artifact page")



def test_report_leads_with_retrieval_and_folds_system_metrics(browser, logged, tmp_path):
    browser.get(logged["report"].as_uri())
    wait_for(browser, lambda d: d.execute_script("return document.readyState") == "complete", 30, "page load")
    first_table = browser.find_element("css selector", "table.metrics")
    keys = [row.find_element("tag name", "code").text for row in first_table.find_elements("css selector", "tbody tr")]
    assert keys == ["recall_at_1", "map_at_r", "xgroup_recall_at_1", "loss", "epoch_time_s"], keys
    folded = browser.find_element("css selector", "details.system")
    assert folded.get_attribute("open") is None  # collapsed until a reader opens it
    assert "System metrics (4)" in folded.text and "network_receive" not in folded.text
    browser.execute_script("arguments[0].scrollIntoView()", first_table)
    shot = browser.get_screenshot_as_png()
    (tmp_path / "report-metrics.png").write_bytes(shot)
    assert_not_blank(shot, "report metrics")
    folded.find_element("tag name", "summary").click()
    assert "system/network_receive_megabytes" in folded.text
