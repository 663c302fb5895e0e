"""`esft report` and the report.html every training writes: the plotted series are metrics.jsonl's
values (checked on the matplotlib figures' data, not pixels), the page is well-formed and
self-contained, overlays name every run, and real runs (finished, resumed, interrupted) report."""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from tiny_model import subprocess_env
from esft.runs.report import build_figures, write_report
from esft.runs.report_data import ReportError, load_run, load_runs
from test_cli import TINY, assert_user_error, esft

TESTS = Path(__file__).parent
CONFIG = {"task": "countdown", "population_size": 3, "batch_size": 2, "iterations": 4, "noise": "iid", "seed": 0,
          "run_name": "ignored", "output_dir": "ignored"}


def iteration_row(iteration: int, mean: float, low: float, high: float | None, **extra) -> dict:
    return {"iteration": iteration, "reward/mean": mean, "reward/std": 0.1, "reward/min": low, "reward/max": high,
            "completions/mean_length": 5.0 + iteration, "perf/iteration_s": 0.5 * iteration,
            "perf/tokens_per_s": 100.0 * iteration, "reward/failures": iteration % 2, "reward/errors": 0,
            "reward/timeouts": 0, "rewards/f/mean": mean, **extra}


def accuracy(value: float) -> dict:
    return {"eval/heldout/accuracy": value, "eval/heldout/reward": value / 2, "eval/heldout/mean_length": 7.0}


# Iteration 2 is logged twice (a resume repeats it: the last row wins), iteration 3's max is null
# (NaN logged as null), one line is not JSON and the last line is torn (a killed run).
ROWS = [{"iteration": 0, **accuracy(0.25)}, iteration_row(1, 0.2, 0.1, 0.4), iteration_row(2, 9.0, 9.0, 9.0),
        iteration_row(2, 0.3, 0.2, 0.5, **accuracy(0.5)), iteration_row(3, 0.35, 0.3, None),
        iteration_row(4, 0.45, 0.4, 0.6, **accuracy(0.75))]
LINES = [json.dumps(row) for row in ROWS[:3]] + ["warning: not json"] + [json.dumps(row) for row in ROWS[3:]] + [
    '{"iteration": 5, "reward/me']


def make_run(directory: Path, lines: list[str] = LINES, config: dict | None = CONFIG, final: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config is not None:
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    if final:
        (directory / "final").mkdir()
    return directory


def artist(figure, gid: str):
    found = [a for axis in figure.axes for a in [*axis.lines, *axis.collections] if a.get_gid() == gid]
    assert len(found) == 1, f"{gid}: {len(found)} artists"
    return found[0]


def same(a, b) -> bool:
    """Element-wise equality where NaN equals NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------ series = metrics.jsonl
def test_reward_line_and_band_are_the_logged_values(tmp_path):
    run = load_run(make_run(tmp_path / "r"))
    assert run.skipped_lines == [4, 8]  # the non-JSON line and the torn last line
    figure = build_figures([run])["reward"]
    line = artist(figure, "r|reward/mean")
    assert list(line.get_xdata()) == [1, 2, 3, 4]
    assert list(line.get_ydata()) == [0.2, 0.3, 0.35, 0.45]  # iteration 2: the last row, not 9.0
    band = artist(figure, "r|reward/band")
    corners = {(float(x), float(y)) for path in band.get_paths() for x, y in path.vertices}
    expected = {(1.0, 0.1), (1.0, 0.4), (2.0, 0.2), (2.0, 0.5), (4.0, 0.4), (4.0, 0.6)}
    assert corners == expected  # iteration 3 (max null) leaves a gap in the band
    failures = artist(build_figures([run])["failures"], "r|reward/failures")
    assert list(failures.get_ydata()) == [1, 0, 1, 0]
    throughput = artist(build_figures([run])["throughput"], "r|perf/tokens_per_s")
    assert list(throughput.get_ydata()) == [100.0, 200.0, 300.0, 400.0]


def test_held_out_accuracy_over_iterations_and_derived_budgets(tmp_path):
    run = load_run(make_run(tmp_path / "r"))
    figure = build_figures([run])["heldout"]
    over_iterations = artist(figure, "r|eval/heldout/accuracy|iteration")
    assert list(over_iterations.get_xdata()) == [0, 2, 4] and list(over_iterations.get_ydata()) == [0.25, 0.5, 0.75]
    # derived from config.yaml (3 members × 2 prompts = 6 completions per iteration) and the iteration rows
    per_iteration = {row["iteration"]: row for row in ROWS[3:]} | {1: ROWS[1]}
    tokens = [0.0, 6 * (per_iteration[1]["completions/mean_length"] + per_iteration[2]["completions/mean_length"])]
    tokens.append(tokens[1] + 6 * (per_iteration[3]["completions/mean_length"] + per_iteration[4]["completions/mean_length"]))
    seconds = [0.0, 0.5 + 1.0, 0.5 + 1.0 + 1.5 + 2.0]
    for kind, xs in (("completions", [0, 12, 24]), ("tokens", tokens), ("seconds", seconds)):
        line = artist(figure, f"r|eval/heldout/accuracy|{kind}")
        assert list(line.get_xdata()) == pytest.approx(xs), kind
        assert list(line.get_ydata()) == [0.25, 0.5, 0.75]
        assert "derived" in line.axes.get_xlabel()


def test_recorded_budget_is_plotted_instead_of_derived(tmp_path):
    rows = [{"iteration": 0, **accuracy(0.1)},
            iteration_row(1, 0.2, 0.1, 0.3, **{"budget/tokens": 1000, "budget/seconds": 3.5}),
            iteration_row(2, 0.3, 0.2, 0.4, **{"budget/tokens": 2500, "budget/seconds": 8.0}, **accuracy(0.4))]
    run = load_run(make_run(tmp_path / "r", [json.dumps(row) for row in rows]))
    figure = build_figures([run])["heldout"]
    for kind, xs in (("tokens", [0, 2500]), ("seconds", [0, 8.0])):
        line = artist(figure, f"r|eval/heldout/accuracy|{kind}")
        assert list(line.get_xdata()) == xs
        assert f"recorded: budget/{kind}" in line.axes.get_xlabel()
    assert "derived" in artist(figure, "r|eval/heldout/accuracy|completions").axes.get_xlabel()


# ------------------------------------------------------------------ the page
class TagChecker(HTMLParser):
    """Checks that every opened tag is closed in order and collects src/href attributes."""

    VOID = {"meta", "img", "br", "hr", "link", "input", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.references: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.references += [value or "" for name, value in attrs if name in ("src", "href")]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"unexpected </{tag}> at {self.getpos()}")


def check_page(page: Path) -> str:
    """Well-formed, no external reference, images inline and equal to the PNGs beside the page."""
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    checker = TagChecker()
    checker.feed(text)
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    assert "http://" not in text and "https://" not in text
    assert checker.references and all(ref.startswith("data:image/png;base64,") for ref in checker.references)
    inline = sorted(base64.b64decode(ref.split(",", 1)[1]) for ref in checker.references)
    beside = sorted(path.read_bytes() for path in page.parent.glob(f"{page.stem}-*.png"))
    assert inline == beside and all(data.startswith(b"\x89PNG\r\n\x1a\n") for data in inline)
    return text


def test_page_is_well_formed_and_self_contained_for_a_killed_run(tmp_path):
    run_dir = make_run(tmp_path / "killed", config=CONFIG | {"iterations": 10}, final=False)
    page = write_report([run_dir])
    assert page == run_dir / "report.html"
    text = check_page(page)
    assert {p.name for p in run_dir.glob("report-*.png")} == {
        "report-reward.png", "report-heldout.png", "report-throughput.png", "report-failures.png"}
    assert "<title>esft report: killed</title>" in text
    assert "interrupted at iteration 4 of 10" in text  # killed: it recorded no end
    assert "skipped 2 unreadable line(s)" in text and "line 4, 8" in text
    assert "25.0% → 75.0%" in text  # held-out accuracy, first → last


def test_overlay_of_two_runs_names_both_in_legends_and_table(tmp_path, monkeypatch):
    a = make_run(tmp_path / "alpha")
    b = make_run(tmp_path / "beta", [json.dumps(row) for row in ROWS[:2]], config=CONFIG | {"noise": "lowrank"})
    runs = load_runs([a, b])
    for name, figure in build_figures(runs).items():
        legend = [text.get_text() for text in figure.legends[0].get_texts()]
        assert legend == ["alpha (noise=iid)", "beta (noise=lowrank)"], name
    reward = build_figures(runs)["reward"]
    assert list(artist(reward, "beta|reward/mean").get_ydata()) == [0.2]
    assert list(artist(reward, "alpha|reward/mean").get_ydata()) == [0.2, 0.3, 0.35, 0.45]
    text = check_page(write_report([a, b], tmp_path / "both.html"))
    assert re.search(r"<tr><th></th><th>alpha</th><th>beta</th></tr>", text)
    assert re.search(r'<tr class="differs"><th>noise</th><td>iid</td><td>lowrank</td></tr>', text)
    assert "run_name" not in re.findall(r'<tr class="differs"><th>(\w+)', text)  # bookkeeping, not a setting
    monkeypatch.chdir(tmp_path)
    assert write_report([a, b]) == Path("esft-report.html") and (tmp_path / "esft-report-reward.png").is_file()


def test_runs_without_evaluations_or_iterations_still_report(tmp_path):
    no_eval = make_run(tmp_path / "no-eval", [json.dumps(iteration_row(1, 0.2, 0.1, 0.3))])
    figures = build_figures(load_runs([no_eval]))
    assert "heldout" not in figures and "reward" in figures
    assert "Not recorded by this run (no evaluation)." in check_page(write_report([no_eval]))
    eval_only = make_run(tmp_path / "eval-only", [json.dumps({"iteration": 0, **accuracy(0.5)})],
                         config=None, final=False)
    figures = build_figures(load_runs([eval_only]))
    assert set(figures) == {"heldout"}  # no budget either: no config, no iteration
    assert list(artist(figures["heldout"], "eval-only|eval/heldout/accuracy|iteration").get_ydata()) == [0.5]
    assert "no readable config.yaml" in check_page(write_report([eval_only]))


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "not a directory"),
    (lambda d: d, "not a run directory (no metrics.jsonl)"),
    (lambda d: make_run(d / "torn", ['{"iteration": 0, "ev']), "no metric row"),
])
def test_what_is_not_a_run_is_a_report_error(tmp_path, make, message):
    with pytest.raises(ReportError, match=re.escape(message)):
        write_report([make(tmp_path)])


# ------------------------------------------------------------------ real runs, the CLI
def toy_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`esft train --task toy` in a fresh interpreter (tests/toy_task.py registers the task)."""
    env = subprocess_env()
    return subprocess.run([sys.executable, str(TESTS / "toy_task.py"), "train", "--task", "toy", *TINY,
                           "--logging", "none", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_training_writes_its_report_and_a_resumed_run_reports_every_iteration(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--run-name", "run",
              "--sigma", "0.05", "--save-every", "1", "--eval-every", "1"]
    proc = toy_train(*common, "--iterations", "2", cwd=tmp_path)
    run_dir = tmp_path / "run"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"report: {run_dir / 'report.html'}"
    proc = toy_train("--resume", str(run_dir), "--iterations", "3", "--model", str(tiny_model_dir),
                     "--save-every", "1", "--eval-every", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"report: {run_dir / 'report.html'}"
    text = check_page(run_dir / "report.html")
    assert "<tr><th>last iteration</th><td class=\"num\">3</td></tr>" in text
    rows = metrics_of(run_dir)
    figures = build_figures(load_runs([run_dir]))
    reward = artist(figures["reward"], "run|reward/mean")
    assert list(reward.get_xdata()) == [1, 2, 3]
    assert same(reward.get_ydata(), [row["reward/mean"] for row in rows if "reward/mean" in row])
    held_out = artist(figures["heldout"], "run|eval/heldout/accuracy|iteration")
    assert list(held_out.get_xdata()) == [0, 1, 2, 3]


INTERRUPTING_REWARD = """
calls = 0

def interrupt_on_fourth_call(prompts, completions, **kwargs):
    global calls
    calls += 1
    if calls == 4:  # evaluation before training, then two members per iteration: stops iteration 2
        raise KeyboardInterrupt
    return [float(len(c)) for c in completions]
"""


def test_an_interrupted_training_writes_its_report_and_says_where(tiny_model_dir, tmp_path):
    (tmp_path / "rewards.py").write_text(INTERRUPTING_REWARD)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}:"}) + "\n" for i in range(8)))
    proc, _ = esft("train", "--model", str(tiny_model_dir), *TINY, "--reward-funcs", "rewards.py:interrupt_on_fourth_call",
                   "--no-reward-sandbox", "--train-data", str(data), "--eval-data", str(data), "--iterations", "5",
                   "--logging", "none", "--output-dir", str(tmp_path), "--run-name", "stopped", cwd=tmp_path)
    run_dir = tmp_path / "stopped"
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith(f"; report: {run_dir / 'report.html'}")
    text = check_page(run_dir / "report.html")
    assert "interrupted at iteration 1 of 5" in text
    assert [row["iteration"] for row in metrics_of(run_dir)] == [0, 1]


def test_cli_report_overlays_runs_and_rejects_a_directory_that_is_not_a_run(tmp_path):
    make_run(tmp_path / "a")
    make_run(tmp_path / "b", config=CONFIG | {"seed": 1})
    proc, _ = esft("report", "a", "b", "--out", "both.html", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "report: both.html"
    assert {p.name for p in tmp_path.glob("both*")} == {
        "both.html", "both-reward.png", "both-heldout.png", "both-throughput.png", "both-failures.png"}
    text = check_page(tmp_path / "both.html")
    assert "<title>esft report: a, b</title>" in text
    assert re.search(r'<tr class="differs"><th>seed</th><td class="num">0</td><td class="num">1</td></tr>', text)
    proc, _ = esft("report", "a", str(tmp_path), cwd=tmp_path)
    assert_user_error(proc, f"{tmp_path}: not a run directory (no metrics.jsonl)")


# ----------------------------------------------------------- ES beside GRPO, and how runs ended (issue 25)
GRPO_CONFIG = CONFIG | {"algorithm": "grpo", "learning_rate": 1e-6, "num_generations": 4, "beta": 0.0,
                        "population_size": 30, "sigma": 0.001, "noise": "lowrank"}


def test_grpo_beside_es_shows_each_algorithms_own_settings_and_captions(tmp_path):
    es = make_run(tmp_path / "es", config=CONFIG | {"algorithm": "es", "learning_rate": 1e-5, "num_generations": 8})
    grpo = make_run(tmp_path / "grpo", config=GRPO_CONFIG)
    runs = load_runs([es, grpo])
    from esft.runs.report_data import differing_settings, run_labels

    differing = differing_settings(runs)
    assert differing[0] == "algorithm"  # first, so the legend names it
    # ES-only settings of the GRPO run (population, σ, noise) and GRPO-only settings of the ES run are not "differs"
    assert not {"population_size", "sigma", "noise", "learning_rate", "num_generations"} & set(differing), differing
    assert run_labels(runs, differing)["grpo"].startswith("grpo (algorithm=grpo")
    figure = build_figures(runs)["reward"]
    artist(figure, "es|reward/band")  # ES's band over members' means ...
    assert not [a for a in figure.axes[0].collections if a.get_gid() == "grpo|reward/band"]  # ... GRPO's is not on it
    text = check_page(write_report([es, grpo], tmp_path / "cmp.html"))
    assert "GRPO runs, per optimizer step" in text and "n/a (grpo)" in text and "n/a (es)" in text
    only_grpo = check_page(write_report([grpo], tmp_path / "grpo.html"))
    assert "over members" not in only_grpo and "per ES iteration" not in only_grpo
    assert "per GRPO optimizer step" in only_grpo


def test_the_report_says_how_a_real_run_ended(tiny_model_dir, tmp_path):
    """A run stopped by its budget at iteration 2 of 6 was labelled `complete`; one that stopped on an
    error looked like a killed one."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}:"}) + "\n" for i in range(8)))
    (tmp_path / "rewards.py").write_text("calls = 0\n\ndef breaks(prompts, completions, **kwargs):\n    global calls\n"
                                         "    calls += 1\n    if calls > 3:\n        raise ValueError('down')\n"
                                         "    return [float(len(c)) for c in completions]\n\n"
                                         "def fine(prompts, completions, **kwargs):\n"
                                         "    return [float(len(c)) for c in completions]\n")
    common = ["--model", str(tiny_model_dir), *TINY, "--no-reward-sandbox", "--train-data", str(data), "--eval-data",
              str(data), "--iterations", "6", "--logging", "none", "--no-progress", "--output-dir", str(tmp_path)]
    budget, _ = esft("train", *common, "--reward-funcs", "rewards.py:fine", "--budget-completions", "8",
                     "--run-name", "budget", cwd=tmp_path)  # 2 members x 2 prompts per iteration
    assert budget.returncode == 0, budget.stderr[-2000:]
    assert [row["iteration"] for row in metrics_of(tmp_path / "budget")] == [0, 1, 2]
    text = check_page(tmp_path / "budget" / "report.html")
    assert "stopped: budget at iteration 2 of 6" in text and ">complete<" not in text
    broken, _ = esft("train", *common, "--reward-funcs", "rewards.py:breaks", "--run-name", "broken", cwd=tmp_path)
    assert broken.returncode == 2, broken.stderr[-2000:]
    assert "stopped: error at iteration 1 of 6" in check_page(tmp_path / "broken" / "report.html")
