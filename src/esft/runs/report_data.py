"""What `esft report` plots, read from run directories: settings (config.yaml), metric rows
(metrics.jsonl) and the series derived from them. No matplotlib here (esft.runs.report draws).

metrics.jsonl is read the way a killed or resumed run leaves it: torn or non-JSON lines are skipped
(and counted), a repeated iteration keeps its last row, null (a NaN the logger wrote) is NaN."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esft.files import (KIB, METRICS_LIMIT, SETTINGS_LIMIT, YamlTooLarge, load_yaml, read_regular_text,
                        write_text_atomic)
from esft.runs.metrics import METRICS_FILE

CONFIG_FILE = "config.yaml"
STATUS_FILE = "status.json"
"""How the last train() in a run directory ended (esft.trainer writes it; `esft report` shows it)."""
# Bookkeeping settings: they never make two runs' curves differ, so they are not "settings that differ".
IGNORED_SETTINGS = ("run_name", "output_dir", "resume", "progress", "logging")
BUDGET_KINDS = ("completions", "tokens", "seconds")
DERIVED_BUDGET = {
    "completions": "derived: population × batch",
    "tokens": "derived: mean length × completions",
    "seconds": "derived: Σ perf/iteration_s, no evals",
}


class ReportError(Exception):
    """A directory that cannot be reported (not a run, no metrics.jsonl, unreadable): one line for the user."""


@dataclass
class Run:
    """One run directory, read: `rows` has one row per iteration, ascending."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    skipped_lines: list[int] = field(default_factory=list)

    @property
    def iteration_rows(self) -> list[dict[str, Any]]:
        """Rows of ES iterations (iteration 0, the evaluation before training, has none of their keys)."""
        return [row for row in self.rows if "reward/mean" in row]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        """Rows that hold an evaluation."""
        return [row for row in self.rows if any(key.startswith("eval/") for key in row)]

    @property
    def last_iteration(self) -> int:
        """The last iteration logged."""
        return self.rows[-1]["iteration"]

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm", "es"))

    @property
    def status(self) -> str:
        """'complete' (or 'complete: ' and what was wrong with it: the weights never moved), or how and
        where the run stopped: 'stopped: budget', 'stopped: error' or 'interrupted' (Ctrl-C, or killed:
        a run that recorded no end) at iteration k of n."""
        planned = self.config.get("iterations")
        try:
            recorded = json.loads(read_regular_text(self.path / STATUS_FILE, 64 * KIB)).get("status")
        except (OSError, ValueError, AttributeError, RecursionError):  # a pipe, a device, a hand edit: no status
            recorded = None
        if not isinstance(recorded, str):
            recorded = None
        for ending in ("stopped: budget", "stopped: error", "interrupted"):  # + ": what was wrong", e.g. never moved
            if recorded is not None and (recorded == ending or recorded.startswith(ending + ": ")):
                return f"{ending} at iteration {self.last_iteration} of {planned}{recorded[len(ending):][:300]}"
        if recorded is not None and recorded.startswith("complete: "):  # e.g. "the weights never moved (...)"
            return recorded[:300]
        if recorded == "complete" or planned is None or self.last_iteration >= planned:
            return "complete"
        if (self.path / "final").is_dir():  # written by a version that recorded no status: final/ = it ended
            return f"stopped at iteration {self.last_iteration} of {planned}"
        return f"interrupted at iteration {self.last_iteration} of {planned}"

    def series(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        """(iterations, values) of `key` over `rows` (default: all rows having it); null → NaN."""
        rows = [row for row in (self.rows if rows is None else rows) if key in row]
        return [row["iteration"] for row in rows], [as_float(row[key]) for row in rows]

    def plotted(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        """series(), with values beyond ±PLOTTED_LIMIT as NaN (gaps in the curve): matplotlib cannot place
        ticks on an axis spanning ±1e308 (a reward function returning 1e308 would cost the report)."""
        iterations, values = self.series(key, rows)
        return iterations, [v if abs(v) <= PLOTTED_LIMIT else math.nan for v in values]

    def budget(self, kind: str) -> tuple[dict[int, float], str] | None:
        """Cumulative training budget ('completions', 'tokens' or 'seconds') at the end of each
        iteration, and where it comes from: the logged `budget/<kind>` when the run recorded it, else
        derived from the iteration rows (DERIVED_BUDGET); None when neither is possible."""
        key = f"budget/{kind}"
        if any(key in row for row in self.rows):
            recorded = {row["iteration"]: as_float(row[key]) for row in self.rows if key in row}
            recorded.setdefault(0, 0.0)  # nothing is spent before training
            return recorded, f"recorded: {key}"
        per_member = _int_setting(self.config, "population_size") * _int_setting(self.config, "batch_size")
        amount = {
            "completions": lambda row: per_member or math.nan,
            "tokens": lambda row: as_float(row.get("completions/mean_length")) * (per_member or math.nan),
            "seconds": lambda row: as_float(row.get("perf/iteration_s")),
        }[kind]
        total, spent = 0.0, {0: 0.0}
        for row in self.iteration_rows:
            step = amount(row)
            total += 0.0 if math.isnan(step) else step  # an unknown step adds nothing, the curve goes on
            spent[row["iteration"]] = total
        if not self.iteration_rows or total == 0.0:
            return None
        return spent, DERIVED_BUDGET[kind]


def write_status(run_dir: Path | None, status: str) -> None:
    """Record how a train() ended ('complete', 'stopped: budget', 'stopped: error', 'interrupted');
    a status that cannot be written costs nothing but its line in the report."""
    if run_dir is None:
        return
    try:
        write_text_atomic(Path(run_dir) / STATUS_FILE, json.dumps({"status": status}) + "\n")
    except OSError:
        pass


def applies(key: str, run: Run) -> bool:
    """Whether setting `key` means anything for `run`'s algorithm: the field's `algorithms`
    (esft.settings.fields); RandOpt has no iterations either. Keys ESConfig does not have apply to all."""
    import dataclasses

    from esft.settings.config import ESConfig
    from esft.settings.fields import applies as field_applies

    if run.algorithm == "randopt" and key == "iterations":  # no update, no iterations
        return False
    found = next((f for f in dataclasses.fields(ESConfig) if f.name == key), None)
    return found is None or field_applies(found, run.algorithm)


def setting_of(run: Run, key: str) -> Any:
    """The run's value of `key`, '—' when unset, 'n/a (<algorithm>)' when its algorithm has no use for it."""
    return run.config.get(key, "—") if applies(key, run) else f"n/a ({run.algorithm})"


PLOTTED_LIMIT = 1e100
"""The largest magnitude a report's curves draw (tables show every value)."""


def as_float(value: Any) -> float:
    """A logged number as float; null (NaN/inf was logged as null) and non-numbers → NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _int_setting(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def load_run(path: str | Path) -> Run:
    """Read one run directory; ReportError when it is not one or holds no metric row."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: not a directory; give a run directory (one holding {METRICS_FILE}, "
                          "e.g. runs/<run-name>)")
    metrics = path / METRICS_FILE
    if not os.path.lexists(metrics):  # anything else there is read below, as a regular file only
        raise ReportError(f"{path}: not a run directory (no {METRICS_FILE}); give the directory that "
                          "`esft train` printed as 'run directory'")
    try:
        lines = read_regular_text(metrics, METRICS_LIMIT, errors="replace").splitlines()
    except OSError as error:
        raise ReportError(f"{metrics}: cannot read it ({error.strerror})") from None
    by_iteration: dict[int, dict[str, Any]] = {}
    skipped = []
    for number, line in enumerate(lines, start=1):
        row = _parse_row(line)
        if row is None:
            if line.strip():
                skipped.append(number)
            continue
        by_iteration[row["iteration"]] = row  # a repeated iteration: the last row wins
    if not by_iteration:
        raise ReportError(f"{metrics}: no metric row (a run that stopped before its first evaluation); "
                          "nothing to report")
    rows = [by_iteration[iteration] for iteration in sorted(by_iteration)]
    return Run(path, path.resolve().name, _read_config(path / CONFIG_FILE), rows, skipped)


def _parse_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict) or not isinstance(row.get("iteration"), int) or isinstance(row["iteration"], bool):
        return None
    return row


def _read_config(path: Path) -> dict[str, Any]:
    """config.yaml's settings; {} when missing (a run written by other code) or unreadable."""
    import yaml

    try:
        config = load_yaml(read_regular_text(path, SETTINGS_LIMIT))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, YamlTooLarge):
        return {}
    return config if isinstance(config, dict) else {}


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Read every run; runs with the same directory name are told apart by their parent's name."""
    runs = [load_run(path) for path in paths]
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
    return runs


def held_out_keys(runs: list[Run]) -> list[str]:
    """The held-out metric plotted per eval split, in the order logged: `eval/<split>/accuracy`, or
    `eval/<split>/reward` for a split no run measured accuracy on (a task without accuracy function)."""
    metrics: dict[str, set[str]] = {}
    for run in runs:
        for row in run.rows:
            for key in row:
                parts = key.split("/")
                if len(parts) == 3 and parts[0] == "eval" and parts[2] in ("accuracy", "reward"):
                    metrics.setdefault(parts[1], set()).add(parts[2])
    return [f"eval/{split}/{'accuracy' if 'accuracy' in found else 'reward'}" for split, found in metrics.items()]


def differing_settings(runs: list[Run]) -> list[str]:
    """Settings (config.yaml keys) whose values are not the same in every run they apply to (an
    ES-only setting among the ES runs, a GRPO one among the GRPO runs); `algorithm` first."""
    keys: dict[str, None] = {}
    for run in runs:
        keys |= dict.fromkeys(run.config)
    found = []
    for key in keys:
        relevant = [run for run in runs if applies(key, run)]
        if key not in IGNORED_SETTINGS and len({json.dumps(run.config.get(key), sort_keys=True, default=str)
                                                for run in relevant}) > 1:
            found.append(key)
    return sorted(found, key=lambda key: key != "algorithm")  # stable: the rest keep config.yaml's order


def run_labels(runs: list[Run], settings: list[str], shown: int = 3) -> dict[str, str]:
    """Legend label per run name: the name and (up to `shown` of) the settings that differ."""
    labels = {}
    for run in runs:
        parts = [f"{key}={run.config.get(key)}" for key in settings[:shown]]
        if len(settings) > shown:
            parts.append("…")
        labels[run.name] = f"{run.name} ({', '.join(parts)})" if parts else run.name
    return labels
