"""Bad input through the real CLI: one clear message, exit 2, no MLflow run left RUNNING."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.e2e


def proxydml(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=_env())


def _env():
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "train.epochz=1"], "unknown config key train.epochz"),
        (["train", "data.batch_size=big"], "data.batch_size: expected an integer"),
        (["train", "train.epochs=-2"], "train.epochs must be > 0"),
        (["train", "data.batch_size=-64"], "data.batch_size must be > 0"),
        (["train", "loss.name=arcface"], "loss.name: unknown loss 'arcface'"),
        (["train", "--config", "missing_recipe"], "config file 'missing_recipe' not found"),
        (["eval", "--checkpoint", "/nonexistent/ckpt"], "checkpoint folder /nonexistent/ckpt does not exist"),
        (["config", "show", "digits", "model.pooling=median"], "model.pooling must be one of"),
        # Every loss value is checked by the loss's own constructor, before any worker starts.
        (["config", "show", "emoji_proxy_isa", "loss.h=0"], "loss.h must be > 0"),
        (["config", "show", "emoji_proxy_isa", "loss.tau=-1"], "loss.tau must be > 0"),
        (["config", "show", "--config", "emoji_proxy_anchor", "loss.delta=-0.1"], "loss.delta must be >= 0"),
        (["train", "loss.name=proxy_isa", "loss.h=0"], "loss.h must be > 0"),
        # Only the built model knows its stage count: the driver builds it before any run opens.
        (["train", "model.frozen_stages=99"], "model.frozen_stages=99, but backbone convnet has 3 stages"),
        # Proxies are sharded by class: a worker without a class would hang the collectives.
        (["train", "scaling.num_workers=8"], "scaling.num_workers (8) exceeds the 5 training classes"),
        # Unequal local batches would abort gloo inside the embedding all-gather.
        (["train", "scaling.num_workers=5", "data.batch_size=48"],
         "data.batch_size (48) must be divisible by scaling.num_workers (5)"),
    ],
)
def test_bad_input_gives_one_clear_error(tmp_path, args, message, capsys, monkeypatch):
    # In this process (a new interpreter per case cost 4-8 s each); the real process is below.
    from services.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines == [f"error: {lines[0].removeprefix('error: ')}"] and message in lines[0], err
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "runs").exists()


def test_bad_input_through_the_real_command_is_one_line_and_exit_2(tmp_path):
    out = proxydml("train", "model.frozen_stages=99", cwd=tmp_path)  # the driver builds the model first
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "backbone convnet has 3 stages" in lines[0], out.stderr
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "runs").exists()
    assert not (tmp_path / ".proxydml").exists()  # not even a console log


def test_bad_model_setting_fails_before_ray_and_mlflow_are_imported(tmp_path):
    """The driver's preflight (data set, sampler, model) runs before the modules that import Ray
    and MLflow (5-6 s of a command's start-up) are loaded."""
    code = ("import sys; from services.cli import main; code = main(['train', 'model.frozen_stages=99']); "
            "print(code, sorted(m for m in ('ray', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=_env())
    assert out.stdout.strip().splitlines()[-1] == "2 []", out.stdout + out.stderr
    assert "backbone convnet has 3 stages" in out.stderr


def test_dataset_with_one_class_is_refused_before_any_run(tmp_path):
    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for part, classes in (("train", ["a"]), ("test", ["b", "c"])):
        for c in classes:
            (root / part / c).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / part / c / f"{i}.png")
    out = proxydml("train", "data.name=folder", f"data.root={root}", "data.samples_per_class=0",
                   "data.batch_size=2", cwd=tmp_path)
    assert out.returncode == 2
    assert "training split has 1 class(es); need >= 2" in out.stderr
    assert not (tmp_path / "mlruns").exists()


def test_weights_of_another_architecture_are_refused_before_any_run(tmp_path):
    import torch

    weights = tmp_path / "lite0.pt"
    torch.save({"_conv_stem.weight": torch.zeros(32, 3, 3, 3)}, weights)
    out = proxydml("train", "model.backbone=resnet50", f"model.weights={weights}", "data.image_size=32",
                   cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"model.weights: {weights} are not resnet50 weights" in out.stderr
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "runs").exists()


def test_config_show_prints_the_resolved_recipe(tmp_path):
    out = proxydml("config", "show", "proxy_isa_cub", "loss.k=0.4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: proxy_isa" in out.stdout and "k: 0.4" in out.stdout
    assert out.stdout.startswith("# run name: cub-proxy_isa-s0-")


def test_config_show_takes_the_recipe_as_train_does(tmp_path):
    out = proxydml("config", "show", "--config", "digits", "loss.alpha=16", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == proxydml("config", "show", "digits", "loss.alpha=16", cwd=tmp_path).stdout
    assert "name: digits" in out.stdout and "alpha: 16.0" in out.stdout
