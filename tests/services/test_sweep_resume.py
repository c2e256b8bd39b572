"""What lets a sweep resume after its driver was killed outright, piece by piece against a real
sqlite MLflow store: a restored trial that had ended says where, an ASHA stop is recorded once,
runs of trials the saved sweep state never held are adopted when they had ended and otherwise
closed and tagged, and the searcher takes the results of a trial it never suggested."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from pipelines.config import load_config
from services import mlflow_tracking as mt
from services import sweep

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture
def spec_and_parent(tmp_path):
    uri, _ = mt.local_store(tmp_path / "mlruns")
    base = load_config("digits", ["train.epochs=4", "scaling.num_workers=1", f"tracking.tracking_uri={uri}",
                                  f"tracking.storage_path={tmp_path / 'runs'}"])
    spec = sweep.load_sweep(base, "digits_quick", samples=4, scheduler="asha", search="optuna", max_concurrent=1,
                            cluster_cpus=2)
    parent_id, _ = sweep.open_parent_run(spec, uri, sweep.resolve_space_file("digits_quick"))
    return spec, uri, parent_id


def _trial_run(spec, uri: str, parent_id: str, trial_id: str) -> tuple[object, str]:
    cfg = sweep.apply(spec.base, {"optim.lr": 1e-3, "loss.alpha": 16.0})
    cfg.tracking.run_name = f"{spec.name()}-{trial_id}"
    run_id, _ = mt.open_run(cfg, uri, extra_tags={"mlflow.parentRunId": parent_id, "sweep_name": spec.name(),
                                                  "trial_id": trial_id})
    return cfg, run_id


def test_a_restored_trial_that_had_ended_says_where_and_an_asha_stop_is_recorded_once(spec_and_parent):
    spec, uri, parent_id = spec_and_parent
    client = MlflowClient(uri)
    fresh = sweep.apply(spec.base, {})
    fresh.tracking.run_name = f"{spec.name()}-never"
    assert mt.ended_trial(fresh, uri) is None  # no run yet

    running, run_id = _trial_run(spec, uri, parent_id, "t1")
    client.log_metric(run_id, "map_at_r", 0.25, step=1)
    assert mt.ended_trial(running, uri) is None  # still to go on

    judged = {"rung": 2.0, "epoch": 3.0, "value": 0.2512345678901234, "cutoff": 0.26, "rung_trials": 7.0}
    mt.record_asha_stop(uri, parent_id, "t1", judged)
    mt.record_asha_stop(uri, parent_id, "t1", {**judged, "cutoff": 0.1})  # a replay judged again
    tags = client.get_run(run_id).data.tags
    assert {k: tags[f"asha.{k}"] for k in mt.ASHA_TAGS} == {
        "rung": "2", "epoch": "3", "value": "0.2512345678901234", "cutoff": "0.26", "rung_trials": "7"}
    assert float(tags["asha.value"]) == judged["value"]  # repr: the float ASHA compared, to the bit
    assert mt.ended_trial(running, uri) == {"map_at_r": 0.25, "epoch": 3}

    done, done_id = _trial_run(spec, uri, parent_id, "t2")
    client.log_metric(done_id, "map_at_r", 0.31, step=4)
    mt.end_run(done_id, uri, "FINISHED")
    assert mt.ended_trial(done, uri) == {"map_at_r": 0.31, "epoch": 4}
    with pytest.raises(LookupError, match="no run of trial t9"):
        mt.record_asha_stop(uri, parent_id, "t9", judged)


def test_runs_the_saved_state_never_held_are_adopted_if_they_ended_else_closed_and_tagged(spec_and_parent):
    spec, uri, parent_id = spec_and_parent
    client = MlflowClient(uri)
    _, known = _trial_run(spec, uri, parent_id, "t1")
    _, open_lost = _trial_run(spec, uri, parent_id, "t2")
    _, finished = _trial_run(spec, uri, parent_id, "t3")
    client.log_metric(finished, "map_at_r", 0.33, step=4)
    mt.end_run(finished, uri, "FINISHED")
    _, stopped = _trial_run(spec, uri, parent_id, "t4")
    client.log_metric(stopped, "map_at_r", 0.21, step=1)
    mt.record_asha_stop(uri, parent_id, "t4", {"rung": 1.0, "epoch": 1.0, "value": 0.21, "cutoff": 0.25,
                                               "rung_trials": 3.0})
    adopted = sweep.close_trial_runs(spec, uri, parent_id, [
        {"trial_id": "t1", "params": {}, "metric": 0.3, "epochs": 4, "error": None}])
    point = {"optim.lr": 1e-3, "loss.alpha": 16.0}  # typed as the space's dimensions
    assert sorted(adopted, key=lambda t: t["trial_id"]) == [
        {"trial_id": "t3", "params": point, "metric": 0.33, "epochs": 4, "error": None, "asha": None},
        {"trial_id": "t4", "params": point, "metric": 0.21, "epochs": 1, "error": None,
         "asha": {"rung": 1.0, "epoch": 1.0, "value": 0.21, "cutoff": 0.25, "rung_trials": 3.0}}]
    runs = {r: client.get_run(r) for r in (known, open_lost, finished, stopped)}
    assert runs[known].info.status == "FINISHED" and sweep.LOST_TAG not in runs[known].data.tags
    assert runs[open_lost].info.status == "KILLED" and runs[open_lost].data.tags[sweep.LOST_TAG] == "true"
    assert runs[finished].info.status == "FINISHED" and sweep.LOST_TAG not in runs[finished].data.tags
    assert runs[stopped].info.status == "KILLED" and runs[stopped].data.tags["stopped_early"] == "true"
    assert sweep.LOST_TAG not in runs[stopped].data.tags


def test_the_searcher_takes_the_score_of_a_trial_it_never_suggested():
    from ray import tune

    from services.runtime import OptunaSearch, _ResumableOptunaSearch

    space = OptunaSearch.convert_search_space({"optim.lr": tune.loguniform(1e-4, 1e-2)})
    searcher = _ResumableOptunaSearch(space, metric="map_at_r", mode="max", seed=0)
    suggested = searcher.suggest("known")
    searcher.on_trial_result("known", {"map_at_r": 0.2, "training_iteration": 1})
    searcher.on_trial_complete("known", {"map_at_r": 0.2, "config": suggested})
    # A trial of the restored sweep state that the restored searcher never suggested:
    searcher.on_trial_result("stranger", {"map_at_r": 0.3, "training_iteration": 1})  # Ray's: KeyError
    searcher.on_trial_complete("stranger", {"map_at_r": 0.3, "config": {"optim.lr": 2e-3}})
    values = sorted((t.params["optim.lr"], t.value) for t in searcher._ot_study.trials)
    assert values == sorted([(suggested["optim.lr"], 0.2), (2e-3, 0.3)])
    searcher.on_trial_complete("stranger", {"map_at_r": 0.3, "config": {"optim.lr": 2e-3}})  # once only
    assert len(searcher._ot_study.trials) == 2
