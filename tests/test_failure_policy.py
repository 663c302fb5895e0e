"""What a failed reward sample counts in the ES update (issue 50, item 3): --failed-samples omit (the
default: left out of its member's mean) or fill (--failure-reward), measured in
benchmarks/failure_policy.py; here the numbers of each policy, the setting, and real runs of the CLI
on a tiny model with a reward that raises on 10% of samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from esft.es.fitness import FAILED_SAMPLES, Fitness
from esft.es.shaping import REWARD_SHAPING
from esft.loop.member_fitness import fitness_of, reward_matrix
from esft.rewards.runner import score
from esft.settings.config import ESConfig
from esft.settings.rules import CHOICES, ConfigError
from tiny_model import subprocess_env

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
ROWS = [{"prompt": f"p{i}"} for i in range(4)]


def table(prompts, completions, **kwargs):
    """A completion is its reward ("1.5"), or fails ("FAIL": NaN, a failure), or is not scored ("NONE")."""
    return [None if c == "NONE" else float("nan") if c == "FAIL" else float(c) for c in completions]


def broken(prompts, completions, **kwargs):
    raise RuntimeError("down")


def member_rewards(batches, policy: str) -> list[float]:
    return fitness_of(batches, policy).member.tolist()


def members(*batches: str, funcs=(table,)):
    return [score(list(funcs), ROWS, batch.split(), failure_reward=-5.0) for batch in batches]


def test_a_member_mean_with_a_failed_sample_under_each_policy():
    batches = members("1 2 FAIL 3", "2 2 2 2", "FAIL FAIL FAIL FAIL", "4 NONE 4 FAIL")
    assert member_rewards(batches, "fill") == [(1 + 2 - 5 + 3) / 4, 2.0, -5.0, (4 + 4 - 5) / 3]
    omitted = member_rewards(batches, "omit")
    assert omitted[:2] + omitted[3:] == [2.0, 2.0, 4.0]  # the failed sample is not in the mean
    assert omitted[2] == pytest.approx(8 / 3)  # no sample left: the others' mean, so z-scoring gives it 0
    assert REWARD_SHAPING["zscore"](Fitness.of_members(omitted))[2] == pytest.approx(0.0, abs=1e-12)
    # per_prompt follows the same policy: the failed entry is left out of its prompt (NaN) or holds -5
    assert np.isnan(reward_matrix(batches, "omit")[0, 2]) and reward_matrix(batches, "fill")[0, 2] == -5.0
    assert np.isnan(reward_matrix(batches, "fill")[3, 1])  # unscored (None) is left out under both
    # without failures both are Scores.mean to the bit; a batch nobody scored gets the failure reward
    clean = members("0.1 0.2 0.7 NONE", "0.3 0.3 0.3 0.3")
    assert member_rewards(clean, "omit") == member_rewards(clean, "fill") == [s.mean() for s in clean]
    assert member_rewards(members("NONE NONE NONE NONE", "NONE NONE NONE NONE"), "omit") == [-5.0, -5.0]
    # a function that failed everywhere (run on under --reward-skip-failing) is held against no sample
    skipped = members("1 2 FAIL 3", "2 2 2 2", funcs=(table, broken))
    assert member_rewards(skipped, "omit") == [(1 - 5 + 2 - 5 + 3 - 5) / 3, -3.0]
    assert member_rewards(skipped, "fill") == [(1 + 2 - 5 + 3) / 4 - 5, -3.0]


def test_the_setting_defaults_to_omit_and_refuses_other_values():
    assert FAILED_SAMPLES is CHOICES["failed_samples"] and ESConfig().failed_samples == "omit"
    assert ESConfig(failed_samples="fill").failed_samples == "fill"
    with pytest.raises(ConfigError, match="--failed-samples.*omit, fill"):
        ESConfig(failed_samples="zero")
    with pytest.raises(ConfigError, match="failed-samples"):  # GRPO has no member means: refused, not ignored
        ESConfig(algorithm="grpo", failed_samples="fill")


FLAKY = '''
import random

def flaky(prompts, completions, **kwargs):
    """Length / 100, and an exception on about 10% of samples (each sample is retried alone once the
    batch call fails: these are the ones that fail again)."""
    if any(random.random() < 0.1 for _ in completions):
        raise RuntimeError("flaky reward service")
    return [len(c) / 100 for c in completions]
'''


def test_a_tiny_model_trains_through_a_flaky_reward_under_each_policy(tiny_model_dir, tmp_path):
    """The CLI from another directory, a reward file raising on ~10% of samples, --failure-reward -100:
    both policies train every iteration and report the failures; under omit no member's fitness
    ever holds a -100 (reward/min ≥ 0), under fill every iteration with a failure has one far below 0."""
    work = tmp_path / "user"
    work.mkdir()
    (work / "flaky.py").write_text(FLAKY)
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + {i} ="}) + "\n" for i in range(8)))
    runs = {}
    for policy in ("default", "fill"):
        argv = [sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data", "train.jsonl",
                "--eval-data", "train.jsonl", "--reward-funcs", "flaky.py:flaky", "--population-size", "4",
                "--batch-size", "8", "--iterations", "3", "--max-tokens", "4", "--sigma", "0.05",
                "--failure-reward", "-100", "--logging", "none", "--no-progress", "--save-every", "0",
                "--output-dir", str(tmp_path / "runs"), "--run-name", policy,
                *(("--failed-samples", policy) if policy != "default" else ())]
        proc = subprocess.run(argv, cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run_dir = tmp_path / "runs" / policy
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        training = [row for row in rows if "reward/mean" in row]
        assert [row["iteration"] for row in training] == [1, 2, 3]
        failed = sum(row["reward/errors"] for row in training)
        assert failed > 0  # 96 samples at 10%: none failing has odds of 4e-5
        assert f"failed on {failed} of 96 samples (first: RuntimeError: flaky reward service" in proc.stderr
        assert f"reward failures: {failed} samples" in proc.stdout
        assert f"failed_samples: {'omit' if policy == 'default' else 'fill'}" in (run_dir / "config.yaml").read_text()
        runs[policy] = training
    assert all(row["reward/min"] >= 0 for row in runs["default"])
    assert all(row["reward/min"] < -5 for row in runs["fill"] if row["reward/errors"])
    assert any(row["reward/errors"] for row in runs["fill"])
    bad = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--failed-samples", "zero"], cwd=work,
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--failed-samples" in bad.stderr and "omit" in bad.stderr


def test_the_benchmark_script_measures_both_policies_on_every_scenario(tmp_path):
    """benchmarks/failure_policy.py as a user runs it (a subprocess, 5 seeds): every scenario and shaping
    gets both policies' cosines, and when whole member batches fail, omit is the closer one (95% of 200
    seeds in docs/benchmarks.md; its seeds are fixed, so 5 are the same 5 each time)."""
    out = tmp_path / "policy.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "failure_policy.py"), "--seeds", "5", "--rewards", "binary",
                           "--json", str(out)], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads(out.read_text())["tables"]["binary"]
    assert len(table) == 6 and all(set(row) == {"zscore", "rank", "per_prompt"} for row in table.values())
    for row in (cell for row in table.values() for cell in row.values()):
        assert all(-1 <= row[policy][q] <= 1 for policy in FAILED_SAMPLES for q in ("p10", "median", "p90"))
    whole = table["whole batches (10% of members)"]["zscore"]
    assert whole["omit"]["median"] > whole["fill"]["median"] + 0.1
    assert "| whole batches (10% of members) | zscore |" in proc.stdout
