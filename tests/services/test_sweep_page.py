"""The sweep section of ``proxydml report``: importances equal Optuna's own, ASHA's stops as Ray
decided them, and the cost and seed-spread arithmetic on known numbers."""

from __future__ import annotations

import math
import os
import re
import statistics
import types

import numpy as np
import optuna
import pytest
from mlflow.entities import Param, RunTag
from mlflow.tracking import MlflowClient

from services import report, sweep_page
from services.search_space import Dimension

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

DIMS = [Dimension("optim.lr", "loguniform", (1e-4, 1e-2)), Dimension("loss.alpha", "uniform", (8.0, 48.0)),
        Dimension("loss.name", "choice", ("proxy_anchor", "proxy_nca_pp")), Dimension("train.seed", "randint", (0, 4))]


def _objective(trial: optuna.Trial) -> float:
    """A metric driven mostly by the learning rate, a little by alpha, not at all by the seed."""
    lr = trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
    alpha = trial.suggest_float("loss.alpha", 8.0, 48.0)
    name = trial.suggest_categorical("loss.name", ["proxy_anchor", "proxy_nca_pp"])
    trial.suggest_int("train.seed", 0, 3)
    return 0.6 - 0.05 * (math.log10(lr) + 2.5) ** 2 + 0.002 * alpha / 48 + (0.001 if name == "proxy_nca_pp" else 0)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Optuna's own study of 24 trials, and the same trials logged as a sweep in MLflow the way
    a ProxyDML sweep logs them (params as strings, per-epoch metric, ASHA's stop tags)."""
    from services.mlflow_tracking import local_store

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=3))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(_objective, n_trials=24)

    uri, _ = local_store(tmp_path_factory.mktemp("sweep-store") / "mlruns")
    client = MlflowClient(uri)
    exp = client.create_experiment("sweep-page")
    parent = client.create_run(exp, run_name="digits-quick-s1", tags={"kind": "sweep", "sweep_name": "digits-quick-s1",
                                                                      "metric": "map_at_r", "mode": "max"})
    client.log_batch(parent.info.run_id, params=[Param(f"space.{d.key}", d.describe()) for d in DIMS])
    t0 = 1_700_000_000_000
    for i, trial in enumerate(study.trials):
        stopped = i % 3 == 1  # every third trial "stopped" at epoch 1 of 2
        child = client.create_run(exp, run_name=f"digits-quick-s1-t{i:02d}", start_time=t0 + i * 60_000, tags={
            "mlflow.parentRunId": parent.info.run_id, "trial_id": f"t{i:02d}", "trial_cpus": "2.0",
            "trial_gpus": "0"})
        client.log_batch(child.info.run_id, params=[Param(k, str(v)) for k, v in trial.params.items()]
                         + [Param("train.epochs", "2")])
        epochs = 1 if stopped else 2
        for epoch in range(1, epochs + 1):  # the last value is the one Optuna was told
            client.log_metric(child.info.run_id, "map_at_r", trial.value - 0.1 * (epochs - epoch), step=epoch)
        if stopped:
            client.log_batch(child.info.run_id, tags=[RunTag("asha.rung", "1"), RunTag("asha.value", repr(trial.value)),
                                                     RunTag("asha.cutoff", repr(trial.value + 0.01)),
                                                     RunTag("asha.rung_trials", str(i))])
        client.set_terminated(child.info.run_id, "KILLED" if stopped else "FINISHED", end_time=t0 + i * 60_000 + 90_000)
    client.set_terminated(parent.info.run_id, "FINISHED")
    return study, uri, parent.info.run_id


def test_importances_equal_optunas_own_on_the_same_trials(logged):
    study, uri, parent_id = logged
    client = MlflowClient(uri)
    sweep = sweep_page.collect_sweep(client, client.get_run(parent_id))
    assert len(sweep.trials) == 24 and sweep.epochs == 2
    # The params came back typed as the space's dimensions, equal to what Optuna suggested.
    assert [t.params for t in sweep.trials] == [t.params for t in study.trials]
    ours = sweep_page.importances(sweep)
    theirs = optuna.importance.get_param_importances(study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    assert list(ours) == list(theirs)
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert next(iter(ours)) == "optim.lr" and ours["optim.lr"] > 0.5  # the metric is mostly the lr's


def test_sweep_report_page_shows_the_section(logged, tmp_path):
    _, uri, parent_id = logged
    rep = report.build_report([parent_id], out=tmp_path / "r.html", tracking_uri=uri, log=False)
    page = rep.html
    assert 'id="sweep"' in page and "digits-quick-s1" in page
    sweep = sweep_page.collect_sweep(MlflowClient(uri), rep.runs[0].run)
    rows = re.findall(r"<tr><td><code>([^<]+)</code></td><td>.*?</td><td class=\"num\">([0-9.]+)</td>",
                      page.split('class="importance"')[1].split("</table>")[0])
    assert {k: float(v) for k, v in rows} == pytest.approx(sweep_page.importances(sweep), abs=5e-5)
    # 8 of 24 trials stopped at rung 1; their cutoffs (value + 0.01) are what the rung row spans.
    rung_row = page.split('class="rungs"')[1].split("</table>")[0]
    cutoffs = sorted(t.asha["cutoff"] for t in sweep.trials if t.asha)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", rung_row)
    assert cells == ["1", "24", "8", f"{cutoffs[0]:.4f} – {cutoffs[-1]:.4f}"]
    assert page.count("data:image/png;base64,") >= 2  # parallel coordinates and the scatter


def _trial(i: int, value: float | None, start_s: float, end_s: float, *, epochs: int = 2, seed: int = 0,
           lr: float = 1e-3, cpus: float = 2, gpus: float = 0, asha: dict | None = None) -> sweep_page.Trial:
    return sweep_page.Trial(f"t{i}", f"r{i}", {"optim.lr": lr, "train.seed": seed}, value, epochs, "FINISHED",
                            int(start_s * 1000), int(end_s * 1000), cpus, gpus, asha or {})


def test_cost_rungs_and_seed_spread_on_known_numbers():
    dims = [Dimension("optim.lr", "choice", (1e-3, 2e-3)), Dimension("train.seed", "randint", (0, 10))]
    trials = [
        _trial(0, 0.30, 0, 100),  # the first trial
        _trial(1, 0.35, 50, 150, seed=1),  # overlaps trial 0: busy 0-150
        _trial(2, 0.20, 1000, 1100, epochs=1, lr=2e-3, asha={"rung": 1, "value": 0.2, "cutoff": 0.31,
                                                              "rung_trials": 2}),  # after a gap: +100
        _trial(3, 0.40, 1050, 1200, seed=2),  # +100 (1100-1200)
        _trial(4, None, 1300, 1310, gpus=1),  # failed, unscored; +10
    ]
    sweep = sweep_page.Sweep("s", None, "map_at_r", "max", dims, 2, trials)
    c = sweep_page.cost(sweep)
    assert c.busy_hours == pytest.approx(360 / 3600)
    assert c.trials_per_hour == pytest.approx(5 / (360 / 3600))
    assert c.cpu_hours == pytest.approx(2 * (100 + 100 + 100 + 150 + 10) / 3600)
    assert c.gpu_hours == pytest.approx(10 / 3600)
    assert (c.first, c.best) == (0.30, 0.40)
    assert c.cpu_hours_per_point == pytest.approx(c.cpu_hours / 10)  # 0.10 gained = 10 points

    (rung,) = sweep_page.rungs(sweep)
    assert (rung.epoch, rung.reached, rung.stopped, rung.cutoffs) == (1, 5, 1, [0.31])

    (rep,) = sweep_page.repeats(sweep)  # lr 1e-3 ran to the end with seeds 0, 1, 2; lr 2e-3 was stopped
    assert rep.params == {"optim.lr": 1e-3} and rep.seeds == [0, 1, 2]
    assert statistics.stdev(rep.values) == pytest.approx(np.std([0.30, 0.35, 0.40], ddof=1))

    worse = sweep_page.Sweep("s", None, "map_at_r", "max", dims, 2, [_trial(0, 0.4, 0, 10), _trial(1, 0.3, 10, 20)])
    assert sweep_page.cost(worse).cpu_hours_per_point is None  # nothing gained over the first trial


def test_dimension_params_round_trip():
    for d in DIMS:
        assert Dimension.parse(d.key, d.describe()) == d
    assert DIMS[2].value_of("proxy_nca_pp") == "proxy_nca_pp" and DIMS[3].value_of("3") == 3
    with pytest.raises(ValueError, match="space.x: 'gauss\\[1, 2\\]' is not kind"):
        Dimension.parse("x", "gauss[1, 2]")
    with pytest.raises(ValueError, match="loss.name='triplet' is none of"):
        DIMS[2].value_of("triplet")


def test_recording_asha_decides_as_ray_and_records_each_stop_with_its_cutoff():
    """The same stream of results through Ray's ASHA and through ours: the same decisions, and
    each early stop recorded with the rung, the value and the cutoff it fell below."""
    from ray.tune.schedulers import ASHAScheduler

    from services import runtime

    rng = np.random.default_rng(0)
    kwargs = dict(time_attr="epoch", metric="map_at_r", mode="max", max_t=8, grace_period=1, reduction_factor=2)
    theirs, ours = ASHAScheduler(**kwargs), runtime._RecordingASHA("s", **kwargs)
    stops: dict[str, dict] = {}
    runtime._STOP_SINKS["s"] = lambda trial_id, judged: stops.setdefault(trial_id, judged)
    try:
        trials = [types.SimpleNamespace(trial_id=f"t{i}") for i in range(12)]
        for t in trials:
            theirs.on_trial_add(None, t)
            ours.on_trial_add(None, t)
        alive = {t.trial_id: t for t in trials}
        quality = {t.trial_id: rng.uniform(0.1, 0.5) for t in trials}
        recorded: dict[int, list[float]] = {1: [], 2: [], 4: []}  # the rungs below max_t, kept by hand
        for epoch in range(1, 9):
            for tid in list(alive):
                result = {"epoch": epoch, "map_at_r": quality[tid] + 0.02 * epoch + rng.normal(0, 0.01)}
                before = list(recorded.get(epoch, []))
                a = theirs.on_trial_result(None, alive[tid], dict(result))
                b = ours.on_trial_result(None, alive[tid], dict(result))
                assert a == b
                if epoch in recorded:
                    recorded[epoch].append(result["map_at_r"])
                if a == "STOP":
                    if epoch < 8:
                        # The cutoff: the median (rf 2) of what the rung had recorded before.
                        assert stops[tid] == {"rung": epoch, "epoch": epoch, "value": result["map_at_r"],
                                              "cutoff": pytest.approx(np.percentile(before, 50), abs=1e-15),
                                              "rung_trials": len(before)}
                        assert stops[tid]["value"] < stops[tid]["cutoff"]
                    else:
                        assert tid not in stops  # the last epoch ends every trial: not an early stop
                    del alive[tid]
    finally:
        runtime._STOP_SINKS.pop("s", None)
    assert len(stops) >= 6 and {s["rung"] for s in stops.values()} == {1, 2, 4}
