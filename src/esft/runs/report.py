"""`esft report RUN_DIR [RUN_DIR ...]`: one self-contained HTML page (PNG images inline, no external
reference) plus the same PNGs beside it, drawn with matplotlib's Agg canvas. Several runs overlay,
one colour each, labelled with their name and the settings that differ.

matplotlib is imported inside the functions that draw, so `import esft` stays light."""

from __future__ import annotations

import base64
import html
import io
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from esft.runs.report_data import (
    BUDGET_KINDS,
    ReportError,
    Run,
    differing_settings,
    held_out_keys,
    load_runs,
    run_labels,
    setting_of,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ReportError", "build_figures", "default_out", "report_after_training", "write_report"]

REPORT_FILE = "report.html"
SEVERAL_RUNS_FILE = "esft-report.html"
FAILURE_KEYS = ("reward/failures", "reward/errors", "reward/timeouts")
CAPTIONS = {
    "reward": "Training reward per iteration: population mean (line) and min–max over members (band).",
    "heldout": "Held-out metric per eval split, over iterations and over the training budget spent "
               "(each x label says whether the budget was recorded or derived).",
    "throughput": "Generated tokens per second and seconds per ES iteration.",
    "failures": "Reward values replaced by --failure-reward per iteration, one per (function, sample): "
                "failures = errors + timeouts.",
}


GRPO_CAPTIONS = {
    "reward": "Training reward per optimizer step: mean over the step's completions (line) and min–max over "
              "single completions (band).",
    "throughput": "Generated tokens per second and seconds per GRPO optimizer step.",
}
MIXED_CAPTIONS = {
    "reward": "Training reward. ES runs, per iteration: population mean (line) and min–max over members' mean "
              "rewards (band). GRPO runs, per optimizer step: mean over the step's completions (line only: their "
              "min–max is over single completions, not comparable with an ES band).",
    "throughput": "Generated tokens per second, and seconds per ES iteration or per GRPO optimizer step.",
}


def captions(runs: list[Run]) -> dict[str, str]:
    """Each figure's caption, in the terms of the runs' algorithms (ES iterations and members, GRPO steps)."""
    algorithms = {run.algorithm for run in runs}
    if algorithms == {"grpo"}:
        return CAPTIONS | GRPO_CAPTIONS
    return CAPTIONS | MIXED_CAPTIONS if "grpo" in algorithms else CAPTIONS


def default_out(run_dirs: list[str | Path]) -> Path:
    """Where the page goes without --out: <RUN_DIR>/report.html for one run, ./esft-report.html for several."""
    return Path(run_dirs[0]) / REPORT_FILE if len(run_dirs) == 1 else Path(SEVERAL_RUNS_FILE)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the HTML page (and `<stem>-<figure>.png` beside it) for `run_dirs`; returns its path.
    ReportError when a directory is not a run or `out` cannot be written."""
    runs = load_runs(list(run_dirs))
    out = Path(out) if out is not None else default_out(run_dirs)
    if out.is_dir() or not out.parent.is_dir():
        raise ReportError(f"--out {out}: " + ("is a directory; give a file name such as report.html" if out.is_dir()
                                              else f"directory {out.parent} does not exist"))
    figures = build_figures(runs)
    images = {name: _png(figure) for name, figure in figures.items()}
    try:
        for name, data in images.items():
            _write_bytes_atomic(out.with_name(f"{out.stem}-{name}.png"), data)
        _write_bytes_atomic(out, render_html(runs, images).encode("utf-8"))
    except OSError as error:
        raise ReportError(f"--out {out}: cannot write it ({error.strerror})") from None
    return out


def report_after_training(run_dir: Path | None) -> Path | None:
    """The report a finished (or interrupted) training writes into its run directory. Never raises:
    a report that cannot be written costs a one-line warning, not the run."""
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    try:
        return write_report([run_dir])
    except Exception as error:  # noqa: BLE001 - the training itself is done; keep its result
        print(f"esft: warning: no report written for {run_dir} ({_one_line(error)})", file=sys.stderr)
        return None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# --------------------------------------------------------------------------------------- figures
def build_figures(runs: list[Run]) -> dict[str, Figure]:
    """The report's matplotlib figures by name ('reward', 'heldout', 'throughput', 'failures'), each
    left out when no run logged its data. Every plotted artist's gid is '<run name>|<series>'."""
    labels = run_labels(runs, differing_settings(runs))
    colors = {run.name: f"C{index % 10}" for index, run in enumerate(runs)}
    figures = {}
    trained = [run for run in runs if run.iteration_rows]
    if trained:
        figures["reward"] = _reward_figure(trained, labels, colors)
    held_out = held_out_keys(runs)
    if held_out:
        figures["heldout"] = _held_out_figure(runs, held_out, labels, colors)
    if any(run.series("perf/tokens_per_s")[0] for run in trained):
        figures["throughput"] = _grid_figure(trained, ["perf/tokens_per_s", "perf/iteration_s"],
                                             ["tokens per second", "seconds per iteration (GRPO: per step)"
                                              if any(run.algorithm == "grpo" for run in runs) else
                                              "seconds per iteration"], labels, colors)
    failure_keys = [key for key in FAILURE_KEYS if any(run.series(key)[0] for run in trained)]
    if failure_keys:
        figures["failures"] = _grid_figure(trained, failure_keys, [key.split("/")[1] for key in failure_keys],
                                           labels, colors)
        _count_axes(figures["failures"])
    return figures


def _count_axes(figure: Figure) -> None:
    """Counts: whole-number ticks from 0 (all-zero counts would otherwise get a -0.04..0.04 axis)."""
    from matplotlib.ticker import MaxNLocator

    for axis in figure.axes:
        top = max(1, axis.get_ylim()[1])
        axis.set_ylim(-0.04 * top, top)  # a little room below 0: a line of zeros stays visible
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))


def _new_figure(columns: int, rows: int = 1) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(min(4.2 * columns, 16), 3.0 * rows + 0.8), dpi=100, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat:
        axis.grid(True, alpha=0.3)
    return figure, axes


def _finish(figure: Figure, labels: dict[str, str], runs: list[Run], colors: dict[str, str]) -> Figure:
    """One legend for the whole figure, below it: a line per run."""
    from matplotlib.lines import Line2D

    from matplotlib.ticker import MaxNLocator

    for axis in figure.axes:
        if axis.get_xlabel() == "iteration":
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    texts = [labels[run.name] for run in runs]
    handles = [Line2D([], [], color=colors[run.name], marker="o", markersize=4) for run in runs]
    side_by_side = sum(len(text) for text in texts) * 6 < figure.get_figwidth() * 72  # ~6 pt per character
    figure.legend(handles, texts, loc="outside lower center", ncols=len(runs) if side_by_side else 1,
                  frameon=False, fontsize=9)
    return figure


def _reward_figure(runs: list[Run], labels: dict[str, str], colors: dict[str, str]) -> Figure:
    figure, axes = _new_figure(1)
    axis = axes[0, 0]
    figure.set_size_inches(9, 4.2)
    for run in runs:
        rows = run.iteration_rows
        iterations, mean = run.plotted("reward/mean", rows)
        _, low = run.plotted("reward/min", rows)
        _, high = run.plotted("reward/max", rows)
        axis.plot(iterations, mean, color=colors[run.name], marker="o", markersize=3, label=labels[run.name],
                  gid=f"{run.name}|reward/mean")
        # GRPO's min–max is over single completions, ES's over members' means: not one band's scale
        comparable = run.algorithm == "es" or all(other.algorithm == "grpo" for other in runs)
        if comparable and len(low) == len(high) == len(iterations):
            axis.fill_between(iterations, low, high, color=colors[run.name], alpha=0.18, linewidth=0,
                              gid=f"{run.name}|reward/band")
    steps = {"es": "iteration", "grpo": "optimizer step"}
    axis.set(xlabel=" / ".join(dict.fromkeys(steps.get(run.algorithm, "iteration") for run in runs)), ylabel="reward",
             title="reward: mean, min–max band")
    return _finish(figure, labels, runs, colors)


def _held_out_figure(runs: list[Run], keys: list[str], labels: dict[str, str], colors: dict[str, str]) -> Figure:
    """Per held-out metric (split): a panel over iterations, then one over each budget some run has,
    two panels a row."""
    from matplotlib.ticker import PercentFormatter

    budgets = {run.name: {kind: run.budget(kind) for kind in BUDGET_KINDS} for run in runs}
    axes_x = ["iteration", *[kind for kind in BUDGET_KINDS if any(budgets[run.name][kind] for run in runs)]]
    columns = min(2, len(axes_x))
    rows_per_key = math.ceil(len(axes_x) / columns)
    figure, grid = _new_figure(columns, rows_per_key * len(keys))
    figure.set_size_inches(6 * columns, 3.4 * rows_per_key * len(keys) + 0.8)
    panels = grid.flat
    for key in keys:
        key_axes = [next(panels) for _ in range(rows_per_key * columns)]
        for axis in key_axes[len(axes_x):]:
            axis.set_visible(False)
        for axis, x_name in zip(key_axes, axes_x):
            for run in runs:
                iterations, values = run.plotted(key)
                if x_name != "iteration":
                    spent = (budgets[run.name][x_name] or ({}, ""))[0]
                    iterations, values = [spent[i] for i in iterations if i in spent], [
                        v for i, v in zip(iterations, values) if i in spent]
                axis.plot(iterations, values, color=colors[run.name], marker="o", markersize=4,
                          gid=f"{run.name}|{key}|{x_name}")
            axis.set(xlabel=x_name, ylabel=key.split("/", 1)[1], title=f"{' '.join(key.split('/')[1:])} over {x_name}")
            if key.endswith("/accuracy"):
                axis.yaxis.set_major_formatter(PercentFormatter(1.0))
            if x_name != "iteration":
                sources = {budgets[run.name][x_name][1] for run in runs if budgets[run.name][x_name]}
                axis.set_xlabel(f"{x_name} ({sources.pop() if len(sources) == 1 else 'recorded or derived: see table'})")
    return _finish(figure, labels, runs, colors)


def _grid_figure(runs: list[Run], keys: list[str], titles: list[str], labels: dict[str, str],
                 colors: dict[str, str]) -> Figure:
    """One panel per per-iteration key, every run overlaid."""
    figure, axes = _new_figure(len(keys))
    for axis, key, title in zip(axes[0], keys, titles):
        for run in runs:
            iterations, values = run.plotted(key, run.iteration_rows)
            axis.plot(iterations, values, color=colors[run.name], marker="o", markersize=3, gid=f"{run.name}|{key}")
        axis.set(xlabel="iteration", title=title)
    return _finish(figure, labels, runs, colors)


def _png(figure: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    """Whole file or nothing (temp file + rename), readable by others: a report is meant to be shared."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------ HTML
STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1.5rem; color: #1f2328; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: 0.3rem; margin-top: 2rem; }
.meta { color: #59636e; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border: 1px solid #d0d7de; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.differs td { background: #fff8c5; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #59636e; font-size: 0.9rem; }
code { background: #f6f8fa; padding: 0 0.2rem; }
"""


def render_html(runs: list[Run], images: dict[str, bytes]) -> str:
    """The page: title, runs table (settings that differ, final numbers), figures, notes, all settings."""
    names = ", ".join(run.name for run in runs)
    differing = differing_settings(runs)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>esft report: {_e(names)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
        f"<h1>esft report: {_e(names)}</h1>",
        f'<p class="meta">{len(runs)} run{"s" if len(runs) > 1 else ""}, written {_e(time.strftime("%Y-%m-%d %H:%M"))}: '
        + ", ".join(f"<code>{_e(str(run.path))}</code>" for run in runs) + "</p>",
        "<h2>Runs</h2>", _summary_table(runs, differing),
    ]
    sections = {"reward": "Reward", "heldout": "Held-out evaluation", "throughput": "Throughput",
                "failures": "Reward failures"}
    for name, title in sections.items():
        parts.append(f"<h2>{title}</h2>")
        if name in images:
            data = base64.b64encode(images[name]).decode("ascii")
            parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{_e(title)}">'
                         f"<figcaption>{_e(captions(runs)[name])}</figcaption></figure>")
        else:
            parts.append("<p>Not recorded by " + ("any of these runs" if len(runs) > 1 else "this run")
                         + (" (no evaluation)." if name == "heldout" else " (no ES iteration).") + "</p>")
    notes = [note for run in runs for note in _notes(run)]
    if notes:
        parts += ["<h2>Notes</h2>", "<ul>", *(f"<li>{_e(note)}</li>" for note in notes), "</ul>"]
    parts += ["<details>", "<summary>All settings (config.yaml)</summary>", _settings_table(runs, differing),
              "</details>", "</body>", "</html>"]
    return "\n".join(parts) + "\n"


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table(runs: list[Run], rows: list[tuple[str, str, list[str]]]) -> str:
    """A table with one column per run; `rows` are (css class, row name, cells already escaped)."""
    lines = ["<table>", "<tr><th></th>" + "".join(f"<th>{_e(run.name)}</th>" for run in runs) + "</tr>"]
    for css, name, cells in rows:
        row_class = f' class="{css}"' if css else ""
        lines.append(f"<tr{row_class}><th>{_e(name)}</th>" + "".join(
            f'<td class="num">{cell}</td>' if cell[:1].isdigit() or cell[:1] in "-+" else f"<td>{cell}</td>"
            for cell in cells) + "</tr>")
    return "\n".join(lines + ["</table>"])


def _summary_table(runs: list[Run], differing: list[str]) -> str:
    """The settings that differ (highlighted) and each run's final numbers."""
    rows = [("", "status", [_e(run.status) for run in runs])]
    rows += [("differs", key, [_e(setting_of(run, key)) for run in runs]) for key in differing]
    rows.append(("", "last iteration", [str(run.last_iteration) for run in runs]))
    rows.append(("", "final reward mean", [_number(_last(run.series("reward/mean", run.iteration_rows)[1]))
                                           for run in runs]))
    rows.append(("", "tokens/s (median)", [_number(_median(run.series("perf/tokens_per_s", run.iteration_rows)[1]))
                                           for run in runs]))
    for key in held_out_keys(runs):
        cells = []
        for run in runs:
            values = [v for v in run.series(key)[1] if not math.isnan(v)]
            cells.append(f"{_metric(key, values[0])} → {_metric(key, values[-1])}" if values else "—")
        rows.append(("", f"{key.split('/', 1)[1]} (first → last)", cells))
    for kind in BUDGET_KINDS:
        budgets = [run.budget(kind) for run in runs]
        rows.append(("", f"{kind} spent", [f"{_number(b[0][max(b[0])])} ({_e(b[1].split(':')[0])})" if b else "—"
                                           for b in budgets]))
    return _table(runs, rows)


def _settings_table(runs: list[Run], differing: list[str]) -> str:
    keys: dict[str, None] = {}
    for run in runs:
        keys |= dict.fromkeys(run.config)
    return _table(runs, [("differs" if key in differing else "", key, [_e(setting_of(run, key)) for run in runs])
                         for key in keys])


def _last(values: list[float]) -> float:
    return values[-1] if values else math.nan


def _median(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return median(present) if present else math.nan


def _number(value: float) -> str:
    if math.isnan(value):
        return "—"
    if float(value).is_integer() and 1000 <= abs(value) < 1e15:  # beyond: 1e+308, not 309 digits
        return f"{int(value):,}"
    return f"{value:.4g}"


def _metric(key: str, value: float) -> str:
    return f"{100 * value:.1f}%" if key.endswith("/accuracy") else _number(value)


def _notes(run: Run) -> list[str]:
    notes = []
    if run.skipped_lines:
        lines = ", ".join(str(n) for n in run.skipped_lines[:5]) + (", …" if len(run.skipped_lines) > 5 else "")
        notes.append(f"{run.name}: skipped {len(run.skipped_lines)} unreadable line(s) of metrics.jsonl "
                     f"(torn by a killed run, or not JSON): line {lines}")
    if run.status != "complete":
        notes.append(f"{run.name}: {run.status}" + ("; final/ holds its last weights" if (run.path / "final").is_dir()
                                                     else " (no final/ model): a partial run"))
    if not run.config:
        notes.append(f"{run.name}: no readable config.yaml; settings unknown, budgets not derived")
    return notes
