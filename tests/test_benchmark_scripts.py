"""The benchmark scripts as a user runs them (subprocesses, tiny budgets): they must measure what they
say, or stop with an error; the speed figures themselves live in docs/benchmarks.md, not here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=ONE_THREAD)


def test_population_gap_benchmark_replays_the_populations_lengths(tmp_path):
    """benchmarks/population_gap.py as a user runs it (a subprocess, tiny budget): the plain model, replayed with
    each row forced to the population's length, must follow that schedule (else the script stops, exit 1), and
    the replay runs as many model forwards as the population did."""
    out = tmp_path / "gap.json"
    proc = _run("population_gap.py", "--population", "3", "--batch", "4", "--rows", "12", "--max-tokens", "12",
                "--rounds", "2", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "= hooks (replay seconds / population seconds)" in proc.stdout
    result = json.loads(out.read_text())
    for record in result["rounds"]:
        assert record["tokens"] > 4 * 3  # natural lengths: more than one token per row
        assert record["forwards"]["replay"] == record["forwards"]["population"] > 2  # a prefill and decoding steps
        for side in ("population", "limit", "replay"):
            assert record["phases"][side]["prefill"] > 0 and record["phases"][side]["all rows"] > 0


def test_vs_reference_runs_each_round_in_a_fresh_warmed_up_process(tmp_path):
    """Each round is its own process (so the printed spread covers what differs between two runs of the
    script), the parent reports every path's ratio over those rounds and its fraction of the limit (plain
    batched generation, timed in the same alternation), and --raw-json keeps every measurement."""
    raw_file = tmp_path / "raw.json"
    proc = _run("vs_reference.py", "--model", "embedded", "--prompts", "4", "--population", "3", "--max-tokens", "4",
                "--rounds", "2", "--repeats", "2", "--paths", "reference,preset,limit", "--raw-json", str(raw_file))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 rounds of 2 alternating repeats (each round a fresh process, warmed up)" in proc.stdout
    raw = json.loads(raw_file.read_text())
    assert raw["command"][-2:] == ["--raw-json", str(raw_file)] and list(raw["sizes"]) == ["4"]
    figures = raw["sizes"]["4"]
    for name in ("reference", "preset", "limit"):  # 2 rounds of 2 measurements; a round's figure is their mean
        assert [len(r) for r in figures["each"][name]] == [2, 2] and min(map(min, figures["each"][name])) > 0
        assert figures["cpu"][name] == pytest.approx([sum(r) / 2 for r in figures["each"][name]])
    ratios = sorted(r / p for r, p in zip(figures["cpu"]["reference"], figures["cpu"]["preset"]))
    each_round = r"round \d/2 \(process (\d+)\): reference [\d.]+ s, preset [\d.]+ s, limit [\d.]+ s"
    pids = [int(p) for p in re.findall(each_round, proc.stderr)]
    assert len(pids) == 2 and len(set(pids)) == 2, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| preset |"))
    assert re.search(r"\| (noisy: rerun \()?[\d.]+×.*2 rounds", row), row
    assert f"{ratios[0]:.2f}×–{ratios[1]:.2f}×, 2 rounds" in row, (row, ratios)  # the table's spread is the file's
    fractions = sorted(lim / p for lim, p in zip(figures["cpu"]["limit"], figures["cpu"]["preset"]))
    assert f"{fractions[0]:.1%}–{fractions[1]:.1%}, 2 rounds" in row.split("|")[5], (row, fractions)
    assert re.fullmatch(r"-?[\d.]+", row.split("|")[6].strip()), row  # the preset's mean reward
    assert re.fullmatch(r"[\d,]+", row.split("|")[7].strip()), row  # page faults per iteration, from the rounds' JSON
    limit_row = next(line for line in proc.stdout.splitlines() if line.startswith("| limit |")).split("|")
    assert "2 rounds" in limit_row[4] and limit_row[5].strip() == "—" == limit_row[6].strip(), limit_row
    assert figures["tokens"]["limit"] is None  # plain generation has no reward, and says so rather than 0
    # the load the ratio was measured under, with the host's share of the VM's CPU time (steal) over the run
    steal = re.search(r"; load average [\d.]+/[\d.]+/[\d.]+; host steal ([\d.]+)% of CPU time since the start",
                      proc.stdout)
    assert steal and 0.0 <= float(steal.group(1)) <= 100.0, proc.stdout


def test_vs_reference_stops_when_a_rounds_process_fails(tmp_path):
    """No table that looks like a result, and the --neighbour process it started is gone too."""
    proc = _run("vs_reference.py", "--model", str(tmp_path / "no-such-model"), "--prompts", "4", "--population", "3",
                "--max-tokens", "4", "--rounds", "2", "--repeats", "1", "--paths", "reference,preset", "--neighbour")
    assert proc.returncode == 1
    assert "the process of round 1 failed" in proc.stderr
    assert "| preset |" not in proc.stdout
    neighbour = int(re.search(r"a neighbour copying 256 MiB arrays: process (\d+)", proc.stderr).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(neighbour, 0)


def test_gpu_suite_on_a_cpu_times_every_path_and_writes_its_table(tmp_path):
    """The GPU table's script, run on a CPU (its smoke mode): every path timed in every round after the
    warm-up, the ratios taken round by round, the JSON and markdown written."""
    proc = _run("gpu_suite.py", "--device", "cpu", "--dtype", "float32", "--model", "embedded", "--prompts", "4",
                "--population", "3", "--max-tokens", "4", "--rounds", "2", "--no-demo", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    (result,) = report["results"]
    assert set(result["seconds"]) == {"reference", "sequential", "default", "preset", "limit"}
    assert all(len(times) == 2 and min(times) > 0 for times in result["seconds"].values())
    assert "4 prompts, round 0: preset" in proc.stderr  # the warm-up round ran and was not counted
    for name in ("sequential", "default", "preset", "limit"):
        ratios = [r / p for r, p in zip(result["seconds"]["reference"], result["seconds"][name])]
        assert result["vs_reference"][name]["min"] == pytest.approx(min(ratios))
    assert result["rows_per_call"]["preset"] == "12 (3 members × 4 prompts)"
    assert result["rounds_timed"] == 2
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| limit |" in table and "timed rounds: the run stopped" not in table


def test_gpu_suite_keeps_to_its_time_budget_and_shares_it_between_prompt_sizes(tmp_path):
    """--budget-minutes: 200 rounds asked, 6 s allowed; each size gets its share (the first cannot take the
    second's), stops starting rounds that would end after it, keeps what it measured and says why it stopped."""
    proc = _run("gpu_suite.py", "--device", "cpu", "--dtype", "float32", "--model", "embedded", "--prompts", "2,4",
                "--population", "3", "--max-tokens", "4", "--rounds", "200", "--paths", "reference,preset,limit",
                "--no-demo", "--budget-minutes", "0.1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [r["prompts"] for r in report["results"]] == [2, 4]
    for result in report["results"]:
        assert 1 <= result["rounds_timed"] < 200 and result["stopped_by_budget"], result["rounds_timed"]
        assert result["of_limit"]["preset"]["rounds"] == result["rounds_timed"]
    assert report["total_seconds"] < 60  # 400 rounds unbudgeted take minutes
    table = (tmp_path / "gpu_suite.md").read_text()
    assert table.count("timed rounds: the next would have ended after this size's share of --budget-minutes 0.1") == 2
    assert re.search(r"2 prompts: round \d+ not started: at [\d.]+ s a round", proc.stderr), proc.stderr[-2000:]
    refused = _run("gpu_suite.py", "--device", "cpu", "--budget-minutes", "-1", "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "--budget-minutes -1: give minutes for the whole run" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_gpu_suite_table_gives_each_paths_median_seconds():
    """The seconds column is the median over the rounds (of two rounds, their mean, not the slower one), with
    the min–max beside it; a CPU's tiny rounds round to the same 2 decimals, so this feeds the table known times."""
    spec = importlib.util.spec_from_file_location("gpu_suite", BENCHMARKS / "gpu_suite.py")
    gpu_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_suite)
    result = {"prompts": 32, "model": "a model", "rounds_timed": 2, "population_batching": {}, "vs_reference": {},
              "of_limit": {}, "seconds": {"reference": [69.1, 75.2], "limit": [1.0, 3.0]},
              "rows_per_call": {"reference": "32", "limit": "960"}, "peak_bytes": {"reference": 2**30, "limit": 2**31}}
    report = {"machine": {"date": "today", "commit": "abc", "gpu": "a GPU", "torch": "2"}, "command": "gpu_suite.py",
              "args": {"dtype": "bfloat16", "rounds": 2, "population": 30, "max_tokens": 64}, "results": [result]}
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in gpu_suite.markdown(report).splitlines()
            if line.startswith("| ") and not line.startswith(("| path", "| ---"))}
    assert rows == {"reference": "72.15 (69.10–75.20)", "limit": "2.00 (1.00–3.00)"}


def test_gpu_suite_cut_short_keeps_the_rounds_it_finished(tmp_path):
    """A device lease can end mid-run: killed in its second timed round, the script has already written the first
    round's figures (JSON and table), and the table says the run stopped before the others."""
    command = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--device", "cpu", "--dtype", "float32", "--model",
               "embedded", "--prompts", "4", "--population", "3", "--max-tokens", "4", "--rounds", "3",
               "--paths", "reference,preset,limit", "--no-demo", "--out", str(tmp_path)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ONE_THREAD)
    seen = []
    try:
        for line in proc.stderr:  # round 2's first path ends after round 1's files were written
            seen.append(line)
            if "4 prompts, round 2: reference" in line:
                break
    finally:
        proc.kill()
        proc.wait()
    assert any("4 prompts, round 2: reference" in line for line in seen), "".join(seen)[-2000:]
    (result,) = json.loads((tmp_path / "gpu_suite.json").read_text())["results"]
    assert result["rounds_timed"] == 1 and all(len(times) == 1 for times in result["seconds"].values())
    assert result["of_limit"]["preset"]["rounds"] == 1
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "only 1 of 3 timed rounds: the run stopped before the others" in table and "| preset |" in table


def test_gpu_lease_script_names_failures_of_a_cut_run_then_writes_the_table(tmp_path):
    """benchmarks/gpu_lease.sh, the one device call of a GPU lease, on a CPU: its test run is cut at PYTEST_S (a
    test still sleeping), yet it counts and names the tests that ended (a failure among them); then gpu_suite's
    table is written with the commit given."""
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text("import time\n\ndef test_ok():\n    pass\n\ndef test_broken():\n    assert 1 == 2\n\n"
                     "def test_slow():\n    time.sleep(300)\n")
    suite = "--device cpu --dtype float32 --model embedded --prompts 4 --population 3 --max-tokens 4 --rounds 1 " \
            "--paths reference,preset,limit --no-demo"
    env = {**ONE_THREAD, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels"), "WORKERS": "0",
           "PYTEST_S": "25", "TESTS": str(probe), "COMMIT": "c0ffee1", "SUITE": suite}
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_lease.sh")], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest exit 124" in proc.stdout and "cut at the cap" in proc.stdout, proc.stdout
    assert "passed 1, failed 1, errors 0, skipped 0" in proc.stdout, proc.stdout
    assert "test_probe.py::test_broken - assert 1 == 2" in proc.stdout  # the -rfE summary printed on SIGINT
    assert "gpu_suite exit 0" in proc.stdout and "commit c0ffee1, CPU" in proc.stdout
    assert "| limit |" in (tmp_path / "out" / "gpu_suite" / "gpu_suite.md").read_text()  # OUT made by the script


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_suite_without_a_gpu_says_so_and_exits_2(tmp_path):
    proc = _run("gpu_suite.py", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr
    assert not (tmp_path / "gpu_suite.json").exists()


def test_throughput_runs_each_round_in_a_fresh_process_and_keeps_every_rounds_records(tmp_path):
    out = tmp_path / "throughput.json"
    proc = _run("throughput.py", "--threads", "1", "--population", "3", "--batch", "4", "--max-tokens", "4",
                "--rounds", "2", "--repeats", "1", "--memory", "", "--paths", "batched-lowrank", "--natural-lengths",
                "--limit-rows", "12", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = re.findall(r"round \d/2 done in process (\d+)", proc.stderr)
    assert len(pids) == 2 and len(set(pids)) == 2, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert {label: len(records) for label, records in summary["rounds"].items()} == {"limit@12": 2, "batched-lowrank": 2}
    ratio = summary["paths"]["batched-lowrank"]["cpu"]["ratio_eval"]
    assert ratio["rounds"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


def test_throughput_measures_memory_of_each_side_in_its_own_process():
    """--rounds 0: only the memory measurements, each in a fresh probe process, each printed with its peak
    against its budget; a probe that fails stops the script with its error instead of a table. The run's
    options reach each probe: 2 prompts per call of 3 members are 6 rows, not the batch's 12."""
    proc = _run("throughput.py", "--threads", "1", "--population", "3", "--batch", "4", "--max-tokens", "4",
                "--batched-mini-batch-size", "2", "--rounds", "0", "--memory", "limit,batched-lowrank",
                "--paths", "batched-lowrank")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^  (\S+) +(\d+) rows/call: peak +(\d+) MiB = .*; (within|OVER)$", proc.stdout, re.M)
    assert [(label, int(count)) for label, count, _, _ in rows] == [("limit@6", 6), ("batched-lowrank", 6)]
    assert all(int(peak) > 100 for _, _, peak, _ in rows)  # torch and a model are resident: not a zero reading
    failed = _run("throughput.py", "--threads", "1", "--population", "3", "--batch", "4", "--max-tokens", "4",
                  "--rounds", "0", "--memory", "no-such-path", "--paths", "batched-lowrank")
    assert failed.returncode == 1 and "memory probe no-such-path failed" in failed.stderr
    assert "rows/call: peak" not in failed.stdout


@pytest.mark.parametrize("script", ["vs_reference.py", "gpu_suite.py"])
def test_an_unknown_path_is_refused_before_measuring(script):
    proc = _run(script, "--paths", "reference,limits")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown path(s) limits; choose from reference,sequential,default,preset,limit" in proc.stderr
    assert "round 1/" not in proc.stderr


def test_vs_reference_refuses_a_raw_json_path_it_could_not_write_before_measuring(tmp_path):
    """Exit 2 with the option and the fix named, before any model is built (not after 20 minutes of rounds)."""
    proc = _run("vs_reference.py", "--raw-json", str(tmp_path / "missing" / "raw.json"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--raw-json" in proc.stderr and "its folder does not exist" in proc.stderr
    assert "round 1/" not in proc.stderr and not (tmp_path / "missing").exists()


@pytest.mark.slow
def test_real_model_benchmark_compares_es_and_grpo_at_one_budget(tiny_model_dir, tmp_path):
    """benchmarks/real_model.py as a user runs it, on the tiny model with a tiny budget: every method trains to
    the same completion budget, is evaluated before and after with labels, sampled pass@k and KL to the base,
    and the table, the JSON and the plot are written."""
    out, plot = tmp_path / "real_model", tmp_path / "real_model.png"
    proc = _run("real_model.py", "--model", str(tiny_model_dir), "--budget", "16", "--seeds", "0", "--lrs", "1e-5",
                "--kl-prompts", "4", "--runs", str(tmp_path / "runs"), "--out", str(out), "--plot", str(plot),
                timeout=900)  # 20 esft processes: 272 s at load 3 on 2 cores
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["method"] for r in result["results"]] == ["es", "es-b8", "grpo-best", "randopt"] and result["best_lr"] == 1e-5
    (randopt,) = [r for r in result["results"] if r["method"] == "randopt"]
    assert 0.0 <= randopt["final_alone"] <= 1.0 and isinstance(randopt["consolidated"], bool)
    assert set(randopt["votes"]) == {"1", "5", "10"} and randopt["votes"]["5"] == randopt["curve"][-1]["accuracy"]
    assert 0.0 <= randopt["vote_sampled"]["pass@1"] <= randopt["vote_sampled"]["pass@4"] <= 1.0
    assert (tmp_path / "runs" / "randopt-b16-s0" / "vote-k10" / "eval" / "metrics.jsonl").is_file()
    for record in result["results"]:
        curve = record["curve"]
        assert curve[0]["completions"] == 0 and curve[-1]["completions"] >= 16
        assert sum(curve[-1]["labels"].values()) == 200  # every held-out answer labelled
        assert 0.0 <= record["sampled"]["pass@1"] <= record["sampled"]["pass@4"] <= 1.0
        assert record["geometry"]["kl_per_token"] >= 0 and record["geometry"]["relative_weight_distance"] >= 0
    assert "| GRPO, best lr |" in proc.stdout and "KL per token" in proc.stdout and plot.stat().st_size > 10_000
    assert "best member alone" in proc.stdout and "vote of 10" in proc.stdout and "pass@1 / pass@4 of the vote" in proc.stdout


@pytest.mark.slow
def test_randopt_benchmark_reads_every_k_from_one_population(tmp_path):
    """benchmarks/randopt.py with a tiny budget and no baselines: K = 1, 5, 10 and the consolidation from one
    scored population, written as JSON and a markdown table."""
    out = tmp_path / "randopt"
    proc = _run("randopt.py", "--budget", "20", "--population", "10", "--seeds", "0", "--eval-size", "4",
                "--skip-baselines", "--runs", str(tmp_path / "runs"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    (seed,) = result["randopt"]
    assert {"randopt-K1", "randopt-K5", "randopt-K10", "randopt-corp", "corp_accepted"} <= set(seed)
    assert seed["completions"] == 10 * 2 + 2 * 2  # members x validation rows, and the gate's two scorings
    assert "RandOpt, vote of K = 10" in out.with_suffix(".md").read_text()


def test_rounding_benchmark_measures_what_each_scheme_keeps(tmp_path):
    """benchmarks/rounding.py on random matrices: the master and error feedback keep the recipe's steps; stochastic
    rounding keeps them on average; rounding to nearest loses most of the paper's smaller ones."""
    out = tmp_path / "rounding.json"
    proc = _run("rounding.py", "--limit", "2", "--steps", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    recipe, paper = result["recipe"]["4"], result["paper"]["4"]
    assert recipe["master"]["cos"] > 0.99 and abs(recipe["feedback"]["error"] - recipe["master"]["error"]) < 0.01
    assert abs(recipe["stochastic"]["survived"] - 1) < 0.01 and abs(paper["stochastic"]["survived"] - 1) < 0.05
    assert paper["nearest"]["survived"] < 0.6 < paper["stochastic"]["survived"]


def test_master_memory_benchmark_reports_each_mode_in_its_own_process():
    proc = _run("master_memory.py", "--dtypes", "bfloat16", "--modes", "inference,none", "--members", "2",
                "--prompts", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row["master_weights"] for row in rows] == ["inference", "none"]
    assert all(row["iteration_mib"] >= row["loaded_mib"] > 100 for row in rows)
    assert rows[0]["survival"] is None and 0.5 < rows[1]["survival"] < 1.5


def test_memory_scale_benchmark_measures_each_method_in_a_watched_child(tmp_path):
    """benchmarks/memory_scale.py on its tiny Llama shape: each method's child reports its peak and seconds, ES and
    GRPO train every parameter; under a limit below what a child needs, the row is a measured "does not fit"."""
    out = tmp_path / "scale.json"
    proc = _run("memory_scale.py", "--shapes", "tiny", "--methods", "generate,es-full,grpo-full", "--threads", "1",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())}
    assert all(row["fits"] and row["peak_mib"] >= row["built_mib"] > 100 and row["seconds"] > 0 for row in rows.values())
    parameters = rows["generate"]["parameters"]
    assert rows["es-full"]["trained"] == rows["grpo-full"]["trained"] == parameters > 100_000
    assert rows["grpo-full"]["peak_mib"] > rows["es-full"]["peak_mib"]  # gradients and AdamW's state
    assert "| tiny | 0M | es-full | fits |" in proc.stdout
    proc = _run("memory_scale.py", "--shapes", "tiny", "--methods", "generate", "--limit-gb", "0.2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    [row] = json.loads(out.read_text())
    assert not row["fits"] and row["verdict"] == "does not fit: passed 0.2 GiB" and row["peak_mib"] > 0.2 * 1024
    proc = _run("memory_scale.py", "--shapes", "13b")
    assert proc.returncode == 2 and "unknown shape '13b'" in proc.stderr


def test_es_design_benchmark_runs_its_cells_at_128_completions_each(tiny_model_dir, tmp_path):
    """benchmarks/es_design.py on a tiny model, one iteration: a shared-prompt cell and a prompt-groups cell, side by
    side on a task of the script's, each spending N·B/G = 128 completions with the √N step (four times the matched α
    in a step4x cell), and a cell whose batch is chosen from 16 candidates (144 completions), with the extras of
    their final models; the table has a row per cell and the extras a row per run."""
    runs, out = tmp_path / "runs", tmp_path / "design"
    proc = _run("es_design.py", "--model", str(tiny_model_dir), "--iterations", "1", "--eval-size", "4", "--cells",
                "8x16/zscore/sigma3e-3,64x16g8/per_prompt_centered/step4x,64x2/zscore/extremes8", "--tasks",
                "word-problems", "--extras-seeds", "0", "--runs", str(runs), "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["task"], r["shape"], r["shaping"], r["variant"], r["sigma"]) for r in results] == [
        ("word-problems", "8x16", "zscore", "sigma3e-3", 3e-3), ("word-problems", "64x16g8", "per_prompt_centered", "step4x", 0.01),
        ("word-problems", "64x2", "zscore", "extremes8", 0.01)]
    for r in results:
        screened = 16 if r["variant"] == "extremes8" else 0  # 8 candidates per prompt of the batch
        assert [p["iteration"] for p in r["curve"]] == [0, 1] and r["curve"][-1]["completions"] == 128 + screened
        assert r["peak_rss_mb"] > 100 and r["update_ratio"] >= 0
        extras = r["extras"]
        assert set(extras["other_tasks"]) == set(extras["other_tasks_base"]) == {"times-table", "arithmetic"}
        assert 0 <= extras["correct_given_format"] <= 1 and 0 <= extras["sampled"]["pass@1"] <= extras["sampled"]["pass@4"] <= 1
        assert extras["geometry"]["relative_weight_distance"] >= 0 and extras["geometry"]["kl_per_token"] >= 0
    config = (runs / "word-problems-64x16g8-per_prompt_centered-step4x-s0" / "config.yaml").read_text()
    assert "prompt_groups: 8" in config and "step_rule: sqrt_n" in config and "population_size: 64" in config
    assert "max_tokens: 32" in config and "task: word-problems" in config and "alpha: 0.00707107" in config
    assert "| 8 × 16 | z-score | sigma3e-3 | 0 | 0.003 |" in proc.stdout and "| 64 × 16 (8 groups) | centred | step4x | 0 |" in proc.stdout
    assert "| word-problems | 8 × 16 | z-score | sigma3e-3 | 0 |" in proc.stdout  # the extras' row
    config = (runs / "word-problems-64x2-zscore-extremes8-s0" / "config.yaml").read_text()
    assert "prompt_candidates: 8" in config and "prompt_choice: extremes" in config
    assert "| 64 × 2 | z-score | extremes8 | 0 | 0.01 | " in proc.stdout and " | 144 | " in proc.stdout
    refused = _run("es_design.py", "--model", str(tiny_model_dir), "--cells", "64x16g8/per_prompt,8x16/zscore/big")
    assert refused.returncode != 0 and "unknown cells ['64x16g8/per_prompt', '8x16/zscore/big']" in refused.stderr
    refused = _run("es_design.py", "--model", str(tiny_model_dir), "--tasks", "countdown")
    assert refused.returncode != 0 and "unknown tasks ['countdown']" in refused.stderr


def test_es_design_against_grpo_runs_both_side_by_side_and_reads_es_at_grpos_seconds(tiny_model_dir, tmp_path):
    """Stage (d) on a tiny model and --tasks arithmetic: GRPO (2 steps) and the default design (2 iterations) started
    together; the table reads ES's accuracy at GRPO's training seconds and at three times them from ES's own curve."""
    pytest.importorskip("trl", reason="the grpo extra (the README's test command has it)")
    runs, out = tmp_path / "runs", tmp_path / "d"
    proc = _run("es_design.py", "--model", str(tiny_model_dir), "--against-grpo", "--grpo-steps", "2",
                "--grpo-es-iterations", "2", "--grpo-es-sigma", "0.05", "--eval-size", "4", "--tasks", "arithmetic",
                "--runs", str(runs), "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (pair,) = json.loads(out.with_suffix(".json").read_text())["pairs"]
    assert pair["task"] == "arithmetic"
    assert [p["completions"] for p in pair["grpo"]["curve"]] == [0, 8, 16]  # evaluated every step: 8 completions each
    assert [p["completions"] for p in pair["es"]["curve"]] == [0, 128, 256]
    config = (runs / "arithmetic-default-i2-s0" / "config.yaml").read_text()
    assert "task: arithmetic" in (runs / "arithmetic-grpo-lr1e-05-s0" / "config.yaml").read_text()
    assert "task: arithmetic" in config and "population_size: 64" in config and "batch_size: 2" in config
    assert "step_rule: sqrt_n" in config
    assert "sigma: 0.05" in config
    assert "| arithmetic | 0 | " in proc.stdout and "- arithmetic, seed 0, grpo: " in proc.stdout
    for name in ("grpo", "es"):  # wrong answers counted from the run's own evaluation files (both ran 2 iterations)
        wrong = pair[name]["wrong_answers"]
        assert [wrong["first"]["iteration"], wrong["last"]["iteration"]] == [0, 2]
        for when in ("first", "last"):
            assert 0 <= wrong[when]["cut_short"] <= wrong[when]["wrong"] <= 4
        first = wrong["first"]
        said = f"- arithmetic, seed 0, {name}: {first['wrong']} at iteration 0 ({first['cut_short']} cut short)"
        assert said in proc.stdout

