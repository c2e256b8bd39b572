"""Sweep validation before any trial: space files, ASHA settings and the shipped spaces
(pure checks: no Ray cluster, no server)."""

from __future__ import annotations

import pytest
import yaml

from pipelines.config import ConfigError, from_dict, load_config
from services import sweep
from services.search_space import trial_count


def test_space_errors_come_before_any_trial(tmp_path, digits_config):
    base = digits_config("sqlite:///unused.db", tmp_path, steps=3)
    bad = tmp_path / "bad.yaml"
    cases = [
        ({"loss.temprature": {"uniform": [0.1, 0.2]}}, "'loss.temprature' is not a config field"),
        ({"loss.temperature": {"uniform": [-0.1, 0.2]}}, "loss.temperature=-0.1 is outside the valid domain"),
        ({"loss.V": {"uniform": [0.5, 50]}}, "loss.V=0.5 is outside the valid domain"),
        ({"loss.alpha": {"loguniform": [0.0, 1.0]}}, "loguniform needs low > 0"),
        ({"optim.lr": {"normal": [0.1, 0.2]}}, "unknown domain 'normal'"),
    ]
    for space, message in cases:
        bad.write_text(yaml.safe_dump(space))
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            sweep.load_sweep(base.__class__() if "V" in str(space) else base, bad, samples=2,
                             scheduler="asha", search="optuna", max_concurrent=None, cluster_cpus=4)
    with pytest.raises(ConfigError, match="the cluster holds 2 trial"):
        sweep.load_sweep(base, "digits_quick", samples=4, scheduler="asha", search="optuna",
                         max_concurrent=3, cluster_cpus=4)
    with pytest.raises(ConfigError, match="Optuna samples"):
        bad.write_text(yaml.safe_dump({"optim.lr": {"grid": [0.001, 0.01]}}))
        sweep.load_sweep(base, bad, samples=2, scheduler="asha", search="optuna", max_concurrent=None,
                         cluster_cpus=4)
    ok = dict(samples=2, scheduler="asha", search="random", max_concurrent=None, cluster_cpus=4)
    with pytest.raises(ConfigError, match="train.eval_every must be 1 in a sweep"):
        sweep.load_sweep(from_dict({**base.to_dict(), "train": {**base.to_dict()["train"], "eval_every": 2}}),
                         "digits_quick", **ok)
    with pytest.raises(ConfigError, match="ASHA grace period must be in"):
        sweep.load_sweep(base, "digits_quick", grace_period=base.train.epochs + 1, **ok)
    with pytest.raises(ConfigError, match="reduction factor must be >= 2"):
        sweep.load_sweep(base, "digits_quick", reduction_factor=1, **ok)
    with pytest.raises(ConfigError, match="preset point 0: loss.nope not in the search space"):
        sweep.load_sweep(base, "digits_quick", points=[{"loss.nope": 1.0}], **ok)
    with pytest.raises(ConfigError, match="3 preset points but only 2 trial"):
        sweep.load_sweep(base, "digits_quick", points=[{}, {}, {}], **ok)


def test_cli_passes_asha_settings_and_rejects_bad_ones_before_any_trial(capsys, tmp_path):
    from services import cli

    runs = tmp_path / "runs"
    argv = ["tune", "--space", "digits_quick", "--samples", "2", f"tracking.storage_path={runs}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    assert cli.main([*argv, "--grace", "99"]) == 2
    assert "ASHA grace period must be in [1, train.epochs=" in capsys.readouterr().err
    assert cli.main([*argv, "--reduction-factor", "1"]) == 2
    assert "ASHA reduction factor must be >= 2, got 1" in capsys.readouterr().err
    assert not runs.exists() and not (tmp_path / "mlflow.db").exists()  # nothing half-written


# The reality-check study's spaces are validated against their own recipes, named in the
# study's method table: tests/benchmarks/study/test_reality_study.py.
@pytest.mark.parametrize("space", sorted(p.name for p in sweep.SEARCH_DIR.glob("*.yaml")))
def test_shipped_spaces_validate(space):
    recipe = {"proxy_isa.yaml": "proxy_isa_cub", "proxy_nca_pp.yaml": "proxy_nca_pp_cub",
              "proxy_synthesis.yaml": "proxy_synthesis_cub",
              "emoji_proxy_anchor.yaml": "emoji_proxy_anchor"}.get(space, "digits")
    base = load_config(recipe)
    spec = sweep.load_sweep(base, space, samples=4, scheduler="asha", search="optuna", max_concurrent=None,
                            cluster_cpus=64)
    assert spec.space and spec.name().startswith("sweep-")


ISA_AND_LR = ("loss.V: {loguniform: [10.0, 1000.0]}\nloss.tau: {uniform: [0.5, 3.0]}\n"
              "loss.h: {uniform: [0.05, 0.5]}\nloss.k: {uniform: [0.1, 1.0]}\noptim.lr: {loguniform: [3.0e-5, 3.0e-4]}\n")
ANCHOR_AND_LR = ("loss.alpha: {uniform: [16.0, 64.0]}\nloss.delta: {uniform: [0.0, 0.3]}\n"
                 "optim.lr: {loguniform: [3.0e-5, 3.0e-4]}\n")


def test_include_base_runs_the_recipes_own_point_first_with_the_losses_defaults_resolved(tmp_path):
    base = load_config("emoji_proxy_isa")  # sets alpha, delta and lr; leaves V, tau, h, k to the loss
    space = tmp_path / "isa_and_lr.yaml"
    space.write_text(ISA_AND_LR)
    ok = dict(samples=4, scheduler="asha", search="optuna", max_concurrent=None, cluster_cpus=4)
    plain = sweep.load_sweep(base, space, **ok)
    spec = sweep.load_sweep(base, space, include_base=True, points=[{"optim.lr": 3e-5}], **ok)
    # the authors' defaults, as the loss's constructor has them (None in the config means those)
    assert spec.points == ({"loss.V": 100.0, "loss.tau": 1.5, "loss.h": 0.15, "loss.k": 0.9, "optim.lr": 1e-4},
                           {"optim.lr": 3e-5})
    assert plain.points == () and plain.name() != spec.name()  # a different sweep, not a resume of the other


def test_cli_include_base_reaches_the_sweep(capsys, tmp_path, monkeypatch):
    from services import cli

    seen = {}

    def stop(base, space, **kwargs):  # records what the CLI asked for, then refuses like a bad space
        seen.update(kwargs)
        raise ConfigError("stopped before any trial")

    monkeypatch.setattr(sweep, "run_sweep", stop)
    argv = ["tune", "--space", "digits_quick", "--samples", "2", f"tracking.storage_path={tmp_path / 'runs'}"]
    assert cli.main([*argv, "--include-base"]) == 2 and seen["include_base"] is True
    assert cli.main(argv) == 2 and seen["include_base"] is False
    assert capsys.readouterr().err.count("stopped before any trial") == 2


def test_warm_start_tells_the_searcher_the_earlier_points_that_fit_this_space(tmp_path, capsys):
    from services import cli

    base = load_config("digits")
    ok = dict(samples=2, scheduler="none", max_concurrent=None, cluster_cpus=4, warm_start="sweep-earlier")
    earlier = [({"optim.lr": 1e-3, "loss.alpha": 32.0}, 0.41),
               ({"optim.lr": 1e-2, "loss.alpha": 32.0}, 0.30),  # lr outside this space's [3e-4, 3e-3]
               ({"optim.lr": 1e-3}, 0.35),  # searched fewer keys
               ({"optim.lr": 2e-3, "loss.alpha": 16.0}, float("nan"))]
    spec = sweep.load_sweep(base, "digits_quick", search="optuna", evaluated=earlier, **ok)
    assert spec.evaluated == (({"optim.lr": 1e-3, "loss.alpha": 32.0}, 0.41),) and spec.points == ()
    cold = sweep.load_sweep(base, "digits_quick", search="optuna", **{**ok, "warm_start": ""})
    assert cold.evaluated == () and cold.name() != spec.name()  # a new sweep, not a resume of the cold one
    with pytest.raises(ConfigError, match="--warm-start needs --search optuna"):
        sweep.load_sweep(base, "digits_quick", search="random", evaluated=earlier, **ok)
    with pytest.raises(ConfigError, match=r"--warm-start sweep-earlier: none of its 2 scored trial\(s\) is a point "
                                          r"of this search space \(loss.alpha, optim.lr\)"):
        sweep.load_sweep(base, "digits_quick", search="optuna", evaluated=earlier[1:3], **ok)
    # the CLI: one line and exit 2 before anything starts
    argv = ["tune", "--space", "digits_quick", "--samples", "2", f"tracking.storage_path={tmp_path / 'runs'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    capsys.readouterr()
    assert cli.main([*argv, "--start-from-best"]) == 2
    assert cli.main([*argv, "--warm-start", "sweep-nowhere"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --start-from-best needs --warm-start SWEEP (the sweep whose best point starts)",
                   f"error: --warm-start: no sweep named 'sweep-nowhere' in sqlite:///{tmp_path / 'mlflow.db'}"]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # nothing half-written


def test_pbt_needs_random_search_one_worker_trials_and_keys_that_can_change_mid_run(tmp_path):
    base = load_config("digits", ["scaling.num_workers=1"])
    ok = dict(samples=4, max_concurrent=None, cluster_cpus=4)
    assert sweep.load_sweep(base, "digits_quick", scheduler="pbt", search="random", **ok).scheduler == "pbt"
    with pytest.raises(ConfigError, match="--scheduler pbt needs --search random"):
        sweep.load_sweep(base, "digits_quick", scheduler="pbt", search="optuna", **ok)
    with pytest.raises(ConfigError, match=r"--scheduler pbt needs one-worker trials \(scaling.num_workers=1"):
        sweep.load_sweep(load_config("digits", ["scaling.num_workers=2"]), "digits_quick", scheduler="pbt",
                         search="random", **ok)
    space = tmp_path / "shape.yaml"
    space.write_text("optim.lr: {loguniform: [1.0e-4, 1.0e-3]}\nmodel.embedding_dim: {choice: [32, 64]}\n")
    with pytest.raises(ConfigError, match=r"--scheduler pbt: model.embedding_dim cannot change in the middle of a "
                                          r"run; PBT perturbs optim.lr, optim.proxy_lr_multiplier, loss.alpha, loss.delta"):
        sweep.load_sweep(base, space, scheduler="pbt", search="random", **ok)
    with pytest.raises(ConfigError, match="--scheduler must be asha, pbt or none"):
        sweep.load_sweep(base, "digits_quick", scheduler="hyperband", search="random", **ok)


def test_asha_first_rung_defaults_past_the_warm_up_and_a_rung_inside_it_is_refused(tmp_path):
    base = load_config("emoji_proxy_anchor")  # 1 warm-up epoch (head and proxies only), 5 epochs
    space = tmp_path / "anchor_and_lr.yaml"
    space.write_text(ANCHOR_AND_LR)
    ok = dict(samples=4, search="optuna", max_concurrent=None, cluster_cpus=4)
    assert sweep.load_sweep(base, space, scheduler="asha", **ok).grace_period == 2
    with pytest.raises(ConfigError, match=r"ASHA grace period 1 ends inside the warm-up \(optim.warmup_epochs=1\)"
                                          r".*use --grace 2 or more"):
        sweep.load_sweep(base, space, scheduler="asha", grace_period=1, **ok)
    # without ASHA there is no rung to misplace; without a warm-up the first epoch is a fair rung
    assert sweep.load_sweep(base, space, scheduler="none", grace_period=1, **ok).grace_period == 1
    cold = load_config("emoji_proxy_anchor", ["optim.warmup_epochs=0"])
    assert sweep.load_sweep(cold, space, scheduler="asha", **ok).grace_period == 1


def test_a_grid_runs_its_points_at_once_where_the_cluster_holds_them(tmp_path):
    # --search grid runs the cross product once whatever --samples says: a 2 x 2 grid is 4
    # trials, and on 4 CPUs four 1-CPU trials run together (they once ran one at a time).
    base = load_config("digits")
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"optim.lr": {"grid": [1e-4, 1e-3]}, "optim.scheduler": {"grid": ["none", "cosine"]}}))
    per_trial = base.scaling.min_workers * base.scaling.resolved(1, sweep=True).cpus_per_worker
    spec = sweep.load_sweep(base, grid, samples=1, scheduler="none", search="grid", max_concurrent=None,
                            cluster_cpus=4 * per_trial)
    assert trial_count(spec.space, spec.samples, spec.search) == 4
    assert spec.max_concurrent == 4
    # random search repeats the grid per sample: 3 samples x 4 points, capped by the cluster
    spec = sweep.load_sweep(base, grid, samples=3, scheduler="none", search="random", max_concurrent=None,
                            cluster_cpus=8 * per_trial)
    assert trial_count(spec.space, spec.samples, spec.search) == 12
    assert spec.max_concurrent == 8


def test_the_ranked_table_of_a_large_sweep_stays_short(capsys, tmp_path, monkeypatch):
    """200 trials: the console ends with the 20 best, the failed ones (up to 10 more, each with
    its error) and where every trial is; not 200 rows."""
    from services import cli

    trials = [{"trial_id": f"t{i:03d}", "params": {"optim.lr": 1e-3}, "metric": i / 1000, "epochs": 4, "error": None}
              for i in range(188)]
    trials += [{"trial_id": f"f{i:02d}", "params": {"optim.lr": 1e-2}, "metric": None, "epochs": 1,
                "error": f"RuntimeError('boom {i}')\nTraceback"} for i in range(12)]

    def done(base, space, **kwargs):
        return sweep.SweepOutcome("s", "0" * 32, trials, None, False)

    monkeypatch.setattr(sweep, "run_sweep", done)
    assert cli.main(["tune", "--space", "digits_quick", "--samples", "200",
                     f"tracking.storage_path={tmp_path / 'runs'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("  t") or line.startswith("  f")]
    assert [r.split()[0] for r in rows[:20]] == [f"t{i:03d}" for i in range(187, 167, -1)]
    assert [r.split()[0] for r in rows[20:]] == [f"f{i:02d}" for i in range(10)]
    assert sum("failed: RuntimeError('boom" in line for line in lines) == 10
    assert f"  ... 170 more (every trial: proxydml report {'0' * 32})" in lines
    assert len(lines) < 60
