"""`--algorithm randopt`: N seeded perturbations scored once on a validation split, the best K kept
(their seeds and scores in randopt.json), held-out answers by their majority vote, and final/ the
best member or, when it beats the base on the validation split, their consolidation
(esft.randopt.selection says which rules, with their sources).

The loop, on one screen: seeds = ask(seed, iteration 0, N) → chunks of CHUNK members scored on the
validation rows through the executor (population-batched as ES's members are) → each chunk appended to
randopt.json and logged as a metrics row (budget/* as ES and GRPO count them) → top K → the consolidated
model scored on the validation rows against the base → final/ → the held-out evaluation by vote.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from esft import console
from esft.console import progress_bar, report_accuracy, say
from esft.engines.base import Generation, Sampling, perturbed
from esft.es.strategies import STRATEGIES, ESState
from esft.es.strategies.base import SEED_RANGE
from esft.es.batches import PromptBatch
from esft.loop.iteration_metrics import budget_spent, iteration_row
from esft.loop.member_fitness import fitness_of
from esft.loop.reward_faults import count_failures, failure_summary, stop_if_unscorable
from esft.randopt.selection import consolidation_weights, top_k, validation_indices, vote
from esft.rewards.runner import RewardFunc
from esft.runs.metrics import MetricsLogger
from esft.runs.randopt_record import (IDENTITY, MEMBERS, RECORD_FILE, RecordError, check_identity, identity_of,
                                      read_record, record_path, write_record)
from esft.settings.config import ConfigError, ESConfig, es_config
from esft.settings.rules import shown
from esft.tasks.base import Task, TaskError
from esft.trainer import ESTrainer

CHUNK = 16
"""Members scored per chunk (one record write and one metrics row each): 16 members x 64 validation rows
is about the 1024 rows one batched generate call takes on CPU (esft.engines.sizing), so chunking costs no
speed, and a kill loses at most one chunk's work."""


def check_members(record: dict[str, Any], where: str, population_size: int) -> None:
    """RecordError unless the record's members are what this run could have scored: at most --population-size of
    them, each seed one the strategies draw (|seed| < SEED_RANGE, a mirrored one negative), each reward finite."""
    members = record["members"]
    if len(members) > population_size:
        raise RecordError(f"{where} holds {len(members)} members for a population of {population_size}: it is not "
                          "this run's record; start a new run")
    for member in members:
        seed, reward = member["seed"], member["reward"]
        if isinstance(seed, bool) or not -SEED_RANGE <= seed < SEED_RANGE or not math.isfinite(float(reward)):
            raise RecordError(f"{where}: member {shown(member)} is no member esft scored (a seed in "
                              f"[-{SEED_RANGE}, {SEED_RANGE}) and a finite reward); start a new run")


def checked_record(path: Any, args: ESConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """The record at `path` (a run directory or its randopt.json), read and checked against the settings
    `names` of `args` and its population (RecordError saying why it is not this run's)."""
    record, where = read_record(path), str(record_path(path) or path)
    check_identity(record, args.to_dict(), where, names)
    check_members(record, where, args.population_size)
    return record


def resumed_record(run_dir: Any, args: ESConfig) -> dict[str, Any] | None:
    """The record a resumed run directory holds (None: none), checked as this run's (every IDENTITY setting)."""
    if record_path(run_dir) is None:
        return None
    return checked_record(run_dir, args, IDENTITY)


class RandOptTrainer(ESTrainer):
    """RandOpt with ESTrainer's interface, task, rewards, evaluation and run directory; `args.algorithm`
    must be "randopt". After train(), `kept` holds the K members (seed, reward), best first, and
    evaluate() answers by their vote. `kept` may also be set from a record (`load_record`) to evaluate
    a finished run's ensemble, as `esft eval --model RUN_DIR` does."""

    def __init__(self, model: Any = None, reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
                 args: ESConfig | None = None, record: Any = None, **kwargs: Any):
        """ESTrainer's arguments; `record`: a RandOpt record (a run directory or its randopt.json) whose kept
        members vote, as load_record. Both that record and the record of a resumed `run` are checked before the
        model loads (RecordError)."""
        args = es_config(args, algorithm="randopt")
        if args.algorithm != "randopt":
            raise ConfigError("algorithm", f"RandOptTrainer runs --algorithm randopt, got {args.algorithm!r}")
        self.kept: list[dict[str, Any]] = []
        """The voting members, best first (empty: evaluate() evaluates the weights as they are)."""
        self.record: dict[str, Any] = {}
        if kwargs.get("run") is not None:
            resumed_record(kwargs["run"].path, args)
        voters = checked_record(record, args, MEMBERS) if record is not None else None
        super().__init__(model, reward_funcs, args, **kwargs)
        if voters is not None:
            self._vote_with(voters, record)

    def _build_task(self, *task_args: Any) -> Task:
        """ESTrainer's task, and its validation rows (before any model loads: a bad size is one line)."""
        task = super()._build_task(*task_args)
        size, rows = self.args.validation_size, len(task.train_dataset)
        if self.args.iterations > 0 and size > rows:
            raise TaskError(f"--validation-size {size}: the validation split is drawn from the {rows} training rows; "
                            f"use at most {rows}, or more training data (--train-size)")
        self.validation = [task.train_dataset[i] for i in validation_indices(rows, size, self.args.seed)] if size <= rows else []
        return task

    def load_record(self, path: Any) -> None:
        """Vote with the best --randopt-top-k members of a RandOpt record (a run directory or its randopt.json),
        whose settings must be these (RecordError otherwise)."""
        self._vote_with(checked_record(path, self.args, MEMBERS), path)

    def _vote_with(self, record: dict[str, Any], path: Any) -> None:
        # the best K of every scored member, K = --randopt-top-k (the run's unless given): K = 1, 5, 10 of one run
        # are compared without scoring anything again (top_k is a function of the scores, so the run's own K
        # selects the members its record keeps)
        self.record, self.kept = record, top_k(record["members"], self.args.randopt_top_k)
        scored = len(record["members"])
        voters = (f"the vote of the best {len(self.kept)} of {scored} members" if self.task.answer is not None
                  else f"the best of {scored} members (the task has no answer to vote on)")
        print(f"esft: evaluating {voters} scored in {path} (--randopt-top-k {self.args.randopt_top_k})", file=sys.stderr)

    # ------------------------------------------------------------- evaluation
    def evaluate(self, iteration: int | None = None) -> dict[str, float]:
        """ESTrainer.evaluate; with members kept, each held-out completion is the majority vote of the
        kept members' (the task's `answer` extracts what they vote on), or the best member's alone
        for a task without one."""
        if not self.kept:
            return super().evaluate(iteration)
        generate, self.executor.generate = self.executor.generate, self._voted_generate
        try:
            return super().evaluate(iteration)
        finally:
            self.executor.generate = generate

    def _voted_generate(self, prompts: Sequence[str], mini_batch_size: int | None = None,
                        sampling: Sampling | None = None) -> Generation:
        voters = self.kept if self.task.answer is not None else self.kept[:1]
        generations = self._member_generations([m["seed"] for m in voters], prompts, mini_batch_size, sampling)
        answers = [[self.task.answer(text) if self.task.answer else None for text in g.texts] for g in generations]
        winners = vote(answers)
        chosen = [generations[w] for w in winners]
        ids = None if any(g.token_ids is None for g in chosen) else [g.token_ids[j] for j, g in enumerate(chosen)]
        return Generation([g.texts[j] for j, g in enumerate(chosen)], [g.num_tokens[j] for j, g in enumerate(chosen)], ids)

    def _member_generations(self, seeds: list[int], prompts: Sequence[str], mini_batch_size: int | None,
                            sampling: Sampling | None) -> list[Generation]:
        """Each member's completions of `prompts`: in batched generate calls where the executor batches
        members (greedy), else one member at a time (perturb → generate → restore)."""
        sigma = self.args.sigma  # the run's (signed) σ, which check_identity compared with the record's
        if getattr(self.executor, "population_batching", False) and (sampling is None or sampling.greedy):
            from esft.engines.population import generate_population, population_batching_problem

            # batched here only where this process holds the model (with --executor ray the actors do)
            if population_batching_problem(self.engine) is None:
                return generate_population(self.engine, list(prompts), seeds, sigma, mini_batch_size)
        generations = []
        for seed in seeds:
            with perturbed(self.engine, seed, sigma):
                generations.append(self.engine.generate(prompts, mini_batch_size=mini_batch_size, sampling=sampling))
        return generations

    def _validation_reward(self) -> tuple[float, int, int]:
        """The current weights' fitness on the validation rows (greedy, as members are scored), with the
        completions and tokens it took."""
        rows = self.validation
        generation = self.engine.generate([row["prompt"] for row in rows], mini_batch_size=self.args.eval_batch_size)
        scores = self.rewards.score(rows, generation.texts, generation.token_ids)
        return float(fitness_of([scores], self.args.failed_samples).member[0]), len(rows), sum(generation.num_tokens)

    # ------------------------------------------------------------------- loop
    def _train(self) -> dict[str, float]:
        args = self.args
        if args.iterations == 0:  # esft eval: ESTrainer's evaluation, by vote when members are kept
            return super()._train()
        seeds = self._begin_scoring()
        members = self.record["members"]
        while len(members) < len(seeds) and not budget_spent(args, self._budget):
            started = time.perf_counter()
            chunk = seeds[len(members):len(members) + self._room()]
            self._tell_rewards()
            results = self.executor.evaluate_population(chunk, PromptBatch(0, self.validation), args.sigma)
            batches = [result.scores for result in results]
            self._stop_if_unscorable(batches)
            rewards = fitness_of(batches, args.failed_samples).member.tolist()
            number = len(self.record["rows"]) + 1
            row, self._budget = iteration_row(number, rewards, batches, sum(r.num_tokens for r in results),
                                              time.perf_counter() - started, self._budget)
            members += [{"seed": seed, "reward": reward} for seed, reward in zip(chunk, rewards)]
            self.record["rows"].append(row)
            write_record(self.run_dir, self.record)  # before the row: a row logged is a chunk kept
            self._logger.log(row)
            self._progress.update(len(chunk))
            self._progress.set_postfix(best=f"{max(m['reward'] for m in members):.3f}")
        self._progress.close()
        if (stop := budget_spent(args, self._budget)) and len(members) < len(seeds):
            say(f"esft: {stop} after {len(members)} of {len(seeds)} members: selecting among them")
        return self._select_and_finish(members)

    def _room(self) -> int:
        """Members in the next chunk: CHUNK, or fewer where --budget-completions leaves room for fewer (at
        least one: as an ES iteration, the chunk that reaches the budget is finished)."""
        if self.args.budget_completions is None:
            return CHUNK
        left = self.args.budget_completions - self._budget["completions"]
        return max(1, min(CHUNK, left // len(self.validation)))

    def _begin_scoring(self) -> list[int]:
        """config.yaml, the record (resumed: its members are not scored again), the metrics rows it
        stands for, the evaluation before training. Returns the N member seeds."""
        args = self.args
        self.failure_totals = {}
        settings = identity_of(args.to_dict())
        self.record = {"format": 1, "settings": settings, "sigma": args.sigma, "members": [], "rows": []}
        try:  # checked before the model loads where the run was claimed first (the CLI); again here for train(DIR)
            record = resumed_record(self.run_dir, args)
        except RecordError as error:
            raise TaskError(str(error)) from None
        if record is not None:
            self.record = record | {"kept": [], "consolidation": None}
            print(f"esft: resumed {self.run_dir}: {len(record['members'])} members already scored "
                  f"({RECORD_FILE}); they are not scored again", file=sys.stderr)
        self.run.set_aside_later()  # after the record's check: a refused resume moves and rewrites nothing
        self.run.write_config(args)
        self._began = True
        self._logger = MetricsLogger(self.run_dir, args.logging, args.to_dict(), self.run_dir.name)
        self.initial_metrics = self.record.get("before") or self._evaluate_or_stop(0, "nothing was scored")
        self.record["before"] = self.initial_metrics
        if self._logger.row_of(0) is None:  # a resumed run's rows (set aside by open_run) are the record's
            for row in [{"iteration": 0, **self.initial_metrics}, *self.record["rows"]]:
                self._logger.log(row)
        last = self.record["rows"][-1] if self.record["rows"] else {}
        self._budget = {key: last.get(f"budget/{key}", 0) for key in ("completions", "tokens", "seconds")}
        report_accuracy("before", self.initial_metrics)
        seeds = STRATEGIES[args.strategy].ask(ESState(args.seed), args.population_size)
        self._progress = progress_bar(len(seeds), len(self.record["members"]), "RANDOPT", unit="member",
                                      enabled=args.progress)
        console.attach(self._progress)
        return seeds

    def _select_and_finish(self, members: list[dict[str, Any]]) -> dict[str, float]:
        """Top K, the consolidation and its gate, final/, the held-out evaluation by vote."""
        args = self.args
        if not members:
            raise TaskError("no member was scored (the budget was spent before the first chunk); raise "
                            "--budget-completions or --budget-tokens")
        self.kept = top_k(members, args.randopt_top_k)
        self.record["kept"] = self.kept
        best = self.kept[0]
        started, completions, tokens = time.perf_counter(), 0, 0
        row: dict[str, Any] = {"randopt/kept": len(self.kept), "randopt/best_validation": best["reward"]}
        accepted = False
        if args.randopt_consolidate and len(self.kept) > 1:
            base, n, t = self._validation_reward()
            weights = consolidation_weights([m["reward"] for m in self.kept])
            self._move([m["seed"] for m in self.kept], [args.sigma * w for w in weights])
            merged, n2, t2 = self._validation_reward()
            completions, tokens = n + n2, t + t2
            accepted = merged > base
            self.record["consolidation"] = {"rule": "softmax of z-scored validation rewards (CoRP-style)",
                                            "weights": weights, "validation": merged, "base_validation": base,
                                            "accepted": accepted}
            row |= {"randopt/base_validation": base, "randopt/consolidated_validation": merged}
            if not accepted:
                self.engine.load_master_state(self._base)
            say(f"esft: consolidation of the {len(self.kept)} kept members: validation reward {merged:.4g} vs the "
                f"base's {base:.4g}: " + ("final/ is the consolidated model" if accepted else
                                          "not better, so final/ is the best single member"))
        if not accepted:
            self._move([best["seed"]], [args.sigma])
        row["randopt/consolidated"] = float(accepted)
        self._budget = {"completions": self._budget["completions"] + completions,
                        "tokens": self._budget["tokens"] + tokens,
                        "seconds": self._budget["seconds"] + time.perf_counter() - started}
        write_record(self.run_dir, self.record)
        self.state = ESState(args.seed, len(self.record["rows"]))
        self._save(self.run_dir / "final")
        self.engine.load_master_state(self._base)  # the vote perturbs the base, not final/'s weights
        last = {"iteration": len(self.record["rows"]), **row, **{f"budget/{k}": v for k, v in self._budget.items()}}
        last |= self._evaluate_or_stop(self.state.iteration, "the scores are in")
        self._logger.log(last)
        report_accuracy("after", last)
        return last | failure_summary(self.failure_totals)

    def _move(self, seeds: list[int], coefficients: list[float]) -> None:
        """master ← base + Σ cᵢ·ε(seedᵢ) (the engine's sgd update, no weight decay: exact in float32)."""
        if not hasattr(self, "_base"):
            self._base = self.engine.master_state()
        self.engine.update(seeds, coefficients, 1.0)

    def _stop_if_unscorable(self, batches) -> None:
        count_failures(self.failure_totals, self.rewards.names, batches)
        stop_if_unscorable(batches, self.rewards.names, self._skip_failing, "scoring the members",
                           self._stop_checkpoint)

    def _status(self) -> str:
        return "complete" if len(self.record.get("members", [])) >= self.args.population_size else "stopped: budget"

    def _stop_checkpoint(self, what: str = "") -> str:
        """What a stopped RandOpt run keeps: the members scored so far are in the record."""
        return f"the {len(self.record.get('members', []))} members scored so far are in {self.run_dir / RECORD_FILE}; " \
               f"fix it and --resume {self.run_dir}"
