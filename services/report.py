"""``proxydml report RUN_ID|EXPERIMENT ...``: one self-contained HTML page comparing runs.

The page holds: the runs (name, id, status, loss, dataset), the final value of every metric
(best retrieval value per row in bold), for a sweep's parent run what the sweep searched and
found (services/sweep_page.py), the params whose values differ between the runs (all params in
a collapsed section), overlaid learning curves of all runs, and each run's dashboard plots
(``plots/*.png``, see pipelines/plots.py) embedded as base64 data URIs: the file opens
anywhere, offline, with no server.

Where it goes: the file ``--out`` (default ``report.html``), and, unless ``--no-log``, an
MLflow artifact ``report/report.html``:

- into every run named by id on the command line;
- for an experiment, into that experiment's *report run*: one run named ``report`` tagged
  ``proxydml.report=experiment``, created on first use and reused afterwards (so reports do
  not pile up as runs), never itself listed in a report. The MLflow UI shows the HTML
  artifact inline.

A login that may read but not log (the ``reader`` role of ``services/auth.py``) still gets the
file; the logging is skipped with one line saying which permission it lacks.
"""

from __future__ import annotations

import base64
import html
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipelines import plots
from pipelines.evaluate import CROSS_GROUP_PREFIX, DEFAULT_RECALL_KS, is_retrieval_metric, metric_names
from services import auth, sweep_page
from services.mlflow_tracking import resolve_tracking_uri
from services.uris import redact

REPORT_TAG = "proxydml.report"
REPORT_RUN_NAME = "report"
ARTIFACT_DIR = "report"
ARTIFACT_NAME = "report.html"
DEFAULT_MAX_RUNS = 20
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
# The metric keys shown first, in this order; the rest follow alphabetically.
_METRIC_ORDER = (*metric_names(DEFAULT_RECALL_KS, nmi=True), "loss")


class ReportError(RuntimeError):
    """A user-facing failure (unknown run or experiment, nothing to report)."""


@dataclass
class RunData:
    """What the report shows of one run."""

    run: Run
    histories: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    plots: dict[str, bytes] = field(default_factory=dict)  # file name -> PNG bytes

    @property
    def name(self) -> str:
        return self.run.info.run_name or self.run.info.run_id

    @property
    def run_id(self) -> str:
        return self.run.info.run_id


@dataclass
class Report:
    """The rendered page and where it was logged."""

    html: str
    path: Path
    runs: list[RunData]
    logged_to: list[str]  # run ids that received report/report.html
    not_logged: str = ""  # why logging was skipped (the login may only read), else empty


# ---------------------------------------------------------------- collecting ----------------


def _is_report_run(run: Run) -> bool:
    return REPORT_TAG in run.data.tags


def resolve_targets(client: MlflowClient, targets: Sequence[str], max_runs: int = DEFAULT_MAX_RUNS
                    ) -> tuple[list[Run], list[str], list[str]]:
    """Targets -> (runs to show, run ids named directly, experiment ids named).

    A target is a run id (32 hex digits), an experiment name or an experiment id. An
    experiment contributes its ``max_runs`` most recent runs (report runs excluded).
    """
    runs: dict[str, Run] = {}
    direct: list[str] = []
    experiments: list[str] = []
    for target in targets:
        if _RUN_ID.match(target):
            try:
                run = client.get_run(target)
            except MlflowException:
                run = None
            if run is not None:
                runs.setdefault(run.info.run_id, run)
                direct.append(run.info.run_id)
                continue
        exp = client.get_experiment_by_name(target)
        if exp is None and target.isdigit():
            try:
                exp = client.get_experiment(target)
            except MlflowException:
                exp = None
        if exp is None:
            raise ReportError(f"{target!r} is neither a run id nor an experiment name or id")
        experiments.append(exp.experiment_id)
        found = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"],
                                   max_results=max_runs + 10)
        found = [r for r in found if not _is_report_run(r)][:max_runs]
        if not found:
            raise ReportError(f"experiment {exp.name!r} has no runs to report")
        for r in reversed(found):  # oldest first: the table reads in training order
            runs.setdefault(r.info.run_id, r)
    return list(runs.values()), direct, experiments


def collect(client: MlflowClient, run: Run, curve_keys: Iterable[str]) -> RunData:
    """Metric histories of ``curve_keys`` and the ``plots/*.png`` artifacts of ``run``."""
    data = RunData(run)
    for key in curve_keys:
        if key in run.data.metrics:
            data.histories[key] = [(float(m.step), float(m.value))
                                   for m in client.get_metric_history(run.info.run_id, key)]
    try:
        listed = client.list_artifacts(run.info.run_id, "plots")
    except (MlflowException, OSError):  # no artifact store reachable: a report without images
        listed = []
    if any(not a.is_dir and a.path.endswith(".png") for a in listed):
        with tempfile.TemporaryDirectory(prefix="proxydml-report-") as tmp:
            local = Path(client.download_artifacts(run.info.run_id, "plots", tmp))  # one call per run
            for png in sorted(local.glob("*.png")):
                data.plots[png.name] = png.read_bytes()
    return data


# ---------------------------------------------------------------- rendering -----------------


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}"


SYSTEM_PREFIX = "system/"  # MLflow's system metrics (CPU, memory, disk, network)


def metric_groups(runs: Sequence[RunData]) -> tuple[list[str], list[str]]:
    """(the table's keys, the system metrics' keys): the retrieval metrics lead, in the
    evaluation's order, then any other retrieval metric (``xgroup_recall_at_1``), then the loss,
    then the other training metrics; ``system/*`` go to a section of their own."""
    keys = {k for r in runs for k in r.run.data.metrics}
    system = sorted(k for k in keys if k.startswith(SYSTEM_PREFIX))
    rest = keys - set(system)
    first = [k for k in _METRIC_ORDER if k in rest and k != "loss"]
    first += sorted(k for k in rest - set(first) if is_retrieval_metric(k.removeprefix(CROSS_GROUP_PREFIX), nmi=True))
    first += ["loss"] if "loss" in rest else []
    return first + sorted(rest - set(first)), system


def _metric_table(runs: Sequence[RunData], keys: Sequence[str], names: Sequence[str]) -> str:
    rows = []
    for key in keys:
        values = [r.run.data.metrics.get(key) for r in runs]
        best = None
        present = [v for v in values if v is not None and math.isfinite(v)]
        # Retrieval metrics: the highest value is the best (bold); other rows are neutral.
        if len(runs) > 1 and present and is_retrieval_metric(key, nmi=True):
            best = max(present)
        cells = [f"<code>{html.escape(key)}</code>"]
        for v in values:
            text = html.escape(_fmt(v))
            cells.append(f'<b>{text}</b>' if best is not None and v == best else text)
        rows.append(cells)
    return _table(["metric", *names], rows, "metrics", numeric_from=1)


def differing_params(runs: Sequence[RunData]) -> list[str]:
    """Param keys whose value is not the same in every run (missing counts as a value)."""
    keys = sorted({k for r in runs for k in r.run.data.params})
    if len(runs) < 2:
        return []
    return [k for k in keys if len({r.run.data.params.get(k) for r in runs}) > 1]


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _img(png: bytes, alt: str) -> str:
    return f'<img src="{_data_uri(png)}" alt="{html.escape(alt)}" onclick="this.parentNode.classList.toggle(\'big\')">'


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "", numeric_from: int | None = None
           ) -> str:
    """An HTML table; cells are HTML already (escape before calling). Columns from
    ``numeric_from`` on are right-aligned numbers."""
    head = "".join(f"<th>{h}</th>" for h in header)

    def td(i: int, c: str) -> str:
        return f'<td class="num">{c}</td>' if numeric_from is not None and i >= numeric_from else f"<td>{c}</td>"

    body = "".join("<tr>" + "".join(td(i, c) for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d2330;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #dde}
h3{font-size:16px;margin:18px 0 6px} .meta{color:#667;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #d5d9e2;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
td b{color:#0b6b2b} code{font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
figure{margin:0;border:1px solid #e3e6ee;padding:6px;background:#fafbfd}
figure img{display:block;height:auto;max-width:100%}
.plots figure{box-sizing:border-box;flex:0 1 calc(50% - 6px);max-width:640px}
.plots figure img{width:100%;cursor:zoom-in}
.plots figure.big{flex-basis:100%;max-width:none}
.plots figure.big img{width:auto;cursor:zoom-out}
figcaption{font-size:12px;color:#556;margin-top:4px}
details{margin:8px 0}
.bar{display:inline-block;height:10px;background:#3b6fd8}
"""

_PLOT_TITLES = {
    plots.LEARNING_CURVES: "learning curves",
    plots.RETRIEVAL_GRID: "retrieval on unseen classes",
    plots.PROXY_SIMILARITY: "proxy similarity",
    plots.EMBEDDING_MAP: "embedding map (PCA)",
    plots.ISA_STATE: "Proxy-ISA state",
}


def render_html(runs: Sequence[RunData], title: str, tracking_uri: str, comparison_png: bytes | None,
                sweeps: Sequence[sweep_page.Sweep] = ()) -> str:
    """The report page for ``runs`` (every string escaped; images as data URIs), with a section
    for each sweep parent run among them."""
    esc = html.escape
    names = [esc(r.name) for r in runs]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ProxyDML report: {esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>ProxyDML report: {esc(title)}</h1>",
        f'<p class="meta">{len(runs)} run(s) &middot; generated {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}'
        f" &middot; tracking <code>{esc(redact(tracking_uri))}</code></p>",
    ]

    parts.append("<h2>Runs</h2>")
    rows = []
    for r in runs:
        info, tags = r.run.info, r.run.data.tags
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.start_time / 1000)) if info.start_time else ""
        rows.append([_run_link(r, tracking_uri), f"<code>{esc(r.run_id)}</code>",
                     esc(info.status or ""), esc(tags.get("loss", "")), esc(tags.get("dataset", "")), esc(started)])
    parts.append(_table(["run", "run id", "status", "loss", "dataset", "started"], rows, "runs"))

    parts.append("<h2>Final metrics</h2>")
    keys, system = metric_groups(runs)
    if keys:
        parts.append(_metric_table(runs, keys, names))
    else:
        parts.append("<p>No metrics logged.</p>")
    if system:
        parts.append(f'<details class="system"><summary>System metrics ({len(system)})</summary>'
                     f"{_metric_table(runs, system, names)}</details>")

    for sweep in sweeps:
        parts.append(sweep_page.render_section(sweep, _table, _img))

    diff = differing_params(runs)
    if len(runs) > 1:
        parts.append("<h2>Parameters that differ</h2>")
        if diff:
            rows = [[f"<code>{esc(k)}</code>", *[esc(r.run.data.params.get(k, "—")) for r in runs]] for k in diff]
            parts.append(_table(["param", *names], rows, "params"))
        else:
            parts.append("<p>All parameters are equal.</p>")
    all_keys = sorted({k for r in runs for k in r.run.data.params})
    if all_keys:
        rows = [[f"<code>{esc(k)}</code>", *[esc(r.run.data.params.get(k, "—")) for r in runs]] for k in all_keys]
        parts.append(f"<details><summary>All parameters ({len(all_keys)})</summary>"
                     f"{_table(['param', *names], rows, 'params')}</details>")

    if comparison_png is not None:
        parts.append("<h2>Learning curves</h2>")
        parts.append(f'<figure>{_img(comparison_png, "learning curves of all runs")}'
                     "<figcaption>per-epoch training loss and unseen-class retrieval of every run"
                     "</figcaption></figure>")

    parts.append("<h2>Plots</h2>")
    parts.append(_plots_section(runs))
    parts.append("</body></html>")
    return "\n".join(parts)


def _plots_section(runs: Sequence[RunData]) -> str:
    """One row per kind of plot, the runs side by side (click an image: full size and back)."""
    esc = html.escape
    names = {n for r in runs for n in r.plots}
    ordered = [n for n in plots.PLOT_FILES if n in names] + sorted(names - set(plots.PLOT_FILES))
    if not ordered:
        return "<p>No plots logged (plots/ artifacts) for these runs.</p>"
    out = []
    for n in ordered:
        out.append(f'<h3>{esc(_PLOT_TITLES.get(n, n))} <code>plots/{esc(n)}</code></h3><div class="plots">')
        for r in runs:
            if n in r.plots:
                body = _img(r.plots[n], f"{r.name}: {n}")
            else:
                body = '<p class="meta">not logged</p>'
            out.append(f'<figure id="{esc(n.removesuffix(".png"))}-{esc(r.run_id)}">{body}'
                       f"<figcaption>{esc(r.name)}</figcaption></figure>")
        out.append("</div>")
    return "\n".join(out)


def _run_link(r: RunData, tracking_uri: str) -> str:
    """The run name, linked to its MLflow UI page when the store is an MLflow server."""
    name = html.escape(r.name)
    if not tracking_uri.startswith(("http://", "https://")):
        return name
    url = f"{tracking_uri.rstrip('/')}/#/experiments/{r.run.info.experiment_id}/runs/{r.run_id}"
    return f'<a href="{html.escape(url)}">{name}</a>'


# ---------------------------------------------------------------- logging ------------------


def report_run(client: MlflowClient, experiment_id: str) -> str:
    """The experiment's report run (created once, then reused)."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`{REPORT_TAG}` = 'experiment'", max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=REPORT_RUN_NAME,
                            tags={REPORT_TAG: "experiment",
                                  "mlflow.note.content": "HTML comparison of this experiment's runs "
                                                         "(proxydml report): artifact report/report.html"})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def log_report(client: MlflowClient, run_ids: Iterable[str], page: str) -> list[str]:
    """Log ``page`` as ``report/report.html`` into each run; returns the run ids."""
    done = []
    with tempfile.TemporaryDirectory(prefix="proxydml-report-") as tmp:
        path = Path(tmp) / ARTIFACT_NAME
        path.write_text(page, encoding="utf-8")
        for run_id in dict.fromkeys(run_ids):
            client.log_artifact(run_id, str(path), ARTIFACT_DIR)
            done.append(run_id)
    return done


# ---------------------------------------------------------------- entry point --------------


def build_report(
    targets: Sequence[str],
    out: str | Path = "report.html",
    tracking_uri: str | None = None,
    log: bool = True,
    max_runs: int = DEFAULT_MAX_RUNS,
) -> Report:
    """Collect the runs of ``targets``, write the HTML page to ``out`` and (``log``) log it.

    ``targets``: run ids and/or experiment names or ids. Raises ReportError for an unknown
    target or an experiment without runs.
    """
    if not targets:
        raise ReportError("name at least one run id or experiment")
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(uri)
    with auth.guard(uri, auth.Need("READ", "the named runs and experiments", "build the report", "--role reader")):
        runs, direct, experiments = resolve_targets(client, targets, max_runs)
        keys = [k for k, _ in plots.CURVE_KEYS]
        data = [collect(client, r, keys) for r in runs]
        try:
            sweeps = [sweep_page.collect_sweep(client, r) for r in runs if sweep_page.is_sweep_run(r)]
        except ValueError as exc:  # a sweep run whose space.* params or trial params were edited by hand
            raise ReportError(f"sweep run: {exc}") from exc

    comparison = None
    if any(d.histories for d in data):
        with tempfile.TemporaryDirectory(prefix="proxydml-report-") as tmp:
            png = plots.plot_metric_comparison({d.name: d.histories for d in data}, Path(tmp) / "curves.png",
                                               title="learning curves")
            comparison = png.read_bytes()

    if len(targets) == 1 and experiments:
        title = client.get_experiment(experiments[0]).name
    elif len(data) == 1:
        title = data[0].name
    else:
        title = ", ".join(d.name for d in data[:4]) + (" ..." if len(data) > 4 else "")
    page = render_html(data, title, uri, comparison, sweeps)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(page, encoding="utf-8")
    shutil.move(tmp_out, out)  # never a half-written report at ``out``

    logged: list[str] = []
    skipped = ""
    if log:
        try:
            with auth.guard(uri, auth.Need("EDIT", "the reported experiments", "log report/report.html to them",
                                           "--role trainer --experiment NAME")):
                destinations = list(direct) + [report_run(client, e) for e in experiments]
                logged = log_report(client, destinations, page)
        except auth.AuthError as exc:
            # The page is what was asked for and it is written; logging it is a side effect.
            skipped = str(exc)
            print(f"note: report not logged to MLflow: {skipped} (--no-log skips this step)", file=sys.stderr)
    return Report(page, out, data, logged, skipped)
