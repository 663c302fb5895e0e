"""`--algorithm randopt`: the vote and the consolidation on answers that are known, a resume that does
not score members again, the command line (files, exit codes, esft eval of the ensemble)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from esft.engines.base import Generation
from esft.engines.transformers_engine import TransformersEngine
from esft.randopt.selection import consolidation_weights, top_k, validation_indices, vote
from esft.randopt.trainer import CHUNK, RandOptTrainer
from esft.runs.randopt_record import RecordError
from esft.runs.metric_keys import entry_for
from esft.settings.config import ConfigError, ESConfig
from esft.tasks.base import TaskError
from esft.tasks.countdown import final_answer as countdown_answer
from esft.tasks.arithmetic import final_answer as arithmetic_answer
from esft.tasks.math_grading import final_answer as math_answer
from test_cli import assert_user_error, esft, esft_process, read_jsonl, safetensors_of
from toy_task import byte_reward, exact_answer, toy_rows

QUIET = dict(max_tokens=3, eval_batch_size=8, progress=False, logging="none", reward_sandbox=False)


# ----------------------------------------------------------------------------- the math, on known answers
def test_the_vote_takes_the_majority_answer_and_breaks_ties_by_rank():
    answers = [["3", "4", None, "a", None],  # members best first
               ["7", "4", None, "b", None],
               ["7", "5", "9", "c", None]]
    # 7 beats the best member's 3; 4 has two votes; 9 is the only answer; a three-way tie goes to the best
    # member; nobody answers: the best member
    assert vote(answers) == [1, 0, 2, 0, 0]
    with pytest.raises(ValueError):
        vote([])


def test_tasks_extract_the_answer_members_vote_on():
    from esft.tasks import TASKS

    assert all(TASKS[name](train_size=2, eval_size=2).answer for name in ("countdown", "arithmetic", "times-table"))
    assert countdown_answer("x</think>\n<answer> (1 + 2) * 3 </answer>") == "(1+2)*3"
    assert countdown_answer("no answer") is None
    assert arithmetic_answer("It is 1,410.") == "1410" and arithmetic_answer("none") is None
    assert math_answer("so \\boxed{\\dfrac{1}{2}}.") == math_answer("\\boxed{\\frac{1}{2}}") and math_answer("2") is None


def test_top_k_and_the_consolidation_weights():
    members = [{"seed": s, "reward": r} for s, r in [(1, 0.2), (2, 0.9), (3, 0.5), (4, 0.9)]]
    assert [m["seed"] for m in top_k(members, 3)] == [2, 4, 3]  # equal rewards: the earlier seed first
    weights = consolidation_weights([0.9, 0.9, 0.5])
    assert sum(weights) == pytest.approx(1.0) and weights[0] == weights[1] > weights[2] > 0
    assert consolidation_weights([0.3, 0.3]) == [0.5, 0.5]
    assert validation_indices(100, 5, 0) == validation_indices(100, 5, 0) != validation_indices(100, 5, 1)


def test_randopt_settings_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="randopt-top-k.*K <= N"):
        ESConfig(algorithm="randopt", population_size=4, randopt_top_k=5)
    with pytest.raises(ConfigError, match="--batch-size.*randopt"):
        ESConfig(algorithm="randopt", batch_size=4)
    with pytest.raises(ConfigError, match="--validation-size.*--algorithm randopt"):
        ESConfig(validation_size=8)


# ----------------------------------------------------------------------------- a trainer on a tiny model
def toy_trainer(model_dir, tmp_path, **settings) -> RandOptTrainer:
    args = ESConfig(algorithm="randopt", output_dir=str(tmp_path), **(QUIET | {"sigma": 0.05} | settings))
    return RandOptTrainer(str(model_dir), reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(12),
                          eval_dataset=toy_rows(3, start=1000), accuracy_func=exact_answer)


def test_the_vote_answers_right_where_the_best_member_alone_is_wrong(tiny_model_dir, tmp_path, one_torch_thread):
    trainer = toy_trainer(tiny_model_dir, tmp_path, iterations=0)
    trainer.task.answer = lambda text: text.strip() or None
    written = {11: ["1", "2000", "4004"], 12: ["2000", "2002", ""], 13: ["2000", "2002", "9"]}  # the answers: 2000, 2002, 2004
    trainer._member_generations = lambda seeds, prompts, *_: [Generation(written[s], [1] * len(prompts)) for s in seeds]
    trainer.kept = [{"seed": 11, "reward": 0.9}, {"seed": 12, "reward": 0.8}, {"seed": 13, "reward": 0.7}]
    assert trainer.evaluate(0)["eval/heldout/accuracy"] == pytest.approx(2 / 3)  # the best member alone: 0/3
    trainer.task.answer = None  # a task without an answer to vote on: the best member alone
    assert trainer.evaluate(0)["eval/heldout/accuracy"] == 0.0
    trainer.close()


def test_a_finished_run_votes_again_with_any_k_of_its_scored_members_greedy_or_sampled(tiny_model_dir, tmp_path,
                                                                                     one_torch_thread):
    run = tmp_path / "run"
    run.mkdir()
    members = [{"seed": 14, "reward": 0.1}, {"seed": 11, "reward": 0.9}, {"seed": 13, "reward": 0.7}, {"seed": 12, "reward": 0.8}]
    (run / "randopt.json").write_text(json.dumps({"format": 1, "members": members, "kept": members[1:2]}))
    greedy = {11: ["1", "2000", "4004"], 12: ["2000", "2002", ""], 13: ["2000", "2002", "9"], 14: ["0", "0", "0"]}
    # two samples per prompt (prompt by prompt): the vote of sample j is taken over the members' sample j
    sampled = {11: ["1", "2000", "2002", "5", "x", "y"], 12: ["1", "2000", "2002", "6", "z", "w"],
               13: ["3", "7", "8", "2002", "2004", "q"], 14: ["0"] * 6}
    found = {}
    for k, samples in [(1, 1), (3, 1), (3, 2)]:
        trainer = toy_trainer(tiny_model_dir, tmp_path, iterations=0, population_size=4, randopt_top_k=k,
                              eval_samples=samples, temperature=1.0 if samples > 1 else 0.0)
        trainer.load_record(run)  # the record keeps 1 member; --randopt-top-k takes the best k of the 4 scored
        assert [m["seed"] for m in trainer.kept] == [11, 12, 13][:k]
        trainer.task.answer = lambda text: text.strip() or None
        written = greedy if samples == 1 else sampled
        trainer._member_generations = lambda seeds, *_: [Generation(written[s], [1] * len(written[s])) for s in seeds]
        found[k, samples] = trainer.evaluate(0)
        trainer.close()
    assert found[1, 1]["eval/heldout/accuracy"] == 0.0 and found[3, 1]["eval/heldout/accuracy"] == pytest.approx(2 / 3)
    # votes: 1 (wrong), 2000 | 2002, 5 (a tie: the best member's) | x (a tie), y: pass@1 = 1/3, pass@2 = 2/3
    assert found[3, 2]["eval/heldout/pass@1"] == pytest.approx(1 / 3)
    assert found[3, 2]["eval/heldout/pass@2"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("record, expected", [  # issue 66, case 5: each was a traceback or accepted
    ([], "is not a randopt record of format 1"),
    ({"format": 1, "members": [{"seed": 2**200, "reward": 0.5}]}, "is no member esft scored"),
    ({"format": 1, "members": [{"seed": 3, "reward": float("nan")}]}, "is no member esft scored"),
    ({"format": 1, "members": [{"seed": i, "reward": 0.5} for i in range(5)]}, "holds 5 members for a population of 4"),
])
def test_a_record_that_is_no_runs_own_is_refused_in_one_line(record, expected, tiny_model_dir, tmp_path,
                                                            one_torch_thread):
    run = tmp_path / "run"
    run.mkdir()
    (run / "randopt.json").write_text(json.dumps(record))
    trainer = toy_trainer(tiny_model_dir, tmp_path, iterations=0, population_size=4, randopt_top_k=2)
    with pytest.raises(RecordError, match=expected):
        trainer.load_record(run)
    trainer.close()


def test_the_members_sigma_is_the_runs_not_the_records(tiny_model_dir, tmp_path, one_torch_thread):
    """randopt.json's own "sigma" (outside the signature) no longer overrides the run's σ."""
    run = tmp_path / "run"
    run.mkdir()
    members = [{"seed": 11, "reward": 0.9}, {"seed": 12, "reward": 0.8}]
    (run / "randopt.json").write_text(json.dumps({"format": 1, "members": members, "sigma": 1e300}))
    trainer = toy_trainer(tiny_model_dir, tmp_path, iterations=0, population_size=4, randopt_top_k=2)
    trainer.load_record(run)
    prompts = [row["prompt"] for row in toy_rows(2, start=1000)]
    voted = trainer._member_generations([11], prompts, None, None)
    reference = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=3)
    reference.perturb(11, 0.05)  # toy_trainer's σ
    assert voted[0].texts == reference.generate(prompts).texts
    trainer.close()


@pytest.mark.parametrize("merged_beats_base", [True, False])
def test_consolidation_is_final_only_when_it_beats_the_base(tiny_model_dir, tmp_path, one_torch_thread,
                                                            merged_beats_base):
    trainer = toy_trainer(tiny_model_dir, tmp_path, population_size=6, randopt_top_k=3, validation_size=2)
    scores = iter([0.5, 0.9 if merged_beats_base else 0.1])  # the base's validation reward, then the merged model's
    trainer._validation_reward = lambda: (next(scores), 2, 6)
    trainer.train()
    record = json.loads((trainer.run_dir / "randopt.json").read_text())
    kept, consolidation = record["kept"], record["consolidation"]
    assert len(record["members"]) == 6 and len(kept) == 3 and consolidation["accepted"] is merged_beats_base
    # final/ = base + σ·Σ wᵢ·εᵢ over the kept members (accepted), else base + σ·ε(best)
    seeds, weights = [m["seed"] for m in kept], consolidation["weights"]
    expected = (seeds, [0.05 * w for w in weights]) if merged_beats_base else (seeds[:1], [0.05])
    base = trainer.engine.master_state()
    trainer.engine.update(*expected, 1.0)
    final = safetensors_of(trainer.run_dir / "final")
    for name, tensor in trainer.engine.master_state().items():
        assert torch.equal(final[name], tensor), name
    trainer.engine.load_master_state(base)
    rows = read_jsonl(trainer.run_dir / "metrics.jsonl")
    assert rows[-1]["randopt/consolidated"] == float(merged_beats_base)
    assert rows[-1]["budget/completions"] == 6 * 2 + 4  # members x validation rows, and the consolidation's gate
    trainer.close()


def test_a_resumed_run_does_not_score_its_members_again(tiny_model_dir, tmp_path, one_torch_thread):
    population = CHUNK + 4
    trainer = toy_trainer(tiny_model_dir, tmp_path, population_size=population, validation_size=1, run_name="r",
                          randopt_consolidate=False)
    evaluate, calls = trainer.executor.evaluate_population, []

    def killed_in_the_second_chunk(seeds, batch, sigma=None):
        if calls:
            raise KeyboardInterrupt
        calls.append(list(seeds))
        return evaluate(seeds, batch, sigma)

    trainer.executor.evaluate_population = killed_in_the_second_chunk
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert len(json.loads((tmp_path / "r" / "randopt.json").read_text())["members"]) == CHUNK
    trainer.close()

    resumed = toy_trainer(tiny_model_dir, tmp_path, population_size=population, validation_size=1,
                          randopt_consolidate=False, resume=str(tmp_path / "r"))
    scored = []
    evaluate = resumed.executor.evaluate_population
    resumed.executor.evaluate_population = lambda seeds, *a: scored.extend(seeds) or evaluate(seeds, *a)
    resumed.train()
    record = json.loads((tmp_path / "r" / "randopt.json").read_text())
    assert len(scored) == population - CHUNK and len(record["members"]) == population
    assert [m["seed"] for m in record["members"][:CHUNK]] == calls[0] and scored == [m["seed"] for m in record["members"][CHUNK:]]
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == [0, 1, 2] and rows[-1]["budget/completions"] == population
    resumed.close()

    untouched = ("config.yaml", "status.json", "report.html", "metrics.jsonl", "randopt.json")
    before = {name: (tmp_path / "r" / name).read_bytes() for name in untouched}
    listing = sorted(p.name for p in (tmp_path / "r").iterdir())
    other = toy_trainer(tiny_model_dir, tmp_path, population_size=population, validation_size=1, sigma=0.1,
                        randopt_consolidate=False, resume=str(tmp_path / "r"))
    with pytest.raises(TaskError, match="sigma=0.05, this run has 0.1"):  # other members: never mixed in
        other.train()
    other.close()
    # refused: the run's settings, status, report, rows and record are as they were, nothing set aside
    assert {name: (tmp_path / "r" / name).read_bytes() for name in untouched} == before
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == listing
    # a record written before --strategy says mirroring as antithetic: true/false, read as the strategy it names
    path = tmp_path / "r" / "randopt.json"
    record = json.loads(path.read_text())
    assert record["settings"].pop("strategy") == "paper"
    path.write_text(json.dumps(record | {"settings": record["settings"] | {"antithetic": True}}))
    mirrored = toy_trainer(tiny_model_dir, tmp_path, population_size=population, validation_size=1,
                           randopt_consolidate=False, resume=str(tmp_path / "r"))
    with pytest.raises(TaskError, match="strategy='antithetic', this run has 'paper'"):
        mirrored.train()
    mirrored.close()


def test_the_completion_budget_ends_the_scoring_at_the_member_it_allows(tiny_model_dir, tmp_path, one_torch_thread):
    trainer = toy_trainer(tiny_model_dir, tmp_path, population_size=CHUNK, validation_size=2, budget_completions=7,
                          randopt_top_k=2, randopt_consolidate=False)
    trainer.train()  # 3 members of 2 validation rows fit in 7 completions; a 4th, one at a time, reaches it
    assert len(trainer.record["members"]) == 4 and len(trainer.kept) == 2
    assert read_jsonl(trainer.run_dir / "metrics.jsonl")[-1]["budget/completions"] == 8
    assert json.loads((trainer.run_dir / "status.json").read_text())["status"] == "stopped: budget"
    trainer.close()


# ----------------------------------------------------------------------------- the command line
def test_esft_train_randopt_writes_seeds_scores_and_a_model_and_esft_eval_votes(tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    flags = ["--model", str(tiny_model_dir), "--task", "arithmetic", "--population-size", "4", "--randopt-top-k", "2",
             "--validation-size", "2", "--max-tokens", "3", "--eval-size", "3", "--no-progress", "--logging", "none",
             "--sigma", "0.05"]
    proc, _ = esft_process("train", "--algorithm", "randopt", *flags, "--output-dir", str(tmp_path), "--run-name", "r",
                           cwd=tmp_path)  # RandOpt's path end to end, as a user runs it; the rest in this process
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "r"
    record = json.loads((run / "randopt.json").read_text())
    assert [set(m) for m in record["members"]] == [{"seed", "reward"}] * 4 and len(record["kept"]) == 2
    AutoModelForCausalLM.from_pretrained(run / "final")
    keys = {key for row in read_jsonl(run / "metrics.jsonl") for key in row}
    assert {"budget/completions", "randopt/consolidated", "eval/heldout/accuracy"} <= keys
    assert sorted(key for key in keys if entry_for(key) is None) == []  # the metrics reference documents them
    proc, _ = esft("eval", "--model", str(run), "--randopt-top-k", "3", "--output-dir", str(tmp_path / "evals"),
                   "--no-progress", "--logging", "none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # the run kept 2; eval re-votes with the best 3 of the 4 scored
    assert "the vote of the best 3 of 4 members" in proc.stderr and "heldout accuracy" in proc.stdout

    def no_model(*_):
        raise AssertionError("the model was loaded before the record was checked")

    monkeypatch.setattr(RandOptTrainer, "_build_engine", no_model)  # a record that is not this run's: before the model
    proc, _ = esft("train", "--resume", str(run), "--seed", "7", cwd=tmp_path)
    assert_user_error(proc, "randopt.json was scored with seed=0, this run has 7")
    proc, _ = esft("eval", "--model", str(run), "--seed", "7", "--output-dir", str(tmp_path / "evals"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr  # after the line of inherited settings
    assert proc.stderr.strip().splitlines()[-1].startswith("esft: error: ") and "scored with seed=0, this run has 7" in proc.stderr
    monkeypatch.undo()

    started = time.perf_counter()
    proc, _ = esft("train", "--algorithm", "randopt", *flags, "--randopt-top-k", "5", "--output-dir", str(tmp_path),
                   cwd=tmp_path)
    assert_user_error(proc, "--randopt-top-k", "K <= N")
    assert time.perf_counter() - started < 30 and not list(tmp_path.glob("arithmetic-*"))  # before any run or model


def test_the_config_reference_describes_the_randopt_fields():
    fields = {f.name: f for f in dataclasses.fields(ESConfig)}
    for name in ("randopt_top_k", "validation_size", "randopt_consolidate"):
        assert fields[name].metadata["group"] == "RandOpt" and fields[name].metadata["help"]
