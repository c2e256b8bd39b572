"""``proxydml report``: an HTML comparison of runs from a local sqlite MLflow store."""

from __future__ import annotations

import base64
import io
import os
import re

import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from pipelines import plots
from services import cli, report

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # tests talk to 127.0.0.1 only

# Two runs with distinctive final values (the page must show them as logged, 4 decimals).
RUNS = {
    "alpha-proxy-anchor": {"loss": [2.5, 1.75, 1.2468], "recall_at_1": [0.41, 0.55, 0.6123],
                           "map_at_r": [0.11, 0.19, 0.2345]},
    "beta-proxy-isa": {"loss": [2.25, 1.5, 1.1357], "recall_at_1": [0.45, 0.6, 0.7351],
                       "map_at_r": [0.12, 0.21, 0.3456]},
}
PARAMS = {
    "alpha-proxy-anchor": {"loss.name": "proxy_anchor", "optim.lr": "0.001", "data.name": "digits"},
    "beta-proxy-isa": {"loss.name": "proxy_isa", "optim.lr": "0.001", "data.name": "digits"},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(tracking URI, experiment name, {run name: run id}) with plots logged from plots.py.

    One store for the module (a fresh sqlite store costs seconds of migrations); tests that
    log a report write only into runs the others do not check.
    """
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("proxydml-digits", artifact_location=(tmp_path / "artifacts").as_uri())
    ids = {}
    for i, (name, series) in enumerate(RUNS.items()):
        run_id = client.create_run(exp_id, run_name=name, tags={"loss": PARAMS[name]["loss.name"],
                                                               "dataset": "digits"}).info.run_id
        for key, value in PARAMS[name].items():
            client.log_param(run_id, key, value)
        for key, values in series.items():
            for step, v in enumerate(values, start=1):
                client.log_metric(run_id, key, v, step=step)
        folder = tmp_path / f"plots-{i}"
        history = [{"epoch": s + 1, **{k: v[s] for k, v in series.items()}} for s in range(3)]
        plots.plot_learning_curves(history, folder / plots.LEARNING_CURVES)
        plots.plot_proxy_similarity(torch.randn(12, 8, generator=torch.Generator().manual_seed(i)),
                                    folder / plots.PROXY_SIMILARITY)
        client.log_artifacts(run_id, str(folder), "plots")
        client.set_terminated(run_id)
        ids[name] = run_id
    return uri, "proxydml-digits", ids


def embedded_pngs(page: str) -> list[Image.Image]:
    images = []
    for b64 in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page):
        im = Image.open(io.BytesIO(base64.b64decode(b64)))
        im.load()
        images.append(im)
    return images


def test_experiment_report_compares_both_runs_and_is_logged(store, tmp_path):
    uri, experiment, ids = store
    out = tmp_path / "out" / "report.html"
    rep = report.build_report([experiment], out=out, tracking_uri=uri)
    page = out.read_text()
    assert page == rep.html and page.startswith("<!DOCTYPE html>")
    for name in RUNS:
        assert name in page
    for value in ("0.6123", "0.7351", "0.2345", "0.3456", "1.2468", "1.1357"):
        assert value in page
    # Differing params are tabulated; an equal one appears only in "All parameters".
    differ = page.split("<h2>Parameters that differ</h2>")[1].split("<details>")[0]
    assert "loss.name" in differ and "proxy_isa" in differ and "optim.lr" not in differ
    assert "optim.lr" in page
    # 2 plots per run + the overlaid learning curves, all decodable PNGs, nothing external.
    images = embedded_pngs(page)
    assert len(images) == 5 and all(im.format == "PNG" and im.width > 300 for im in images)
    assert "http://" not in page.replace(uri, "") and "https://" not in page
    # The best Recall@1 is bold.
    assert "<b>0.7351</b>" in page and "<b>0.6123</b>" not in page

    client = MlflowClient(uri)
    (report_run_id,) = rep.logged_to
    assert report_run_id not in ids.values()
    report_run = client.get_run(report_run_id)
    assert report_run.info.run_name == "report" and report_run.data.tags[report.REPORT_TAG] == "experiment"
    logged = client.download_artifacts(report_run_id, "report/report.html", str(tmp_path / "dl"))
    assert open(logged, encoding="utf-8").read() == page

    # A second report reuses the report run and never lists it as a compared run.
    again = report.build_report([experiment], out=tmp_path / "again.html", tracking_uri=uri)
    assert again.logged_to == [report_run_id]
    assert {r.run_id for r in again.runs} == set(ids.values())


def test_run_report_is_logged_into_the_run(store, tmp_path):
    uri, _, ids = store
    run_id = ids["beta-proxy-isa"]
    rep = report.build_report([run_id], out=tmp_path / "r.html", tracking_uri=uri)
    assert rep.logged_to == [run_id]
    assert "beta-proxy-isa" in rep.html and "alpha-proxy-anchor" not in rep.html
    assert "0.7351" in rep.html
    paths = [a.path for a in MlflowClient(uri).list_artifacts(run_id, "report")]
    assert paths == ["report/report.html"]


def test_two_run_ids_and_no_log(store, tmp_path):
    uri, _, ids = store
    rep = report.build_report(list(ids.values()), out=tmp_path / "r.html", tracking_uri=uri, log=False)
    assert rep.logged_to == [] and [r.name for r in rep.runs] == list(RUNS)
    assert not MlflowClient(uri).list_artifacts(ids["alpha-proxy-anchor"], "report")


def test_run_without_plots_and_hostile_names_are_escaped(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp_id, run_name="<script>alert(1)</script>").info.run_id
    client.log_param(run_id, "note", "<b>x</b>")
    client.log_metric(run_id, "recall_at_1", 0.5)
    rep = report.build_report([run_id], out=tmp_path / "r.html", tracking_uri=uri, log=False)
    assert "<script>" not in rep.html and "&lt;script&gt;alert(1)&lt;/script&gt;" in rep.html
    assert "<b>x</b>" not in rep.html
    assert "No plots logged" in rep.html


def test_cli_report_and_its_errors(store, tmp_path, capsys):
    uri, experiment, ids = store
    out = tmp_path / "cli.html"
    assert cli.main(["report", experiment, "--out", str(out), "--tracking-uri", uri, "--no-log"]) == 0
    assert "alpha-proxy-anchor" in out.read_text()
    assert f"report: {out} (2 run(s))" in capsys.readouterr().out

    assert cli.main(["report", "no-such-experiment", "--out", str(tmp_path / "x.html"), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-experiment" in err
    assert not (tmp_path / "x.html").exists()

    empty = MlflowClient(uri).create_experiment("empty", artifact_location=(tmp_path / "e").as_uri())
    assert cli.main(["report", "empty", "--tracking-uri", uri, "--out", str(tmp_path / "y.html")]) == 2
    assert "has no runs" in capsys.readouterr().err
    assert empty
