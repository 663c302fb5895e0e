"""ESTrainer: the ES loop (seeds → evaluate members → shape → update → log → checkpoint)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
from esft.config import EMBEDDED_MODEL, ConfigError, ESConfig
from esft.executor import LocalExecutor
from esft.metrics import MetricsLogger, check_backend
from esft.rewards import mean_of, reward_name, score
from esft.tasks import TASKS, load_task
from esft.tasks.base import RewardFunc, Task, TaskError


def embedded_model_path() -> Path:
    """Directory of the tiny Countdown model shipped inside the package."""
    return Path(str(resources.files("esft") / "assets" / "countdown-tiny"))


def _rows(dataset: Any, where: str) -> list[dict[str, Any]]:
    """A list of dicts from a list of dicts or a `datasets.Dataset`, checked for a `prompt` column."""
    rows = [dict(row) for row in dataset]
    for index, row in enumerate(rows):
        if not isinstance(row.get("prompt"), str):
            raise TaskError(f"{where} row {index}: needs a 'prompt' column holding a string, got {sorted(row)}")
    if not rows:
        raise TaskError(f"{where} is empty")
    return rows


def new_run_dir(args: ESConfig) -> Path:
    """The directory of a new (not resumed) run; ConfigError if an earlier run already used it."""
    name = args.run_name or f"{args.task}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
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
        self.engine = self._build_engine(model, processing_class)
        self.executor = LocalExecutor(self.engine, self._score, args.sigma)
        self.state = strategy.init(args.seed)
        self.run_dir: Path | None = None
        self.initial_metrics: dict[str, float] = {}
        self._logger: MetricsLogger | None = None

    # ------------------------------------------------------------------ setup
    def _build_task(self, reward_funcs, train_dataset, eval_dataset, reward_weights, accuracy_func) -> Task:
        args = self.args
        if reward_funcs is None and train_dataset is None:
            if args.task not in TASKS:
                raise ConfigError("task", f"unknown task {args.task!r}; registered tasks: {', '.join(sorted(TASKS))}")
            return load_task(
                args.task, train_data=args.train_data, eval_data=args.eval_data, seed=args.seed,
                difficulty=args.difficulty, train_size=args.train_size, eval_size=args.eval_size,
            )
        if reward_funcs is None:
            raise TaskError("reward_funcs is required when train_dataset is given")
        funcs = list(reward_funcs) if isinstance(reward_funcs, Sequence) else [reward_funcs]
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise TaskError(f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward functions")
        if isinstance(eval_dataset, dict):
            evals = {split: _rows(rows, f"eval_dataset[{split!r}]") for split, rows in eval_dataset.items()}
        else:
            evals = {"eval": _rows(eval_dataset, "eval_dataset")} if eval_dataset is not None else {}
        train = _rows(train_dataset, "train_dataset") if train_dataset is not None else []
        return Task("custom", train, evals, funcs, list(reward_weights) if reward_weights else None, accuracy_func)

    def _build_engine(self, model: Any, tokenizer: Any):
        from esft.engines.transformers_engine import NoTrainableParameters, TransformersEngine

        args = self.args
        options = dict(trainable=args.trainable, noise=args.noise, max_tokens=args.max_tokens, mini_batch_size=args.mini_batch_size)
        if model is None or isinstance(model, str):
            name = model or args.model
            path = str(embedded_model_path()) if name == EMBEDDED_MODEL else name
            try:
                return TransformersEngine.from_pretrained(path, dtype=args.dtype, device=args.device, **options)
            except NoTrainableParameters as error:
                raise ConfigError("trainable", str(error)) from None
            except (OSError, ValueError) as error:
                raise ConfigError("model", f"could not load {name!r}: {error}") from error
        if tokenizer is None:
            raise TaskError("pass processing_class (the tokenizer) with a loaded model")
        return TransformersEngine(model, tokenizer, **options)

    def _score(self, rows: Sequence[dict[str, Any]], completions: Sequence[str]):
        return score(self.task.reward_funcs, rows, completions, self.task.reward_weights)

    def _batch(self, iteration: int) -> list[dict[str, Any]]:
        """The iteration's prompt batch: consecutive slices of per-epoch shuffles of the train set,
        a function of (seed, iteration) alone, so a resumed run sees the same batches."""
        data, size = self.task.train_dataset, self.args.batch_size
        rows = []
        for position in range(iteration * size, (iteration + 1) * size):
            epoch, offset = divmod(position, len(data))
            order = np.random.default_rng([self.args.seed, 1, epoch]).permutation(len(data))
            rows.append(data[order[offset]])
        return rows

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
        """Greedy evaluation of the current weights on every eval split; writes per-sample JSONL
        when a run directory is open. Returns `eval/<split>/{reward,accuracy,mean_length}`."""
        metrics: dict[str, float] = {}
        for split, rows in self.task.eval_datasets.items():
            generation = self.executor.generate([row["prompt"] for row in rows], self.args.eval_batch_size)
            scores = self._score(rows, generation.texts)
            metrics[f"eval/{split}/reward"] = scores.mean()
            metrics[f"eval/{split}/mean_length"] = float(np.mean(generation.num_tokens))
            accuracy = None
            if self.task.accuracy_func is not None:
                accuracy = score([self.task.accuracy_func], rows, generation.texts).total
                metrics[f"eval/{split}/accuracy"] = mean_of(accuracy) or 0.0
            if self.run_dir is not None:
                self._write_samples(split, iteration, rows, generation.texts, scores.total, accuracy)
        return metrics

    def _write_samples(self, split, iteration, rows, completions, rewards, accuracy) -> None:
        folder = self.run_dir / "eval" / f"iteration-{iteration if iteration is not None else self.state.iteration}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (row, completion) in enumerate(zip(rows, completions)):
            sample = {"prompt": row["prompt"], "completion": completion, "reward": rewards[i]}
            sample |= {k: v for k, v in row.items() if k not in ("prompt",) and _jsonable(v)}
            if accuracy is not None:
                sample["accuracy"] = accuracy[i]
            lines.append(json.dumps(sample))
        write_text_atomic(folder / f"{split}.jsonl", "\n".join(lines) + "\n")

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
        return last

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


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _report(when: str, metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        if key.endswith("/accuracy"):
            print(f"{key.split('/')[1]} accuracy {when}: {100 * value:.1f}%", file=sys.stderr)


def _progress(args: ESConfig, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=args.iterations, initial=start, desc="ES", unit="it", disable=not args.progress, file=sys.stderr)
