"""ESTrainer: the ES loop (seeds → evaluate members → shape → update → log → checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from esft.es import schedules
from esft.es.optimizers import coefficient_alpha
from esft.es.step_rules import alpha_for_strategy, default_alpha
from esft.es.strategies import STRATEGIES, ESState
from esft.es.batches import PROMPT_CHOICES, PromptBatch, prompt_batch, rollout_seed
from esft.es.groups import prompt_groups, prompts_of_members
from esft.runs.checkpoint import load_master, prune_checkpoints, save_checkpoint
from esft.settings.config import ESConfig, es_config, model_path, settings_for
from esft import console
from esft.console import progress_bar, report_accuracy, say
from esft.loop.iteration_metrics import budget_spent, iteration_row, nothing_to_do
from esft.loop.member_fitness import fitness_of
from esft.loop.reward_faults import count_failures, failure_summary, skip_failing, stop_if_unscorable, stop_if_unshapeable
from esft.engines import build_engine
from esft.engines.base import NonFiniteWeights, Sampling, optional
from esft.engines.logprobs import cpu_float32_copy
from esft.engines.master_weights import resolve_master_weights
from esft.engines.lora import export_merged, uses_adapter
from esft.engines.settings import EngineSettings
from esft.loop.evaluation import EvalSettings, evaluate_task, kl_scorer
from esft.loop.learning_signal import LearningWatch
from esft.loop import sigma_ladder
from esft.loop.sigma_ladder import LADDER, SCAN_MEMBERS, SCAN_PROMPTS, ScanResult
from esft.executors import ExecutorSettings, build_executor
from esft.files import directory_written_atomically, write_text_atomic
from esft.runs.metrics import MetricsLogger, check_backend
from esft.runs.report import report_after_training
from esft.runs.report_data import write_status
from esft.rewards.conventions import RewardTrainerState
from esft.rewards.runner import RewardError, Scores, mean_of, reward_runners
from esft.runs.directory import RunDir, find_resume_point, open_run
from esft.tasks.base import RewardFunc, Task, TaskError
from esft.tasks.building import TaskSettings, build_task
from esft.tasks.loading import check_prompts, format_prompts, render_rows
from esft.tasks.selection import overlap_line

CLOSED = "this ESTrainer was closed (close() released its engine): build a new ESTrainer"


@dataclasses.dataclass(frozen=True)
class Screen:
    """What choosing an iteration's batch from --prompt-candidates' candidates generated (counted in the budget)
    and logs; the default, nothing, where the batch is the next rows."""

    completions: int = 0
    tokens: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class ESTrainer:
    """Fine-tune a causal LM with ES, in the spirit of TRL's trainers.

    `model` is a hub id, a local directory, "embedded", or a loaded transformers model; `reward_funcs`
    are TRL-style `f(prompts, completions, **columns) -> list[float | None]` (any callable, async too; or
    ES-at-Scale's/verl's per-sample ones: esft.rewards.conventions); datasets (a DatasetDict: its train
    split) are rows with a `prompt` column (or args.prompt_column/prompt_template). Without reward
    functions and datasets, `args.task` supplies them. `run` is a run directory already claimed with
    esft.runs.directory.open_run (the CLI claims it before the model loads); by default train() claims one.
    """

    def __init__(
        self,
        model: Any = None,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        args: ESConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_weights: Sequence[float] | None = None,
        accuracy_func: RewardFunc | None = None,
        run: RunDir | None = None,
    ):
        self.args = args = es_config(args)  # TRL's GRPOConfig: a TypeError mapping its fields
        self.task = self._build_task(reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func)
        if args.iterations > 0 and not self.task.train_dataset:
            raise TaskError("training needs a train dataset (or --iterations 0 to only evaluate)")
        if args.logging != "none":
            check_backend(args.logging)
        rooms = ExecutorSettings.of(args)  # the executor's, its engines' and the reward sandbox's settings
        # --master-weights auto, resolved once here: every engine (each Ray actor's too) keeps its weights alike
        loaded = model is not None and not isinstance(model, str)
        engine_settings, line = resolve_master_weights(rooms.engine, None if loaded else model_path(rooms.engine, model),
                                                       model if loaded else None)
        if line is not None:
            print(f"esft: {line}", file=sys.stderr)
        self._engine_settings = engine_settings
        rooms = dataclasses.replace(rooms, engine=engine_settings)
        self.rewards, self.accuracy = reward_runners(self.task, rooms.sandbox)
        self._skip_failing = skip_failing(args.reward_skip_failing, self.rewards.names)
        # --engine/--executor: the loop below only talks to self.executor (and self.engine for checkpoints).
        self.executor = build_executor(rooms, self.task, self.rewards.score,
                                       lambda: self._build_engine(model, processing_class), model)
        self.engine = self.executor.engine
        self._model = model if isinstance(model, str) else None  # a name or directory (export_merged's base)
        if (line := format_prompts(self.task, args.prompt_format, self.engine.tokenizer)) is not None:
            print(f"esft: {line}", file=sys.stderr)
        render_rows(self.task, self.engine.tokenizer)  # chat prompts become the text the model sees
        engine = self.engine
        check_prompts(self.task, engine.tokenizer, engine.max_length(), args.max_tokens, engine.embedding_rows(),
                      engine.feeds_padding())
        self._kl = None
        # KL's base for a model passed as an object: a CPU float32 copy of its weights before training,
        # kept off the device until the first KL evaluation moves it to the model's device and dtype
        self._kl_base = cpu_float32_copy(model) if self.task.report_kl and hasattr(model, "state_dict") else None
        self.strategy = STRATEGIES[args.strategy]  # --strategy: ask/tell (esft.es.strategies)
        self.state = self.strategy.init(args.seed)
        self.run = run
        self.initial_metrics: dict[str, float] = {}
        self.failure_totals: dict[str, dict[str, Any]] = {}
        """Per reward function: failed and scored samples of this train() call, and the first failure."""
        self._budget = {"completions": 0, "tokens": 0, "seconds": 0.0}
        self._watch = LearningWatch()  # tied iterations (no update), their cause, whether the weights moved
        self._logger: MetricsLogger | None = None
        self._progress: Any = None
        self.report_path: Path | None = None  # report.html, written by train() (esft.runs.report)
        self._trained = False  # train() was called: a second call continues the run (train's docstring)
        self._result: dict[str, float] = {}
        self.closed = False  # close() was called: the engine is gone
        self.sigma_scan: ScanResult | None = None
        """--sigma auto: what the ladder measured (sigma-scan.json in the run directory)."""
        if args.sigma == "auto" and args.iterations > 0:  # measured on this model and data before anything trains
            self._choose_sigma()

    @property
    def model(self) -> Any:
        """The model being trained (the engine's; None for engines that keep it elsewhere, e.g. vLLM)."""
        return optional(self.engine, "model")

    @property
    def processing_class(self) -> Any:
        """The tokenizer, as TRL names it."""
        return self.engine.tokenizer

    @property
    def run_dir(self) -> Path | None:
        """The run directory (None until train() has claimed one)."""
        return self.run.path if self.run is not None else None

    def scan_sigmas(self, sigmas: Sequence[float] = LADDER, members: int = SCAN_MEMBERS, prompts: int = SCAN_PROMPTS,
                    said: Any = lambda sigma: None) -> ScanResult:
        """The σ ladder (esft.loop.sigma_ladder: `members` members at each σ, greedy) on this trainer's engine and
        rewards, on the first `prompts` training rows of iteration 0's shuffle; the weights are left as they were."""
        if self.closed:
            raise RuntimeError(CLOSED)
        self._tell_rewards()
        batch = prompt_batch(self.task.train_dataset, self.args.seed, prompts, 0)
        return sigma_ladder.scan(self.engine, self.rewards.score, batch.rows, self.args.seed, sigmas, members,
                                 self.args.eval_batch_size, said)

    def _choose_sigma(self) -> None:
        """--sigma auto: the ladder's recommendation becomes σ (and α its default, esft.es.step_rules.default_alpha,
        unless --alpha was given), said in
        one line; none (no σ moves the members without collapse) stops with the ladder's verdict."""
        args = self.args
        point = self.run.resume if self.run is not None else None
        if point is not None and point.checkpoint is not None:
            raise TaskError(f"--sigma auto chooses σ before the first iteration, and this run resumes at iteration "
                            f"{point.iteration}: drop --sigma auto (the run's config.yaml holds the σ it trained with)")
        result = self.scan_sigmas()
        if result.recommended is None:
            raise TaskError(f"--sigma auto: {result.verdict}; give --sigma yourself (esft sigma-scan shows the ladder)")
        given_alpha = args.alpha is not None
        args.sigma = result.recommended
        args.alpha = args.alpha if given_alpha else default_alpha(args.sigma, args.step_rule)
        rule = "σ/(2√8)" if args.step_rule == "sqrt_n" else "σ/2"
        step = f"--alpha {args.alpha:g} as given" if given_alpha else f"α = {rule} = {args.alpha:g}"
        self.sigma_scan = result  # written into the run directory as sigma-scan.json when the run begins
        print(f"esft: --sigma auto: σ = {args.sigma:g}, {step}; of σ = {', '.join(f'{s:g}' for s in LADDER)} on "
              f"{result.members} members × {result.prompts} training prompts, {result.reason}",
              file=sys.stderr)

    def _build_engine(self, model: Any, processing_class: Any):
        """The engine (built after the task and its data are checked; esft.grpo.baseline builds another)."""
        return build_engine(self._engine_settings, model, processing_class)

    def _build_task(self, reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func) -> Task:
        """The task (esft.tasks.building), from the settings it uses or the objects given to ESTrainer."""
        return build_task(settings_for(TaskSettings, self.args), reward_funcs, train_dataset, eval_dataset,
                          reward_weights, accuracy_func)

    # ------------------------------------------------------------- evaluation
    def evaluate(self, iteration: int | None = None) -> dict[str, float]:
        """Evaluate the current weights on every eval split (esft.loop.evaluation: greedy unless
        --temperature/--eval-samples say otherwise); writes per-sample JSONL when a run directory is
        open. Returns `eval/<split>/{reward,accuracy,mean_length,pass@k,kl,...}`. RewardError if a
        reward or accuracy function failed on every sample of a split."""
        if self.closed:
            raise RuntimeError(CLOSED)
        args = self.args
        settings = EvalSettings(args.eval_batch_size, args.eval_samples, args.temperature, args.top_p, args.seed, args.progress)
        folder = None
        if self.run_dir is not None:
            folder = self.run_dir / "eval" / f"iteration-{iteration if iteration is not None else self.state.iteration}"
        generate = lambda prompts, sampling: self.executor.generate(prompts, args.eval_batch_size, sampling)  # noqa: E731
        if self.task.report_kl and self._kl is None:  # base: --base-model, else the initial weights of --model
            self._kl = kl_scorer(self.engine, self.args.base_model or self._kl_base or model_path(self.args))
        kl = self._kl if self.task.report_kl else None
        self._tell_rewards()
        return evaluate_task(generate, self.task, self.rewards, self.accuracy, settings, kl, folder)

    def _tell_rewards(self) -> None:
        """TRL's `trainer_state` for reward functions: updates done so far, of --iterations."""
        state = RewardTrainerState(self.state.iteration, self.args.iterations)
        for runner in (self.rewards, self.accuracy):
            if runner is not None:
                runner.trainer_state = state

    # ------------------------------------------------------------------- loop
    def train(self, resume_from_checkpoint: str | None = None) -> dict[str, float]:
        """Run ES up to `args.iterations` updates (evaluating before and after); returns the last
        metrics, with the run's reward failure counts. Then writes `report.html` into the run
        directory (`self.report_path`), also when the run is interrupted or stops with an error.

        - `resume_from_checkpoint` (or --resume) always resumes from what it names: a checkpoint, or a
          run directory's newest intact checkpoint (esft.runs.directory.find_resume_point), also on a
          trainer that has trained before.
        - A second `train()` on the same trainer (a notebook cell run again) continues the same run:
          after a finished run it prints "already at iteration N of N" and changes nothing (raise
          `trainer.args.iterations` to train on: the run directory gets rows N+1.. and new
          checkpoints); after an interrupted one it resumes from the run's newest intact checkpoint,
          as --resume would (the weights in memory may hold half an update).
        """
        if self.closed:
            raise RuntimeError(CLOSED)
        args = self.args
        if resume_from_checkpoint is not None:
            if self.run is not None:
                self.run.discard_if_unused()
            self.run = open_run(args, find_resume_point(resume_from_checkpoint))
        elif self._trained:
            if (done := nothing_to_do(self.state.iteration, self.args, self._budget)) is not None:
                print(f"esft: {done}; nothing changed", file=sys.stderr)
                return self._result
            point = find_resume_point(self.run_dir)
            if point.checkpoint is None and self.state.iteration > 0:
                raise TaskError(f"{self.run_dir}: the first train() stopped before any checkpoint was written, so the "
                                "weights in memory cannot be trusted; build a new ESTrainer")
            self.run = open_run(args, point)
        elif self.run is None:
            resume = args.resume
            self.run = open_run(args, find_resume_point(resume) if resume else None)
        self._trained = True
        self._began = False  # set by _begin once a resume's checks passed: a refused resume writes nothing
        status = "interrupted"  # Ctrl-C (KeyboardInterrupt) leaves it so
        try:
            self._result = self._train()
            status = self._status()
            if self._result.get("es/weights_moved") == 0.0:
                status += f": the weights never moved ({self._watch.count} of {self._watch.iterations} iterations tied)"
            return self._result
        except Exception:
            status = "stopped: error"
            raise
        finally:
            refused = self.run.resume is not None and not self._began  # the run directory stays as it was
            if not refused:
                write_status(self.run_dir, status)  # what esft report says of the run
            if self._progress is not None:
                self._progress.close()  # an error line after this starts on a line of its own
            console.detach()
            if self._logger is not None:
                self._logger.close()
            try:  # report.html is the run's last file: written while the run directory is still held
                if not refused:
                    self.report_path = report_after_training(self.run_dir)
            finally:
                self._release_run()

    def _status(self) -> str:
        """What esft report says of a run that ended without an error."""
        return "stopped: budget" if self.state.iteration < self.args.iterations else "complete"

    def _train(self) -> dict[str, float]:
        args = self.args
        start = self._begin()
        last: dict[str, float] = {}
        while self.state.iteration < args.iterations and not budget_spent(args, self._budget):
            started = time.perf_counter()
            sigma, alpha = schedules.step_sizes(args, self.state.iteration)  # σ_t, α_t: --sigma/--alpha-schedule
            seeds = self.strategy.ask(self.state, args.population_size)
            self._tell_rewards()
            members, prompts, screen = self._evaluate_members(seeds, sigma)  # --prompt-groups, --prompt-candidates
            batches = [member.scores for member in members]
            self._stop_if_unscorable(batches)
            fitness = fitness_of(batches, args.failed_samples, prompts)  # members × samples; --failed-samples
            rewards = fitness.member.tolist()
            stop_if_unshapeable(rewards, args.reward_shaping, batches, f"iteration {self.state.iteration + 1}",
                                self._stop_checkpoint)
            # adam: coefficients zᵢ/N make G the ES gradient estimate g, α_t its learning rate (esft.es.optimizers);
            # --step-rule sqrt_n: α·√N, so that the update is (α/√N)·Σ cᵢ·εᵢ (esft.es.step_rules)
            step = alpha_for_strategy(args.step_rule, coefficient_alpha(args.optimizer, alpha), len(seeds))
            state, coefficients = self.strategy.tell(self.state, fitness, step, args.reward_shaping)
            self._update(seeds, coefficients, alpha)
            self.state = state
            row = self._iteration_metrics(members, prompts, rewards, time.perf_counter() - started, coefficients, sigma,
                                          screen)
            last, _ = self._end_iteration(row | {"es/sigma": sigma, "es/alpha": alpha})
        return self._end(last, start)

    def _begin(self) -> int:
        """Before the loop: config.yaml, the resumed weights, the metrics logger and the budget so far,
        the evaluation before training, the progress bar. Returns the iteration the run starts at."""
        args, point = self.args, self.run.resume
        self.failure_totals = {}
        start = 0
        if point is not None and point.checkpoint is not None:
            self._load_checkpoint(point.checkpoint)  # refused here (weights that do not fit): nothing moved or written
            start = point.iteration
        self.run.set_aside_later()  # what a resumed run did after its resume point (esft.runs.directory)
        self.run.write_config(args)
        if self.sigma_scan is not None:  # --sigma auto: the ladder's table beside the σ config.yaml records
            write_text_atomic(self.run_dir / "sigma-scan.json", json.dumps(self.sigma_scan.record(), indent=2) + "\n")
        self._began = True
        if point is not None and point.checkpoint is not None:
            for skipped in point.skipped:
                print(f"esft: passed over a damaged checkpoint: {skipped}", file=sys.stderr)
            print(f"resumed from {point.checkpoint} at iteration {start}", file=sys.stderr)
        self.state = ESState(args.seed, start)
        self._watch = LearningWatch(self.engine.checksum() if args.algorithm == "es" and args.iterations > start else None)
        if start == 0 and args.iterations > 0 and (line := overlap_line(self.task)):  # said once per run
            print(f"esft: {line}", file=sys.stderr)  # before training: results measured on training rows say so
        self._logger = MetricsLogger(self.run_dir, args.logging, args.to_dict(), self.run_dir.name, resume_at=start)
        self._budget = self._logger.last_budget()
        if start == 0:
            self.initial_metrics = before = self._evaluate_or_stop(start, "nothing was trained")
            self._logger.log({"iteration": 0, **before})
            if args.iterations:
                report_accuracy("before", before)
        self._progress = progress_bar(args.iterations, start, args.algorithm.upper(), enabled=args.progress)
        console.attach(self._progress)  # status lines go above it, waiting for a reward service into it (esft.console)
        return start

    def _load_checkpoint(self, checkpoint: Path) -> None:
        load_master(checkpoint, self.engine, self.args.optimizer)

    def _end_iteration(self, row: dict[str, float]) -> tuple[dict[str, float], bool]:
        """After an update (self.state is the new iteration): the evaluation when due, the row logged,
        a checkpoint when due. Returns the row and whether the run ends here (--iterations reached,
        or a budget spent: said in one line)."""
        args, iteration = self.args, self.state.iteration
        stop = budget_spent(args, self._budget)
        final = iteration >= args.iterations or stop is not None
        if stop and iteration < args.iterations:
            say(f"esft: {stop} at iteration {iteration} of {args.iterations}: stopping (the final evaluation and "
                "final/ follow)")
        self._logger.log(row)  # before the evaluation: an evaluation that fails must not lose the training row
        if final or (args.eval_every and iteration % args.eval_every == 0):
            row |= self._evaluate_or_stop(iteration, "the weights are in")
            self._logger.log(row)  # merged into the training row
        if args.save_every and iteration % args.save_every == 0:
            self._save(self.run_dir / f"checkpoint-{iteration}")
            prune_checkpoints(self.run_dir, args.save_total_limit)
        self._progress.update(1)
        if "reward/mean" in row:
            self._progress.set_postfix(reward=f"{row['reward/mean']:.3f}", max=f"{row['reward/max']:.3f}",
                                       tok_s=f"{row['perf/tokens_per_s']:.0f}",
                                       **({"tied": self._watch.count} if self._watch.count else {}))
        return row, final

    def _end(self, last: dict[str, float], start: int) -> dict[str, float]:
        """After the loop: the final evaluation of a run resumed at its end, final/, the failure counts."""
        args = self.args
        self._progress.close()  # before the "accuracy after" lines: never glued to the bar's last line
        if not last and start > 0 and (start == args.iterations or budget_spent(args, self._budget)):
            # resumed at the end (of the iterations or of the budget): its final row again, evaluated if it has none
            last = self._logger.row_of(start) or {}
            if not any(key.startswith("eval/") for key in last):
                last = {"iteration": start, **self._evaluate_or_stop(start, "the weights are in")}
                self._logger.log(last)
            print(f"esft: already at iteration {start} of {args.iterations}: nothing to train", file=sys.stderr)
        if last and args.iterations:
            report_accuracy("after", last)
        learning = self._watch.finish(self.engine.checksum() if self._watch.start else None)
        if args.iterations > 0:
            self._save(self.run_dir / "final")
            if uses_adapter(self.engine, EngineSettings.of(args)):  # LoRA-ES: final/ is the adapter; final-merged/ the merged model
                self.save_model(self.run_dir / "final-merged", merged=True)
        return (last or self.initial_metrics) | failure_summary(self.failure_totals) | learning

    def _batch(self, iteration: int) -> tuple[PromptBatch, Screen]:
        """The iteration's prompt batch (esft.es.batches). With --prompt-candidates K > 1: B of the next K·B rows,
        chosen by --prompt-choice from the rewards of the unperturbed model's greedy answers to them, and the screen."""
        args = self.args
        if args.prompt_candidates == 1:
            return prompt_batch(self.task.train_dataset, args.seed, args.batch_size, iteration), Screen()
        candidates = prompt_batch(self.task.train_dataset, args.seed, args.batch_size * args.prompt_candidates, iteration)
        answers = self.executor.generate(candidates.prompts, args.eval_batch_size)
        rewards = self.rewards.score(candidates.rows, answers.texts, answers.token_ids).total
        chosen = PROMPT_CHOICES[args.prompt_choice](rewards, args.batch_size)
        means = {"selection/candidate_reward": mean_of(rewards), "selection/batch_reward": mean_of([rewards[i] for i in chosen])}
        metrics = {key: value for key, value in means.items() if value is not None}  # None: nothing was scored
        return candidates.pick(chosen), Screen(len(answers.texts), sum(answers.num_tokens), metrics)

    def _evaluate_members(self, seeds: Sequence[int], sigma: float) -> tuple[list, np.ndarray, Screen]:
        """Every member scored on its group's slice of the iteration's batch (esft.es.groups; one group: all on
        all), group after group, the batch index of the prompt each member's samples answered, and what choosing
        the batch took (_batch)."""
        groups = prompt_groups(len(seeds), self.args.batch_size, self.args.prompt_groups)
        batch, screen = self._batch(self.state.iteration)
        sampling = self._rollout_sampling(self.state.iteration)
        members = [member for group in groups for member in self.executor.evaluate_population(
            [seeds[i] for i in group.members], batch.part(group.prompts), sigma, sampling)]
        return members, prompts_of_members(groups), screen

    def _rollout_sampling(self, iteration: int) -> Sampling | None:
        """--rollout-temperature > 0: members' completions sampled with common random numbers (Sampling.common_noise),
        seeded per iteration (esft.es.batches.rollout_seed); else None, greedy."""
        temperature = self.args.rollout_temperature
        if not temperature:
            return None
        return Sampling(temperature, 1.0, 1, rollout_seed(self.args.seed, iteration), common_noise=True)

    def _stop_if_unscorable(self, batches: Sequence[Scores]) -> None:
        """esft.loop.reward_faults.stop_if_unscorable for this iteration."""
        count_failures(self.failure_totals, self.rewards.names, batches)
        stop_if_unscorable(batches, self.rewards.names, self._skip_failing, f"iteration {self.state.iteration + 1}",
                           self._stop_checkpoint)

    def _stop_checkpoint(self, what: str = "the weights from before it are in") -> str:
        """Write checkpoint-<iteration> (unless the run has not trained yet) and say how to go on."""
        if self.state.iteration == 0:
            return f"nothing was updated; fix it and run again, or --resume {self.run_dir} (same settings)"
        checkpoint = self.run_dir / f"checkpoint-{self.state.iteration}"
        if not (self.run.resume and self.run.resume.checkpoint == checkpoint):
            self._save(checkpoint)
        return f"{what} {checkpoint}; fix it and --resume {self.run_dir}"

    def _evaluate_or_stop(self, iteration: int, what: str) -> dict[str, float]:
        try:
            return self.evaluate(iteration)
        except RewardError as error:
            consequence = self._stop_checkpoint(what) if iteration else "nothing was trained; fix it and run again"
            raise RewardError(error.function, error.failure, error.when, consequence) from None

    def _update(self, seeds: Sequence[int], coefficients: Sequence[float], alpha: float) -> None:
        try:
            self.executor.update(*self.strategy.update_terms(seeds, coefficients), alpha)  # antithetic: a ±σ pair, one seed
        except NonFiniteWeights as error:
            raise NonFiniteWeights(f"iteration {self.state.iteration + 1}: {error}; {self._stop_checkpoint()} "
                                   "with a smaller --alpha or --sigma") from None

    def close(self) -> None:
        """Release all the trainer holds: its engine (a vLLM engine and its GPU memory, Ray actors and
        their CPUs/GPUs), the reward sandbox workers and the run directory, e.g. before a notebook cell
        builds another trainer that needs the same GPUs. Afterwards the trainer cannot train or evaluate."""
        self._release_run()
        if not self.closed:
            self.closed = True
            self.executor.close()

    def _release_run(self) -> None:
        """After train(): stop the reward sandbox workers (they restart if the trainer is used again)
        and release the run directory; the engine stays, for evaluate() and save_model()."""
        self.rewards.close()
        if self.accuracy is not None:
            self.accuracy.close()
        if self.run is not None:
            self.run.close()

    def _iteration_metrics(self, members, prompts: np.ndarray, rewards: Sequence[float], elapsed: float, coefficients,
                           sigma: float, screen: Screen) -> dict[str, float]:
        """The ES row: rewards, budget (with --prompt-candidates' screen), the screen's rewards, and whether the
        update could move the weights (esft.loop.learning_signal)."""
        row, self._budget = iteration_row(self.state.iteration, rewards, [m.scores for m in members],
                                          sum(m.num_tokens for m in members), elapsed, self._budget,
                                          (screen.completions, screen.tokens))
        return row | screen.metrics | self._watch.observe(self.state.iteration, rewards, coefficients, [m.fingerprints for m in members],
                                         sigma, self.strategy.mirrored, self.executor.update_ratio(),
                                         self.executor.update_survival(), prompts)

    # ----------------------------------------------------------------- saving
    def _save(self, directory: Path) -> None:
        checksum = self.engine.checksum()
        state = {"iteration": self.state.iteration, "seed": self.args.seed, "run_id": self.run.run_id,
                 "named_files": self.run.named_files, "config": self.args.to_dict(), "checksum": checksum,
                 "train_eval_overlap": self.task.metadata.get("train_eval_overlap", {}), "learning": self._watch.record(checksum)}
        # the model file holds the weights exactly where they are their own master (float32, --master-weights none)
        save_checkpoint(self.engine, directory, state, save_master=self.args.dtype != "float32"
                        and self._engine_settings.master_weights == "float32")

    def save_model(self, path: str | Path, merged: bool = False) -> None:
        """Write the current weights and tokenizer (atomically), loadable with from_pretrained; for
        LoRA-ES the PEFT adapter (PeftModel.from_pretrained), or with `merged` the adapter merged into
        the base model (AutoModelForCausalLM.from_pretrained; esft.engines.lora.export_merged)."""
        with directory_written_atomically(Path(path)) as tmp:
            if merged:
                export_merged(self.engine, tmp, model_path(self.args, self._model), self.args.dtype)
            else:
                self.engine.save_pretrained(tmp)
