"""Dashboard plots of one training run, written as PNG files (MLflow artifacts under ``plots/``).

Pure functions of tensors and metric histories: torch, numpy and matplotlib only (no MLflow,
no Ray). Figures are built with ``matplotlib.figure.Figure`` and rendered by Agg, never
through ``pyplot``: no global backend switch, no figure registry to leak, safe in a worker
thread. ``write_dashboard`` is what the train loop calls on rank 0 after the last epoch.

Files (``PLOT_FILES``):

- ``learning_curves.png``  loss, R@1 and MAP@R per epoch
- ``retrieval_grid.png``   queries from the unseen classes with their top-k neighbours
                           (green border: same class, red: another class)
- ``proxy_similarity.png`` cosine similarity between the L2-normalised proxies
- ``embedding_map.png``    PCA of the L2-normalised embeddings of the unseen classes
- ``isa_state.png``        Proxy-ISA effective number and learned similarity per class and
                           epoch (Proxy-ISA runs only)
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from pipelines.data import class_names
from pipelines.evaluate import embed
from pipelines.tracking import NullTracker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from pipelines.tracking import Tracker

log = logging.getLogger(__name__)

LEARNING_CURVES = "learning_curves.png"
RETRIEVAL_GRID = "retrieval_grid.png"
PROXY_SIMILARITY = "proxy_similarity.png"
EMBEDDING_MAP = "embedding_map.png"
ISA_STATE = "isa_state.png"
PROXY_SIMILARITY_DATA = "proxy_similarity.npz"  # the matrix and class indices behind the heatmap
PLOT_FILES = (LEARNING_CURVES, RETRIEVAL_GRID, PROXY_SIMILARITY, EMBEDDING_MAP, ISA_STATE)

# The three curves every run shows; the keys are the train loop's MLflow metric keys.
CURVE_KEYS: tuple[tuple[str, str], ...] = (("loss", "training loss"), ("recall_at_1", "Recall@1"),
                                           ("map_at_r", "MAP@R"))
# The per-class buffers of Proxy-ISA (proxies/proxy_isa.py) a snapshot keeps.
ISA_BUFFERS = ("count", "effective_num", "learned_sim")

_DPI = 100
_RIGHT, _WRONG, _QUERY = (44, 160, 44), (214, 39, 40), (31, 119, 180)  # green, red, blue (RGB)


# ---------------------------------------------------------------- helpers -------------------


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=_DPI, facecolor="white")
    return path


def _normalise_rows(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x.detach().float().cpu(), dim=1)


def _spread(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (all of them when k >= n)."""
    if k >= n:
        return list(range(n))
    return sorted({int(round(i)) for i in np.linspace(0, n - 1, k)})


def _to_rgb_tile(image: Tensor, tile: int) -> np.ndarray:
    """(C, H, W) float image -> (tile, tile, 3) uint8, clamped to [0, 1] for display."""
    img = image.detach().float().cpu()
    if img.ndim == 2:
        img = img.unsqueeze(0)
    img = img[:3] if img.shape[0] >= 3 else img[:1].expand(3, -1, -1)
    # Nearest keeps 8x8 digits crisp; bilinear would blur them into grey blobs.
    mode = "nearest" if max(img.shape[1:]) < tile else "bilinear"
    kwargs = {} if mode == "nearest" else {"align_corners": False, "antialias": True}
    img = torch.nn.functional.interpolate(img.unsqueeze(0), size=(tile, tile), mode=mode, **kwargs)[0]
    return (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


# ---------------------------------------------------------------- learning curves -----------


def plot_metric_comparison(
    series: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    path: str | Path,
    keys: Sequence[tuple[str, str]] = CURVE_KEYS,
    title: str = "",
) -> Path:
    """One panel per metric key, one line per run.

    ``series[run_name][metric_key]`` is a list of ``(step, value)``; a key a run did not log
    is left out of that panel ("not logged" when no run has it). Returns ``path``.
    """
    from matplotlib.ticker import MaxNLocator

    fig = _figure(4.2 * len(keys), 3.6)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, (key, label) in zip(axes, keys):
        drawn = 0
        for run_name, metrics in series.items():
            points = sorted(metrics.get(key, ()))
            if not points:
                continue
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", markersize=4, linewidth=1.8, label=run_name or None)
            drawn += 1
        ax.set_title(label)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif key != "loss":
            ax.set_ylim(bottom=0.0)
    if any(name for name in series) and len(series) > 1:
        handles, labels = axes[0].get_legend_handles_labels()
        for ax in axes[1:]:
            if len(ax.get_legend_handles_labels()[0]) > len(handles):
                handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)), fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_learning_curves(history: Sequence[Mapping[str, float]], path: str | Path) -> Path:
    """Loss, Recall@1 and MAP@R per epoch of one run.

    ``history``: one dict per epoch as the train loop records it (``epoch``, ``loss``,
    ``recall_at_1``, ``map_at_r``, ...); a missing ``epoch`` counts from 1.
    """
    curves: dict[str, list[tuple[float, float]]] = {}
    for i, row in enumerate(history):
        epoch = float(row.get("epoch", i + 1))
        for key, _ in CURVE_KEYS:
            if key in row:
                curves.setdefault(key, []).append((epoch, float(row[key])))
    return plot_metric_comparison({"": curves}, path, title="learning curves (unseen-class retrieval)")


# ---------------------------------------------------------------- retrieval grid ------------


def nearest_neighbours(embeddings: Tensor, queries: Tensor, k: int) -> Tensor:
    """Top-``k`` cosine neighbours of each query among all other rows.

    ``embeddings`` (N, d), ``queries`` (Q,) long row indices -> (Q, k) long row indices
    (k is cut to N - 1); the query itself is never its own neighbour.
    """
    x = _normalise_rows(embeddings)
    sims = x[queries] @ x.T  # (Q, N)
    sims[torch.arange(len(queries)), queries] = -float("inf")
    return sims.topk(min(k, len(x) - 1), dim=1).indices


def choose_queries(labels: Tensor, num_queries: int, seed: int = 0) -> Tensor:
    """One query from each of up to ``num_queries`` classes, spread over the label range.

    ``labels`` (N,) -> (Q,) long row indices. Classes with at least two items come first (a
    query with no positive in the gallery can only show red).
    """
    labels = labels.cpu()
    classes, counts = labels.unique(return_counts=True)
    usable = classes[counts >= 2]
    pool = usable if len(usable) else classes
    picked = pool[_spread(len(pool), num_queries)]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for c in picked.tolist():
        members = (labels == c).nonzero().flatten()
        rows.append(int(members[torch.randint(len(members), (1,), generator=gen)]))
    return torch.tensor(rows, dtype=torch.long)


def _class_label(label: int, names: Sequence[str] | None, width: int = 22) -> str:
    """``names[label]`` shortened to ``width`` characters, or "class <label>"."""
    if names is None or not 0 <= label < len(names):
        return f"class {label}"
    name = names[label]
    return name if len(name) <= width else name[: width - 1] + "…"


def plot_retrieval_grid(
    embeddings: Tensor,
    labels: Tensor,
    image_at: Callable[[int], Tensor],
    path: str | Path,
    num_queries: int = 8,
    k: int = 5,
    tile: int = 72,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> Path:
    """Rows: a query from an unseen class, then its top-``k`` neighbours by cosine similarity.

    ``embeddings`` (N, d) and ``labels`` (N,) are aligned with ``image_at(i)`` -> image
    (C, H, W) float in [0, 1] (clamped for display; 1 channel shown as grey). Borders: blue
    the query, green a neighbour of the same class, red one of another class. Rows are
    labelled ``names[label]`` when given (the data set's class names), else "class <label>".
    """
    labels = labels.cpu()
    queries = choose_queries(labels, num_queries, seed)
    neighbours = nearest_neighbours(embeddings, queries, k)
    k = neighbours.shape[1]
    border, gap = max(3, tile // 16), max(4, tile // 10)
    cell = tile + 2 * border
    # Width: k + 1 cells with gaps, plus one extra gap that sets the query column apart.
    canvas = np.full((len(queries) * (cell + gap) - gap, (k + 1) * (cell + gap), 3), 255, np.uint8)

    def put(row: int, col: int, index: int, colour: tuple[int, int, int]) -> None:
        y = row * (cell + gap)
        x = col * (cell + gap) + (gap if col else 0)  # a wider gap after the query column
        canvas[y : y + cell, x : x + cell] = colour
        canvas[y + border : y + border + tile, x + border : x + border + tile] = _to_rgb_tile(image_at(index), tile)

    right = 0
    for r, (q, nn_rows) in enumerate(zip(queries.tolist(), neighbours.tolist())):
        put(r, 0, q, _QUERY)
        for c, j in enumerate(nn_rows, start=1):
            ok = int(labels[j]) == int(labels[q])
            right += ok
            put(r, c, j, _RIGHT if ok else _WRONG)

    scale = 1.25  # inches per tile column: keeps tiles near their pixel size at 100 dpi
    fig = _figure(scale * (k + 1) + 1.2, scale * len(queries) * cell / (cell + gap) + 1.0)
    ax = fig.add_subplot()
    ax.imshow(canvas, interpolation="nearest")
    centres = [c * (cell + gap) + (gap if c else 0) + cell / 2 for c in range(k + 1)]
    ax.set_xticks(centres, ["query", *[f"#{i}" for i in range(1, k + 1)]])
    ax.set_yticks([r * (cell + gap) + cell / 2 for r in range(len(queries))],
                  [_class_label(int(labels[q]), names) for q in queries.tolist()])
    ax.tick_params(length=0)
    ax.xaxis.tick_top()
    for spine in ax.spines.values():
        spine.set_visible(False)
    total = max(1, len(queries) * k)
    ax.set_title(f"retrieval on unseen classes: {right}/{total} neighbours correct "
                 "(green = same class, red = other class)", fontsize="medium", pad=8)
    return _save(fig, path)


# ---------------------------------------------------------------- proxies & embeddings ------


def proxy_similarity(proxies: Tensor) -> Tensor:
    """Cosine similarity of L2-normalised proxies: (C, d) -> (C, C) in [-1, 1]."""
    p = _normalise_rows(proxies)
    return (p @ p.T).clamp(-1.0, 1.0)


def plot_proxy_similarity(proxies: Tensor, path: str | Path, max_classes: int = 100) -> Path:
    """Heatmap of the proxy-to-proxy cosine similarity (Proxy Synthesis, Fig. 4), and the
    shown matrix, its class indices and the title in :data:`PROXY_SIMILARITY_DATA` beside it.

    ``proxies`` (C, d), every class of the bank; with more than ``max_classes`` classes an evenly spaced subset is
    shown (a 10k x 10k heatmap is unreadable and slow). The title gives the mean and max
    off-diagonal similarity over *all* classes: proxies that collapse show up there.
    """
    sim = proxy_similarity(proxies)
    c = sim.shape[0]
    off = sim[~torch.eye(c, dtype=torch.bool)] if c > 1 else sim.flatten()
    shown = torch.tensor(_spread(c, max_classes), dtype=torch.long)
    sub = "" if len(shown) == c else f" ({len(shown)} shown)"
    title = f"proxy similarity of {c} classes{sub}\noff-diagonal mean {float(off.mean()):.3f}, max {float(off.max()):.3f}"
    # The numbers behind the picture, beside it: runs (W = 1 and W = 2, say) compare exactly.
    np.savez_compressed(Path(path).with_name(PROXY_SIMILARITY_DATA), classes=shown.numpy(), num_classes=c,
                        similarity=sim[shown][:, shown].numpy(), title=title)
    fig = _figure(6.4, 5.4)
    ax = fig.add_subplot()
    im = ax.imshow(sim[shown][:, shown].numpy(), cmap="coolwarm", vmin=-1.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, shrink=0.85, label="cosine similarity")
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("class")
    ax.set_ylabel("class")
    if len(shown) <= 20:
        ticks = list(range(len(shown)))
        ax.set_xticks(ticks, [str(int(i)) for i in shown])
        ax.set_yticks(ticks, [str(int(i)) for i in shown])
    return _save(fig, path)


def pca_2d(embeddings: Tensor) -> Tensor:
    """Exact PCA of the L2-normalised rows: (N, d) -> (N, 2) coordinates.

    A full SVD of the centred (N, d) matrix: deterministic (``pca_lowrank`` draws from the
    global RNG) and cheap for the few thousand rows a plot shows.
    """
    x = _normalise_rows(embeddings).double()
    x = x - x.mean(dim=0, keepdim=True)
    if x.shape[0] < 2:
        return torch.zeros(x.shape[0], 2)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    coords = x @ vh[:2].T
    if coords.shape[1] < 2:  # d == 1
        coords = torch.cat([coords, torch.zeros_like(coords)], dim=1)
    return coords.float()


def plot_embedding_map(
    embeddings: Tensor, labels: Tensor, path: str | Path, max_classes: int = 20, max_points: int = 4000,
    seed: int = 0,
) -> Path:
    """2-D PCA map of the unseen-class embeddings, coloured by class.

    ``embeddings`` (N, d), ``labels`` (N,). Up to ``max_classes`` classes (evenly spaced over
    the sorted labels) get a colour; the others are drawn as light grey context. At most
    ``max_points`` rows (a seeded random subset) are drawn.
    """
    labels = labels.cpu()
    if len(labels) > max_points:
        keep = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:max_points]
        embeddings, labels = embeddings[keep], labels[keep]
    xy = pca_2d(embeddings).numpy()
    classes = labels.unique()
    coloured = classes[_spread(len(classes), max_classes)]
    fig = _figure(6.8, 5.6)
    ax = fig.add_subplot()
    grey = ~torch.isin(labels, coloured)
    if grey.any():
        ax.scatter(xy[grey.numpy(), 0], xy[grey.numpy(), 1], s=6, c="#cccccc", linewidths=0, label="other classes")
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(coloured) <= 10 else "tab20"]
    for i, c in enumerate(coloured.tolist()):
        m = (labels == c).numpy()
        ax.scatter(xy[m, 0], xy[m, 1], s=16, color=cmap(i % cmap.N), linewidths=0, alpha=0.85, label=f"class {c}")
    ax.set_title(f"embeddings of unseen classes (PCA, {len(labels)} items, {len(classes)} classes)",
                 fontsize="medium")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.grid(True, alpha=0.3)
    if len(coloured) <= 20:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="x-small", markerscale=1.5, frameon=False)
    return _save(fig, path)


# ---------------------------------------------------------------- Proxy-ISA state -----------


def find_isa_module(loss_fn: nn.Module) -> nn.Module | None:
    """The Proxy-ISA module inside ``loss_fn`` (itself, or the base of a Proxy Synthesis
    wrapper): the first module with an ``effective_num`` buffer; None for other losses."""
    for m in loss_fn.modules():
        if isinstance(getattr(m, "effective_num", None), Tensor) and isinstance(getattr(m, "learned_sim", None), Tensor):
            return m
    return None


def isa_snapshot(loss_fn: nn.Module, epoch: int) -> dict[str, Any] | None:
    """CPU copy of the per-class Proxy-ISA state after ``epoch`` (1-based), or None.

    ``{"epoch": int, "count", "effective_num", "learned_sim", "s_out": (C,) float32}``;
    ``s_out`` (the outlier boundary) only when the module exposes ``class_params()``.
    """
    m = find_isa_module(loss_fn)
    if m is None:
        return None
    snap: dict[str, Any] = {"epoch": int(epoch)}
    for name in ISA_BUFFERS:
        if isinstance(getattr(m, name, None), Tensor):
            snap[name] = getattr(m, name).detach().float().cpu().clone()
    class_params = getattr(m, "class_params", None)
    if callable(class_params):
        with torch.no_grad():
            snap["s_out"] = class_params().s_out.detach().float().cpu().clone()
    return snap


def plot_isa_state(states: Sequence[Mapping[str, Any]], path: str | Path, max_classes: int = 128) -> Path:
    """Proxy-ISA state over epochs: per-class heatmaps and the spread across classes.

    ``states``: one snapshot per epoch (:func:`isa_snapshot`), each with ``effective_num``
    and ``learned_sim`` of shape (C,). Top: heatmaps class x epoch (at most ``max_classes``
    evenly spaced classes). Bottom: median and 10-90 % band across all classes of the
    effective number, and of the learned similarity with the outlier boundary ``s_out``.
    """
    if not states:
        raise ValueError("plot_isa_state needs at least one snapshot")
    epochs = [int(s.get("epoch", i + 1)) for i, s in enumerate(states)]
    eff = torch.stack([torch.as_tensor(s["effective_num"]).float() for s in states], dim=1)  # (C, E)
    sim = torch.stack([torch.as_tensor(s["learned_sim"]).float() for s in states], dim=1)
    c = eff.shape[0]
    shown = torch.tensor(_spread(c, max_classes), dtype=torch.long)
    fig = _figure(11.0, 7.6)
    axes = fig.subplots(2, 2)
    extent = (epochs[0] - 0.5, epochs[-1] + 0.5, float(shown[-1]) + 0.5, -0.5)
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    # S_learned starts at exactly 1.0 (proxies/proxy_isa.py) and drops to h * mean similarity
    # (< h) once learned: masking the initial value keeps the colour scale on learned values.
    unlearned = sim == 1.0
    sim_shown = sim.masked_fill(unlearned, float("nan"))
    for ax, data, title, cmap in ((axes[0, 0], eff, "effective number $E_c$", "viridis"),
                                  (axes[0, 1], sim_shown, "learned similarity $S_{learned}(c)$", "magma")):
        colours = matplotlib.colormaps[cmap].with_extremes(bad="#dddddd")
        im = ax.imshow(data[shown].numpy(), aspect="auto", cmap=colours, interpolation="nearest", extent=extent)
        fig.colorbar(im, ax=ax)
        ax.set_title(title + ("" if len(shown) == c else f" ({len(shown)} of {c} classes)"), fontsize="medium")
        ax.set_xlabel("epoch")
        ax.set_ylabel("class")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if bool(unlearned.any()):
        axes[0, 1].set_xlabel("epoch (grey: not learned yet, initial 1.0)")

    def band(ax: Any, data: Tensor, label: str, colour: str) -> None:
        q = torch.quantile(data, torch.tensor([0.1, 0.5, 0.9]), dim=0).numpy()  # (3, E)
        ax.fill_between(epochs, q[0], q[2], color=colour, alpha=0.2, linewidth=0)
        ax.plot(epochs, q[1], marker="o", markersize=4, color=colour, label=f"{label} (median, 10-90 %)")

    band(axes[1, 0], eff, "$E_c$", "tab:green")
    axes[1, 0].set_title("effective number across classes", fontsize="medium")
    band(axes[1, 1], sim, "$S_{learned}$", "tab:purple")
    if all("s_out" in s for s in states):
        band(axes[1, 1], torch.stack([torch.as_tensor(s["s_out"]).float() for s in states], dim=1),
             "$S_{out}$ (outlier boundary)", "tab:orange")
    axes[1, 1].set_title("learned threshold across classes", fontsize="medium")
    for ax in axes[1]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Proxy-ISA state per class")
    return _save(fig, path)


# ---------------------------------------------------------------- the dashboard -------------


def dashboard_rows(labels: Sequence[int], max_items: int) -> list[int]:
    """Dataset rows for the plots: whole classes (evenly spaced) until ``max_items``.

    Whole classes, not random items, so every shown query keeps all its positives (SOP has
    ~5 images per class: a random 5 % would leave most queries without any).
    """
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_class.setdefault(int(y), []).append(i)
    if len(labels) <= max_items:
        return list(range(len(labels)))
    classes = sorted(by_class)
    rows: list[int] = []
    avg = max(1, len(labels) // max(1, len(classes)))
    for ci in _spread(len(classes), max(2, max_items // avg)):
        members = by_class[classes[ci]]
        if rows and len(rows) + len(members) > max_items:
            break
        rows.extend(members)
    return rows


def _embed_for_plots(
    model: nn.Module | None, dataset: Dataset | None, device: torch.device | str, batch_size: int, max_items: int,
    embedded: tuple[Tensor, Tensor] | None = None,
) -> tuple[list[int], Tensor, Tensor] | None:
    """(dataset rows, embeddings (N, d), labels (N,)) for the retrieval grid and the map.

    ``embedded``: the whole dataset's embeddings (len, d) and labels (len,), in order, when the
    caller has them (the train loop's last evaluation); the rows are taken from them.
    """
    if dataset is None or len(dataset) < 2:  # type: ignore[arg-type]
        return None
    if embedded is not None:
        emb, labels = embedded
        rows = dashboard_rows(labels.tolist(), max_items)
        return rows, emb[rows], labels[rows]
    if model is None:
        return None
    try:
        targets = getattr(dataset, "targets", None)
        all_labels = list(targets) if targets is not None else [int(dataset[i][1]) for i in range(len(dataset))]  # type: ignore[arg-type]
        rows = dashboard_rows(all_labels, max_items)
        emb, labels = embed(model, Subset(dataset, rows), batch_size, device)
    except Exception:  # noqa: BLE001 - same policy as the plots themselves
        log.warning("dashboard: embedding the evaluation set failed", exc_info=True)
        return None
    return rows, emb, labels


def write_plots(
    folder: str | Path,
    history: Sequence[Mapping[str, float]],
    model: nn.Module | None = None,
    dataset: Dataset | None = None,
    proxies: Tensor | None = None,
    isa_states: Sequence[Mapping[str, Any]] = (),
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    max_items: int = 4000,
    embedded: tuple[Tensor, Tensor] | None = None,
) -> list[Path]:
    """Write every plot the inputs allow into ``folder``; returns the files written.

    ``embedded``: ``dataset``'s embeddings (len, d) and labels (len,) in order, if already
    computed; otherwise ``model`` embeds the plotted rows. ``proxies``: the whole proxy bank
    (C, d) and ``isa_states`` snapshots of every class, whatever the number of workers (the
    train loop gathers the shards).

    Each plot is independent: one that fails is logged and skipped, so a plotting bug never
    costs a finished training run its other plots (tests call each plot function directly).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[str, Callable[[], Path]]] = []
    if history:
        jobs.append((LEARNING_CURVES, lambda: plot_learning_curves(history, folder / LEARNING_CURVES)))
    picked = _embed_for_plots(model, dataset, device, batch_size, max_items, embedded)
    if picked is not None:
        rows, emb, labels = picked
        assert dataset is not None
        jobs.append((RETRIEVAL_GRID, lambda: plot_retrieval_grid(
            emb, labels, lambda i: dataset[rows[i]][0], folder / RETRIEVAL_GRID, names=class_names(dataset))))
        jobs.append((EMBEDDING_MAP, lambda: plot_embedding_map(emb, labels, folder / EMBEDDING_MAP)))
    if proxies is not None:
        jobs.append((PROXY_SIMILARITY, lambda: plot_proxy_similarity(proxies, folder / PROXY_SIMILARITY)))
    if isa_states:
        jobs.append((ISA_STATE, lambda: plot_isa_state(isa_states, folder / ISA_STATE)))
    written = []
    for name, job in jobs:
        try:
            written.append(job())
        except Exception:  # noqa: BLE001 - see the docstring: a plot never fails the run
            log.warning("dashboard plot %s failed", name, exc_info=True)
    return written


def write_dashboard(
    tracker: Tracker,
    history: Sequence[Mapping[str, float]],
    model: nn.Module,
    dataset: Dataset,
    proxies: Tensor | None,
    isa_states: Sequence[Mapping[str, Any]] = (),
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    embedded: tuple[Tensor, Tensor] | None = None,
) -> list[str]:
    """Render the run's plots into a temporary folder and log them under ``plots/``.

    Called by the train loop on rank 0 after the last epoch. ``history``: per-epoch metric
    dicts; ``model``: the (unwrapped) embedding model; ``dataset``: the evaluation set
    (unseen classes); ``proxies``: the whole proxy bank (C, d), gathered from every shard;
    ``isa_states``: per-epoch :func:`isa_snapshot` dicts of every class (Proxy-ISA only); ``embedded``: ``dataset``'s
    embeddings and labels from the last evaluation (see :func:`write_plots`). Skipped (nothing
    rendered) when the tracker is the NullTracker: nobody would see the files. Returns the file
    names logged.
    """
    if isinstance(tracker, NullTracker):
        return []
    with tempfile.TemporaryDirectory(prefix="proxydml-plots-") as tmp:
        written = write_plots(tmp, history, model, dataset, proxies, isa_states, device, batch_size,
                              embedded=embedded)
        if written:
            tracker.log_artifacts(Path(tmp), "plots")
        return [p.name for p in written]
