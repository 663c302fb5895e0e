"""ESTrainer: the ES loop (seeds → evaluate members → shape → update → log → checkpoint)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from esft import strategy
from esft.checkpoint import (
    list_checkpoints,
    load_master,
    prune_checkpoints,
    read_state,
    resolve_resume,
    save_checkpoint,
    write_text_atomic,
)
from esft.config import ConfigError, ESConfig
from esft.factory import build_engine, build_executor, model_path
from esft.metrics import MetricsLogger, check_backend
from esft.evaluation import EvalSettings, evaluate_task
from esft.rewards import RewardRunner, mean_of, reward_name
from esft.tasks import TASKS
from esft.tasks.base import RewardFunc, Task, TaskError
from esft.tasks.custom import is_spec, task_from_config, task_from_objects, task_label
from esft.tasks.loading import render_rows


def embedded_model_path() -> Path:
    """Directory of the tiny Countdown model shipped inside the package."""
    return Path(str(resources.files("esft") / "assets" / "countdown-tiny"))


def new_run_dir(args: ESConfig) -> Path:
    """The directory of a new (not resumed) run; ConfigError if an earlier run already used it."""
    name = args.run_name or f"{task_label(args.task)}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.output_dir) / name
    if list_checkpoints(run_dir):
        raise ConfigError(
            "run_name", f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, or another --run-name"
        )
    if any((run_dir / entry).exists() for entry in ("final", "config.yaml", "metrics.jsonl")):
        raise ConfigError(
            "run_name",
            f"{run_dir} already holds a run without a complete checkpoint to --resume from; "
            "pass another --run-name or delete that directory",
        )
    return run_dir


class PromptBatch(list):
    """An iteration's rows, carrying the iteration as `batch_id`: the Ray executor sends only the id,
    and its actors rebuild the same rows with prompt_batch."""

    batch_id: int | None = None


def prompt_batch(data: Sequence[dict[str, Any]], seed: int, size: int, iteration: int) -> PromptBatch:
    """The iteration's prompt batch: consecutive slices of per-epoch shuffles of the train set,
    a function of (seed, iteration) alone, so a resumed run sees the same batches."""
    rows = PromptBatch()
    for position in range(iteration * size, (iteration + 1) * size):
        epoch, offset = divmod(position, len(data))
        order = np.random.default_rng([seed, 1, epoch]).permutation(len(data))
        rows.append(data[order[offset]])
    rows.batch_id = iteration
    return rows


class ESTrainer:
    """Fine-tune a causal LM with ES, in the spirit of TRL's trainers.

    `model` is a hub id, a local directory, "embedded", or a loaded transformers model; `reward_funcs`
    are TRL-style `f(prompts, completions, **columns) -> list[float | None]`; datasets are rows with a
    `prompt` column. Without reward functions and datasets, `args.task` supplies them.
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
    ):
        self.args = args = args if args is not None else ESConfig()
        self.task = self._build_task(reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func)
        if args.logging != "none":
            check_backend(args.logging)
        self.resume_checkpoint = resolve_resume(args.resume) if args.resume else None
        # --engine/--executor: the loop below only talks to self.executor (and self.engine for checkpoints).
        self.executor = build_executor(args, self.task, self._score, lambda: self._build_engine(model, processing_class), model)
        self.engine = self.executor.engine
        # chat prompts need the tokenizer: the engine's, else (an engine in other processes) the model's
        render_rows(self.task, getattr(self.engine, "tokenizer", None), lambda: self._load_tokenizer(model))
        self.rewards, self.accuracy = self._build_reward_runners()
        self._kl = None
        # KL's base for a model passed as an object: a CPU float32 copy of its weights before training
        self._kl_base = _cpu_copy(model) if self.task.report_kl and hasattr(model, "state_dict") else None
        self.state = strategy.init(args.seed)
        self.run_dir: Path | None = None
        self.initial_metrics: dict[str, float] = {}
        self._logger: MetricsLogger | None = None

    # ------------------------------------------------------------------ setup
    def _build_task(self, reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func) -> Task:
        args = self.args
        if reward_funcs is None and train_dataset is None and eval_dataset is None:
            if args.task not in TASKS and args.task != "custom" and not is_spec(args.task):
                raise ConfigError("task", f"unknown task {args.task!r}; registered tasks: {', '.join(sorted(TASKS))}, "
                                  "or module:function / path/to/file.py:function")
            return task_from_config(args, args.parsed_reward_weights())
        return task_from_objects(reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func, args.reward_model_device)

    def _load_tokenizer(self, model: Any):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path(self.args, model if isinstance(model, str) else None))

    def _build_reward_runners(self) -> tuple[RewardRunner, RewardRunner | None]:
        """Reward (and accuracy) scoring; user functions in the sandbox unless --no-reward-sandbox."""
        args, task = self.args, self.task
        options = dict(failure_reward=args.failure_reward, sandbox=args.reward_sandbox, timeout=args.reward_timeout,
                       memory_mb=args.reward_memory_mb, workers=args.reward_workers)
        rewards = RewardRunner(task.reward_funcs, task.reward_weights, **options)
        if task.accuracy_func is None:
            return rewards, None
        if task.reward_funcs == [task.accuracy_func] and task.reward_weights in (None, [1.0]):
            return rewards, rewards  # the reward is the accuracy: score once
        return rewards, RewardRunner([task.accuracy_func], **options)

    def _build_engine(self, model: Any, tokenizer: Any):
        """The --engine engine for `model` (a name, directory, loaded model or an engine): esft.factory."""
        return build_engine(self.args, model, tokenizer)

    def _score(self, rows: Sequence[dict[str, Any]], completions: Sequence[str],
               completion_ids: Sequence[Sequence[int]] | None = None):
        return self.rewards.score(rows, completions, completion_ids)

    def _batch(self, iteration: int) -> list[dict[str, Any]]:
        """The iteration's prompt batch (see prompt_batch)."""
        return prompt_batch(self.task.train_dataset, self.args.seed, self.args.batch_size, iteration)

    def _open_run_dir(self) -> Path:
        args = self.args
        if self.resume_checkpoint is not None:
            run_dir = self.resume_checkpoint.parent
            args.output_dir, args.run_name = str(run_dir.parent), run_dir.name
        else:
            run_dir = new_run_dir(args)
        run_dir.mkdir(parents=True, exist_ok=True)
        import yaml

        write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(args.to_dict(), sort_keys=False))
        return run_dir

    # ------------------------------------------------------------- evaluation
    def evaluate(self, iteration: int | None = None) -> dict[str, float]:
        """Evaluate the current weights on every eval split (esft.evaluation: greedy unless
        --temperature/--eval-samples say otherwise); writes per-sample JSONL when a run directory is
        open. Returns `eval/<split>/{reward,accuracy,mean_length,pass@k,kl,...}`."""
        args = self.args
        settings = EvalSettings(args.eval_batch_size, args.eval_samples, args.temperature, args.top_p, args.seed)
        folder = None
        if self.run_dir is not None:
            folder = self.run_dir / "eval" / f"iteration-{iteration if iteration is not None else self.state.iteration}"
        generate = lambda prompts, sampling: self.executor.generate(prompts, args.eval_batch_size, sampling)  # noqa: E731
        kl = self._kl_scorer() if self.task.report_kl else None
        return evaluate_task(generate, self.task, self.rewards, self.accuracy, settings, kl, folder)

    def _kl_scorer(self):
        """KL(current || base) per token; base = --base-model, else the initial weights of --model."""
        if self._kl is None:
            model = getattr(self.engine, "model", None)
            if model is None:
                print("KL needs an in-process transformers engine; not reported", file=sys.stderr)
                return None
            from esft.engines.logprobs import KLScorer

            base = self.args.base_model or self._kl_base
            if base is None:
                base = model_path(self.args)
            self._kl = KLScorer(model, self.engine.tokenizer, base)
        return self._kl

    # ------------------------------------------------------------------- loop
    def train(self, resume_from_checkpoint: str | None = None) -> dict[str, float]:
        """Run ES for `args.iterations` updates (evaluating before and after); returns the last metrics."""
        args = self.args
        if resume_from_checkpoint is not None:
            self.resume_checkpoint = resolve_resume(resume_from_checkpoint)
        if args.iterations > 0 and not self.task.train_dataset:
            raise TaskError("training needs a train dataset (or --iterations 0 to only evaluate)")
        self.run_dir = self._open_run_dir()
        if self.resume_checkpoint is not None:
            load_master(self.resume_checkpoint, self.engine)
            self.state = strategy.ESState(args.seed, read_state(self.resume_checkpoint)["iteration"])
        self._logger = MetricsLogger(self.run_dir, args.logging, args.to_dict(), self.run_dir.name, resume_at=self.state.iteration)
        if self.resume_checkpoint is not None:
            self._logger.truncate_after(self.state.iteration)
            print(f"resumed from {self.resume_checkpoint} at iteration {self.state.iteration}", file=sys.stderr)
        else:
            before = self.evaluate(0)
            self._logger.log({"iteration": 0, **before})
            _report("before", before)
            self.initial_metrics = before
        last: dict[str, float] = {}
        progress = _progress(args, self.state.iteration)
        while self.state.iteration < args.iterations:
            started = time.perf_counter()
            seeds = strategy.ask(self.state, args.population_size)
            members = self.executor.evaluate_population(seeds, self._batch(self.state.iteration))
            rewards = [member.reward for member in members]
            self.state, coefficients = strategy.tell(self.state, rewards, args.alpha, args.reward_shaping)
            self.executor.update(seeds, coefficients)
            elapsed = time.perf_counter() - started
            last = self._iteration_metrics(members, elapsed)
            final = self.state.iteration == args.iterations
            if final or (args.eval_every and self.state.iteration % args.eval_every == 0):
                last |= self.evaluate()
                if final:
                    _report("after", last)
            self._logger.log(last)
            if args.save_every and self.state.iteration % args.save_every == 0:
                self._save(self.run_dir / f"checkpoint-{self.state.iteration}")
                prune_checkpoints(self.run_dir, args.save_total_limit)
            progress.update(1)
            progress.set_postfix(reward=f"{last['reward/mean']:.3f}", max=f"{last['reward/max']:.3f}", tok_s=f"{last['perf/tokens_per_s']:.0f}")
        progress.close()
        if args.iterations > 0:
            self._save(self.run_dir / "final")
        self._logger.close()
        self.close()
        return last

    def close(self) -> None:
        """Stop the reward sandbox workers (they restart if the trainer is used again)."""
        self.rewards.close()
        if self.accuracy is not None:
            self.accuracy.close()

    def _iteration_metrics(self, members, elapsed: float) -> dict[str, float]:
        rewards = np.array([m.reward for m in members])
        tokens = sum(m.num_tokens for m in members)
        completions = sum(len(m.scores.total) for m in members)
        row = {
            "iteration": self.state.iteration,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/min": float(rewards.min()),
            "reward/max": float(rewards.max()),
            "completions/mean_length": tokens / completions,
            "perf/iteration_s": elapsed,
            "perf/tokens_per_s": tokens / elapsed,
            "reward/failures": sum(m.scores.failures for m in members),
            "reward/errors": sum(m.scores.errors for m in members),
            "reward/timeouts": sum(m.scores.timeouts for m in members),
        }
        for func in self.task.reward_funcs:
            values = [mean_of(m.scores.per_function[reward_name(func)]) for m in members]
            present = [v for v in values if v is not None]
            row[f"rewards/{reward_name(func)}/mean"] = float(np.mean(present)) if present else 0.0
        return row

    # ----------------------------------------------------------------- saving
    def _save(self, directory: Path) -> None:
        state = {"iteration": self.state.iteration, "seed": self.args.seed, "config": self.args.to_dict(), "checksum": self.engine.checksum()}
        save_checkpoint(self.engine, directory, state, save_master=self.args.dtype != "float32")

    def save_model(self, path: str | Path) -> None:
        """Write the current weights and tokenizer, loadable with from_pretrained (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        try:
            self.engine.save_pretrained(tmp)
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _cpu_copy(model: Any) -> Any:
    import copy

    import torch

    return copy.deepcopy(model).to(device="cpu", dtype=torch.float32)


def _report(when: str, metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        if key.endswith("/accuracy"):
            print(f"{key.split('/')[1]} accuracy {when}: {100 * value:.1f}%", file=sys.stderr)


def _progress(args: ESConfig, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=args.iterations, initial=start, desc="ES", unit="it", disable=not args.progress, file=sys.stderr)
