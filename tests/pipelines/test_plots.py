"""Dashboard plots: real, non-blank PNGs; right/wrong borders; Proxy-ISA state; the train-loop hook."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from pipelines import plots
from pipelines.data import TensorImageDataset
from pipelines.tracking import NullTracker
from proxies import ProxyAnchorLoss, ProxyISALoss
from proxies.synthesis import ProxySynthesis

C, D, PER_CLASS = 6, 16, 12


def assert_real_png(path: Path, min_w: int = 300, min_h: int = 200) -> np.ndarray:
    """Decodes as PNG of at least min_w x min_h, not blank: pixel spread and many colours."""
    assert path.is_file(), path
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.width >= min_w and im.height >= min_h, im.size
        rgb = np.asarray(im.convert("RGB"))
    assert rgb.astype(float).std() > 10.0, f"{path.name} looks blank"
    colours = np.unique(rgb.reshape(-1, 3), axis=0)
    assert len(colours) >= 16, f"{path.name} has only {len(colours)} colours"
    return rgb


def has_colour(rgb: np.ndarray, colour: tuple[int, int, int], min_pixels: int = 50, tol: int = 12) -> bool:
    close = (np.abs(rgb.astype(int) - np.array(colour)) <= tol).all(axis=-1)
    return int(close.sum()) >= min_pixels


@pytest.fixture(scope="module")
def toy():
    """Embeddings (N, D) with classes 0-3 well separated and 4, 5 mixed; coloured images."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(C).repeat_interleave(PER_CLASS)
    centres = torch.randn(C, D, generator=g) * 3
    centres[5] = centres[4]  # classes 4 and 5 overlap: their queries get red neighbours
    emb = centres[labels] + torch.randn(len(labels), D, generator=g)
    images = torch.rand(len(labels), 3, 20, 20, generator=g) * 0.3
    for c in range(C):
        images[labels == c, c % 3] += 0.6
    return emb, labels, TensorImageDataset(images.clamp(0, 1), labels, "toy")


def isa_states(epochs: int = 3) -> tuple[nn.Module, list[dict]]:
    """A real Proxy-ISA inside Proxy Synthesis, stepped so its state moves."""
    g = torch.Generator().manual_seed(1)
    loss = ProxySynthesis(ProxyISALoss(C, D, memory_size=64, generator=g), generator=g)
    states: list[dict] = []
    for epoch in range(epochs):
        loss.set_epoch(epoch, memory_start_epoch=1)
        for _ in range(3):
            labels = torch.randint(C, (24,), generator=g)
            loss(torch.randn(24, D, generator=g), labels)
        states.append(plots.isa_snapshot(loss, epoch + 1))
    return loss, states


def test_learning_curves(tmp_path):
    history = [{"epoch": e, "loss": 3.0 / e, "recall_at_1": 0.2 + 0.1 * e, "map_at_r": 0.05 * e}
               for e in range(1, 5)]
    assert_real_png(plots.plot_learning_curves(history, tmp_path / plots.LEARNING_CURVES), 900, 250)


def test_learning_curves_single_epoch_and_missing_key(tmp_path):
    # One epoch (a point, not a line) and a run that logged no MAP@R still give a real image.
    assert_real_png(plots.plot_learning_curves([{"loss": 1.0, "recall_at_1": 0.5}], tmp_path / "lc.png"), 900, 250)


def test_retrieval_grid_marks_right_and_wrong(tmp_path, toy):
    emb, labels, ds = toy
    rgb = assert_real_png(plots.plot_retrieval_grid(emb, labels, lambda i: ds[i][0], tmp_path / "g.png",
                                                    num_queries=C, k=4), 400, 400)
    assert has_colour(rgb, plots._RIGHT) and has_colour(rgb, plots._WRONG) and has_colour(rgb, plots._QUERY)


def test_retrieval_grid_rows_are_named_by_the_data_set(tmp_path, toy, monkeypatch):
    from PIL import Image

    from pipelines.data import class_names
    from pipelines.data.transforms import ImageListDataset

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    ds = ImageListDataset([(tmp_path / "a.png", 0), (tmp_path / "a.png", 1)], lambda im: im, "toy",
                          classes=["1f600", "1f601"], names=["grinning face", "beaming face with smiling eyes"])
    assert class_names(ds) == ["grinning face", "beaming face with smiling eyes"]
    assert plots._class_label(1, class_names(ds)) == "beaming face with smi…"  # 22 characters, the last an ellipsis
    assert plots._class_label(7, None) == "class 7"
    seen: list[str] = []
    real = plots._save

    def record(fig, path):
        seen.extend(t.get_text() for t in fig.axes[0].get_yticklabels())
        return real(fig, path)

    monkeypatch.setattr(plots, "_save", record)
    emb, labels, images = toy
    names = [f"kind {c}" for c in range(C)]
    plots.plot_retrieval_grid(emb, labels, lambda i: images[i][0], tmp_path / "g.png", num_queries=3, names=names)
    assert len(seen) == 3 and all(label.startswith("kind ") for label in seen)


def test_neighbours_exclude_the_query_and_queries_span_classes(toy):
    emb, labels, _ = toy
    queries = plots.choose_queries(labels, 4)
    assert len(set(labels[queries].tolist())) == 4
    nn_rows = plots.nearest_neighbours(emb, queries, 5)
    assert nn_rows.shape == (4, 5)
    assert not (nn_rows == queries[:, None]).any()
    assert (labels[nn_rows[0]] == labels[queries[0]]).all()  # class 0 is well separated


def test_grey_and_odd_sized_images(tmp_path):
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    emb = torch.nn.functional.one_hot(labels, 3).float() + 0.01 * torch.arange(6)[:, None]
    images = torch.linspace(-0.5, 1.5, 8 * 5).reshape(1, 8, 5)  # 1 channel, not square, out of [0, 1]
    assert_real_png(plots.plot_retrieval_grid(emb, labels, lambda i: images * (i + 1) / 6, tmp_path / "g.png",
                                              k=3), 300, 200)


def test_proxy_similarity(tmp_path):
    proxies = torch.randn(30, D, generator=torch.Generator().manual_seed(2))
    sim = plots.proxy_similarity(proxies)
    assert sim.shape == (30, 30) and torch.allclose(sim.diagonal(), torch.ones(30), atol=1e-5)
    assert_real_png(plots.plot_proxy_similarity(proxies, tmp_path / "p.png"), 500, 400)
    # Many classes: a subset is drawn, the image stays the same size.
    assert_real_png(plots.plot_proxy_similarity(torch.randn(500, D), tmp_path / "p500.png", max_classes=50), 500, 400)


def test_embedding_map(tmp_path, toy):
    emb, labels, _ = toy
    xy = plots.pca_2d(emb)
    assert xy.shape == (len(emb), 2) and torch.isfinite(xy).all()
    assert_real_png(plots.plot_embedding_map(emb, labels, tmp_path / "e.png"), 500, 400)
    many = torch.arange(300) % 40  # more classes than colours: the rest are grey context
    assert_real_png(plots.plot_embedding_map(torch.randn(300, D), many, tmp_path / "e40.png", max_classes=10))


def test_isa_module_found_through_synthesis_and_only_for_isa():
    loss, states = isa_states()
    assert plots.find_isa_module(loss) is loss.base
    assert plots.find_isa_module(ProxyAnchorLoss(C, D)) is None
    assert plots.isa_snapshot(ProxyAnchorLoss(C, D), 1) is None
    assert [s["epoch"] for s in states] == [1, 2, 3]
    assert set(states[0]) == {"epoch", "count", "effective_num", "learned_sim", "s_out"}
    assert all(s["effective_num"].shape == (C,) for s in states)
    # Snapshots are copies: later steps do not rewrite earlier epochs.
    assert not torch.equal(states[0]["effective_num"], states[-1]["effective_num"])
    assert bool((states[0]["learned_sim"] == 1.0).all()) and bool((states[-1]["learned_sim"] < 1.0).any())


def test_isa_state_plot(tmp_path):
    _, states = isa_states()
    assert_real_png(plots.plot_isa_state(states, tmp_path / "isa.png"), 800, 500)
    with pytest.raises(ValueError):
        plots.plot_isa_state([], tmp_path / "none.png")


def test_dashboard_rows_keeps_whole_classes():
    labels = [i // 5 for i in range(100)]  # 20 classes x 5
    rows = plots.dashboard_rows(labels, 30)
    assert 10 <= len(rows) <= 30
    kept = {labels[r] for r in rows}
    assert all(sum(labels[r] == c for r in rows) == 5 for c in kept)
    assert plots.dashboard_rows(labels, 1000) == list(range(100))


class RecordingTracker:
    """A Tracker that keeps a copy of every logged artifact folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logged: list[tuple[Path, str | None]] = []

    def log_metrics(self, metrics, step):
        pass

    def set_tags(self, tags):
        pass

    def log_artifacts(self, local_dir, artifact_path=None):
        dest = self.root / f"{len(self.logged)}"
        shutil.copytree(local_dir, dest)  # the caller's folder is temporary
        self.logged.append((dest, artifact_path))


def test_write_dashboard_logs_every_plot_under_plots(tmp_path, toy):
    _, _, ds = toy
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 20 * 20, D))
    loss, states = isa_states()
    history = [{"epoch": 1.0, "loss": 2.0, "recall_at_1": 0.4, "map_at_r": 0.2},
               {"epoch": 2.0, "loss": 1.5, "recall_at_1": 0.5, "map_at_r": 0.3}]
    tracker = RecordingTracker(tmp_path)
    names = plots.write_dashboard(tracker, history, model, ds, loss.proxies, states, batch_size=32)
    assert sorted(names) == sorted(plots.PLOT_FILES)
    (folder, artifact_path), = tracker.logged
    assert artifact_path == "plots"
    for name in plots.PLOT_FILES:
        assert_real_png(folder / name, 300, 200)
    assert model.training  # the model's mode is restored
    # Nobody would see the files: nothing is rendered for the NullTracker.
    assert plots.write_dashboard(NullTracker(), history, model, ds, loss.proxies, states) == []


class RefusesToRun(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model must not run: the embeddings were given")


def test_given_embeddings_replace_the_models_pass(tmp_path, toy):
    """The train loop hands over its last evaluation: the same rows, no second forward pass."""
    emb, labels, ds = toy
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 20 * 20, D))
    rows, by_model, by_model_labels = plots._embed_for_plots(model, ds, "cpu", 32, max_items=40)
    full = torch.cat([model(ds[i][0][None]) for i in range(len(ds))]).detach()
    given = plots._embed_for_plots(RefusesToRun(), ds, "cpu", 32, max_items=40, embedded=(full, labels))
    assert given is not None and given[0] == rows and len(rows) <= 40
    torch.testing.assert_close(given[1], by_model, rtol=1e-5, atol=1e-6)
    assert torch.equal(given[2], by_model_labels)
    written = plots.write_plots(tmp_path, [{"loss": 1.0}], RefusesToRun(), ds, embedded=(emb, labels))
    assert {p.name for p in written} == {plots.LEARNING_CURVES, plots.RETRIEVAL_GRID, plots.EMBEDDING_MAP}
    assert_real_png(tmp_path / plots.EMBEDDING_MAP, 300, 200)


def test_a_failing_plot_skips_only_itself(tmp_path, toy, monkeypatch, caplog):
    _, _, ds = toy

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(plots, "plot_proxy_similarity", broken)
    written = plots.write_plots(tmp_path, [{"loss": 1.0}], nn.Sequential(nn.Flatten(), nn.Linear(1200, 4)), ds,
                                ProxyAnchorLoss(C, 4).proxies)
    assert {p.name for p in written} == {plots.LEARNING_CURVES, plots.RETRIEVAL_GRID, plots.EMBEDDING_MAP}
    assert "proxy_similarity.png failed" in caplog.text


def test_train_run_logs_the_dashboard(tmp_path):
    from pipelines.config import load_config
    from pipelines.tracking import LocalReporter
    from pipelines.train import run

    cfg = load_config("digits", ["loss.name=proxy_isa", "loss.memory_start_epoch=0", "train.epochs=2",
                                 "train.max_steps_per_epoch=3", "scaling.num_workers=1", "model.width=8"])
    tracker = RecordingTracker(tmp_path / "art")
    run(cfg, LocalReporter(tmp_path / "ckpt"), tracker)
    plot_dirs = [d for d, path in tracker.logged if path == "plots"]
    assert len(plot_dirs) == 1
    assert {p.name for p in plot_dirs[0].iterdir()} == {*plots.PLOT_FILES, plots.PROXY_SIMILARITY_DATA}
    for name in plots.PLOT_FILES:
        assert_real_png(plot_dirs[0] / name, 300, 200)
