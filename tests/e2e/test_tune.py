"""Ray Tune sweeps end to end: ASHA + Optuna over one-worker trials nested in MLflow (sweeps of
2-worker trials, each a Ray Train run, are test_auth's: there every worker must log in too);
a resumable sweep of one-worker trials (trained in the trial's own process) whose trials score
what `proxydml train` scores with the same config, its one-line console, and a warm start from it;
population-based training whose exploits are recorded in MLflow; an ASHA sweep whose driver is
killed outright and resumed, and its page in `proxydml report`, in headless Chromium."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.config import from_dict, load_config
from pipelines.tracking import LocalReporter
from pipelines.train import evaluate_checkpoint
from pipelines.train import run as train_locally
from services import sweep, training
from tests.e2e.test_browser import assert_not_blank

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _children(client: MlflowClient, parent_id: str):
    exp = client.get_run(parent_id).info.experiment_id
    return client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")


def test_asha_optuna_sweep_nests_in_mlflow_and_its_best_config_trains(ray_cluster, tmp_path, local_mlflow,
                                                                      digits_config):
    base = digits_config(local_mlflow, tmp_path / "runs", steps=3, workers=1)
    out = sweep.run_sweep(base, "digits_quick", samples=4, scheduler="asha", search="optuna", max_concurrent=2)
    assert len(out.trials) == 4 and not out.resumed

    client = MlflowClient(local_mlflow)
    parent = client.get_run(out.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep_name"] == out.name
    assert parent.data.params["space.optim.lr"] == "loguniform[0.0003, 0.003]"
    sweep_artifacts = {a.path for a in client.list_artifacts(out.parent_run_id, "sweep")}
    assert {"sweep/best_config.yaml", "sweep/parallel_coordinates.png", "sweep/parameter_scatter.png",
            "sweep/digits_quick.yaml"} <= sweep_artifacts

    children = _children(client, out.parent_run_id)
    assert len(children) == 4
    trial_ids = {t["trial_id"] for t in out.trials}
    for child in children:
        assert child.data.tags["trial_id"] in trial_ids
        assert child.info.run_name == f"{out.name}-{child.data.tags['trial_id']}"
        assert 3e-4 <= float(child.data.params["optim.lr"]) <= 3e-3
        assert 8.0 <= float(child.data.params["loss.alpha"]) <= 48.0
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "map_at_r")]
        assert steps[0] == 1 and steps == sorted(set(steps))
        assert child.info.status in ("FINISHED", "KILLED")

    best_yaml = sweep.best_config(out.name, local_mlflow)
    best = from_dict(yaml.safe_load(best_yaml))
    winner = max(out.trials, key=lambda t: t["metric"])
    assert best.optim.lr == pytest.approx(winner["params"]["optim.lr"])
    metrics = train_locally(
        load_config(None, [f"{k}={v}" for k, v in best.flat().items()
                           if v is not None and not isinstance(v, list) and not k.startswith("tracking.")]
                    + ["scaling.num_workers=1", "train.epochs=1"]),
        LocalReporter(tmp_path / "best"),
    )
    assert metrics["recall_at_1"] > 0.5


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_cluster, tmp_path, local_mlflow):
    import ray

    args = [sys.executable, "-m", "services.cli", "tune", "--space", "digits_quick", "--samples", "3",
            "--max-concurrent", "1", "--scheduler", "none", "--address", ray.get_runtime_context().gcs_address,
            "train.epochs=1", "train.max_steps_per_epoch=3", "scaling.num_workers=1",
            f"tracking.tracking_uri={local_mlflow}", f"tracking.storage_path={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = MlflowClient(local_mlflow)

    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    parent_id = None
    # One trial at a time: a second child run exists only once the first trial has finished.
    while True:
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()[-3000:]
        parents = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                     filter_string="tags.kind = 'sweep'")
        if parents:
            parent_id = parents[0].info.run_id
            if len(_children(client, parent_id)) >= 2:
                break
        time.sleep(1)
    first.send_signal(signal.SIGINT)  # Ctrl-C
    first.wait(timeout=120)
    done_before = {c.data.tags["trial_id"]: client.get_metric_history(c.info.run_id, "map_at_r")
                   for c in _children(client, parent_id)}

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(resumed)" in second.stdout
    # The console (a pipe): a progress line at most every 30 s and the ranked table; Tune's
    # status tables and the trials' output in the log file only.
    shown = second.stdout.splitlines()
    assert len(shown) < 20 and "Trial status" not in second.stdout and "╭" not in second.stdout, second.stdout
    progress = [line for line in shown if line.startswith("trials ")]
    assert progress[-1].startswith("trials 3/3: 3 done, 0 running, 0 stopped, 0 failed | best map_at_r 0."), shown
    assert "Trial status" in (tmp_path / ".proxydml" / "logs" / "tune-digits_quick.log").read_text()

    children = _children(client, parent_id)
    trial_ids = [c.data.tags["trial_id"] for c in children]
    assert len(children) == 3 and len(set(trial_ids)) == 3
    finished_first = [t for t, hist in done_before.items() if hist]
    assert finished_first
    for child in children:
        history = client.get_metric_history(child.info.run_id, "map_at_r")
        assert [m.step for m in history] == [1], (child.data.tags["trial_id"], history)
        if child.data.tags["trial_id"] in finished_first:  # not run again: same record
            assert [m.timestamp for m in history] == [m.timestamp for m in done_before[child.data.tags["trial_id"]]]

    # A one-worker trial trains in its Tune process; `proxydml train` of the best trial's config
    # (one Ray Train worker, the same single thread) scores the same, to the bit.
    best = from_dict(yaml.safe_load(sweep.best_config(client.get_run(parent_id).data.tags["sweep_name"],
                                                      local_mlflow)))
    winner = max(children, key=lambda c: c.data.metrics["map_at_r"])
    assert float(winner.data.params["optim.lr"]) == pytest.approx(best.optim.lr)
    assert best.scaling.num_workers == 1 and best.scaling.cpus_per_worker == 1
    trained = training.train(load_config(None, [
        f"{k}={v}" for k, v in best.flat().items() if v is not None and not isinstance(v, list)
        and not k.startswith("tracking.")] + [f"tracking.tracking_uri={local_mlflow}",
                                              f"tracking.storage_path={tmp_path / 'train'}"]), log_model=False)
    for key in ("loss", "map_at_r", "recall_at_1"):
        assert trained.metrics[key] == winner.data.metrics[key], key

    # A warm start from this sweep: Optuna is told its 3 scored trials, and its best point runs first.
    earlier = client.get_run(parent_id).data.tags["sweep_name"]
    base = load_config("digits", ["train.epochs=1", "train.max_steps_per_epoch=3", "scaling.num_workers=1",
                                  f"tracking.tracking_uri={local_mlflow}", f"tracking.storage_path={tmp_path / 'runs'}"])
    warm = sweep.run_sweep(base, "digits_quick", samples=2, scheduler="none", search="optuna", max_concurrent=1,
                           warm_start=earlier, start_from_best=True)
    parent = client.get_run(warm.parent_run_id)
    assert parent.data.params["sweep.warm_start"] == earlier and parent.data.params["sweep.warm_start_points"] == "3"
    assert parent.data.tags["searcher_trials"] == "5"  # the searcher's study: 3 told + 2 run
    first = min(_children(client, warm.parent_run_id), key=lambda r: r.info.start_time)
    for key in ("optim.lr", "loss.alpha"):
        assert float(first.data.params[key]) == pytest.approx(float(winner.data.params[key]), rel=1e-6), key
    assert first.data.metrics["map_at_r"] == winner.data.metrics["map_at_r"]  # the same point, trained again


def test_pbt_clones_trials_records_the_lineage_and_the_best_checkpoint_scores_what_it_logged(
        ray_cluster, tmp_path, local_mlflow):
    base = load_config("digits", ["train.epochs=3", "train.max_steps_per_epoch=3", "scaling.num_workers=1",
                                  f"tracking.tracking_uri={local_mlflow}", f"tracking.storage_path={tmp_path / 'runs'}"])
    out = sweep.run_sweep(base, "digits_quick", samples=4, scheduler="pbt", search="random", max_concurrent=4)
    assert len(out.trials) == 4 and all(t["error"] is None and t["epochs"] == 3 for t in out.trials), out.trials

    client = MlflowClient(local_mlflow)
    children = _children(client, out.parent_run_id)
    ids = {c.data.tags["trial_id"] for c in children}
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children)
    # The population reaches each epoch together; the bottom quarter (1 of 4) clones the top one.
    exploited = [c for c in children if "pbt.exploits" in c.data.tags]
    assert exploited, "no exploit in 2 synchronous rounds"
    for child in exploited:
        n = int(child.data.tags["pbt.exploits"])
        records = [json.loads(child.data.tags[f"pbt.exploit.{i}"]) for i in range(1, n + 1)]
        assert child.data.tags["pbt.cloned_from"] == records[-1]["from_trial"]
        for rec in records:
            assert rec["from_trial"] in ids - {child.data.tags["trial_id"]} and rec["epoch"] in (1, 2)
            assert set(rec["values"]) == set(rec["donor_values"]) == {"optim.lr", "loss.alpha"}
            assert rec["values"] != rec["donor_values"]  # perturbed or resampled
            assert 3e-4 <= rec["values"]["optim.lr"] <= 3e-3 and 8.0 <= rec["values"]["loss.alpha"] <= 48.0
        # its run keeps one record per epoch: its own up to the exploit, then the clone's
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "map_at_r")]
        assert steps == [1, 2, 3], steps
        # the clone trains on at its own new rate (digits: a constant schedule), not the donor's
        lr = {m.step: m.value for m in client.get_metric_history(child.info.run_id, "lr")}
        for rec in records:
            assert lr[rec["epoch"] + 1] == pytest.approx(rec["values"]["optim.lr"], rel=1e-9), (lr, rec)

    best = max(children, key=lambda c: c.data.metrics["map_at_r"])
    last = sorted((tmp_path / "runs" / out.name / best.info.run_name).glob("checkpoint_*"))[-1]
    assert json.loads((last / "trainer_state.json").read_text())["epoch"] == 3
    assert evaluate_checkpoint(last)["map_at_r"] == best.data.metrics["map_at_r"]


def test_killed_asha_sweep_resumes_and_its_page_explains_it_in_chromium(ray_cluster, tmp_path, local_mlflow,
                                                                        browser):
    """A learning rate that works on digits and one too large (MAP@R ~0.34 against ~0.24), each
    with two seeds, one trial at a time under ASHA. The driver gets SIGKILL once the third trial
    has a run, and the same command runs again: trials that had ended keep their records (not
    run again, a stopped one stays stopped), a trial the saved sweep state never held is closed
    and tagged. The weak config is stopped at the first rung below the cutoff ASHA recorded on
    its run, the strong one finishes with both seeds (a seed spread), and `proxydml report` of
    the sweep shows it all in headless Chromium, with Optuna's fANOVA importances."""
    import ray

    from services import report, sweep_page

    space = tmp_path / "lr_seed.yaml"
    space.write_text("optim.lr: {grid: [1.0e-3, 3.0e-2]}\ntrain.seed: {grid: [0, 1]}\n")
    args = [sys.executable, "-m", "services.cli", "tune", "--space", str(space), "--samples", "1", "--search", "grid",
            "--max-concurrent", "1", "--scheduler", "asha", "--address", ray.get_runtime_context().gcs_address,
            "train.epochs=2", "scaling.num_workers=1",  # full digits epochs: the lr shows at the first
            f"tracking.tracking_uri={local_mlflow}", f"tracking.storage_path={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = MlflowClient(local_mlflow)

    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()[-3000:]
        parents = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                     filter_string="tags.kind = 'sweep'")
        if parents and len(_children(client, parents[0].info.run_id)) >= 3:
            break
        time.sleep(0.2)
    first.kill()
    first.wait(timeout=60)
    parent_id = parents[0].info.run_id
    time.sleep(2)  # what the killed driver's trial was writing lands now, or never
    ended_before = {c.data.tags["trial_id"]: client.get_metric_history(c.info.run_id, "map_at_r")
                    for c in _children(client, parent_id)
                    if c.info.status == "FINISHED" or "asha.rung" in c.data.tags}
    assert ended_before  # the first trial at least

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(resumed)" in second.stdout
    every = _children(client, parent_id)
    lost = [c for c in every if sweep.LOST_TAG in c.data.tags]
    assert all(c.info.status != "RUNNING" for c in lost)
    children = [c for c in every if sweep.LOST_TAG not in c.data.tags]
    # Every grid point ran. A trial that started and ended between two saves of the sweep state
    # is adopted from its run, and the restored grid may run its point once more.
    points = {(c.data.params["optim.lr"], c.data.params["train.seed"]) for c in children}
    assert len(points) == 4 and len({c.data.tags["trial_id"] for c in children}) == len(children) >= 4
    for c in every:
        if c.data.tags["trial_id"] in ended_before:
            assert client.get_metric_history(c.info.run_id, "map_at_r") == ended_before[c.data.tags["trial_id"]]

    stopped = [c for c in children if c.info.status == "KILLED"]
    seen = [(c.data.params["optim.lr"], c.data.params["train.seed"], c.info.status, c.data.metrics.get("map_at_r"))
            for c in children]
    assert stopped and all(float(c.data.params["optim.lr"]) == 3e-2 for c in stopped), seen
    for child in children:
        tags = child.data.tags
        assert (child.info.status == "KILLED") == ("asha.rung" in tags), tags
        assert tags["trial_cpus"] == "1" and tags["trial_gpus"] == "0"
        if "asha.rung" in tags:  # the value ASHA compared is the run's logged metric at that epoch
            at = [m.value for m in client.get_metric_history(child.info.run_id, "map_at_r")
                  if m.step == int(tags["asha.epoch"])]
            assert tags["asha.rung"] == "1" and float(tags["asha.value"]) == at[-1] < float(tags["asha.cutoff"])
            assert int(tags["asha.rung_trials"]) >= 1

    page = tmp_path / "sweep.html"
    report.build_report([parent_id], out=page, tracking_uri=local_mlflow, log=False)
    swept = sweep_page.collect_sweep(client, client.get_run(parent_id))
    assert len(swept.trials) == len(children)  # a lost trial's run is not one of the sweep's trials
    browser.get(page.as_uri())
    section = browser.find_element("css selector", "#sweep")
    browser.execute_script("arguments[0].scrollIntoView()", section)
    shown = {row.find_element("tag name", "code").text: float(row.find_elements("tag name", "td")[2].text)
             for row in browser.find_elements("css selector", "table.importance tbody tr")}
    assert shown == pytest.approx(sweep_page.importances(swept), abs=5e-5) and shown["optim.lr"] > 0.5
    rung = [td.text for td in browser.find_elements("css selector", "table.rungs tbody td")]
    assert rung[:3] == ["1", str(len(children)), str(len(stopped))], rung
    spread = [td.text for td in browser.find_elements("css selector", "table.seeds tbody td")]
    assert spread[0] == "optim.lr=0.001" and set(spread[2].split(", ")) == {"0", "1"}, spread
    cost = [td.text for td in browser.find_elements("css selector", "table.sweep-cost tbody td")]
    assert cost[0] == str(len(children)) and float(cost[1]) > 0 and float(cost[2]) > 0, cost
    sizes = browser.execute_script("return Array.from(document.querySelectorAll('#sweep ~ .plots img'))"
                                   ".map(i => i.complete ? i.naturalWidth : 0)")
    assert len(sizes) == 2 and min(sizes) > 400, sizes  # parallel coordinates and the scatter, decoded
    shot = browser.get_screenshot_as_png()
    (tmp_path / "sweep-page.png").write_bytes(shot)
    assert_not_blank(shot, "sweep page", min_colours=32)
