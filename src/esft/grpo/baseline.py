"""`--algorithm grpo`: TRL's GRPOTrainer on esft's model, task, reward sandbox, evaluation, run
directory, metrics and checkpoints (README "GRPO baseline"). esft configures TRL; GRPO is TRL's.

What is esft's and what is TRL's:

- The model is loaded once into a TrainedModelEngine: TRL trains its parameters in place, esft's
  evaluation generates with them exactly as ES's and `esft eval`'s do (greedy by default).
- TRL's dataset is the task's training rows after render_rows (the prompt text the model sees) and
  each row's index; text prompts are tokenized as esft's engines tokenize them (no special tokens
  added), so both algorithms train on the same tokens.
- TRL gets one reward function that scores through esft's RewardRunner: the same sandbox, failure
  reward, counting and stop rules (a function failing on every sample of a generation batch stops
  the run with RewardError after a checkpoint, unless --reward-skip-failing names it). GRPO needs a number per completion: a completion no function scored gets
  --failure-reward.
- esft's callback writes one metrics.jsonl row per optimizer step (the ES keys, reward statistics
  over the step's completions, budget/*, and TRL's grpo/loss, grpo/kl, ...), evaluates, saves
  checkpoints and stops at --budget-completions/--budget-tokens.
- Checkpoints (esft.grpo.trl_trainer): `checkpoint-N/` and `final/` hold the model files, esft's
  trainer_state.json and `trl/`, TRL's own checkpoint (HF Trainer's trainer_state.json, optimizer,
  LR scheduler, RNG states); --resume continues with TRL's resume_from_checkpoint from `trl/`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from esft.es.strategies import ESState
from esft.runs.checkpoint import CheckpointError, save_checkpoint
from esft.settings.config import ConfigError, ESConfig, es_config, model_path
from esft.engines import check_device, check_hub_id, loading_errors
from esft.engines.settings import EngineSettings
from esft.engines.trained_model import TrainedModelEngine
from esft.grpo.trl_trainer import ROW_COLUMN, STAGING_DIR, TRL_DIR, TRLCheckpointFiles, build_trl_trainer, require_trl
from esft.rewards.runner import RewardFunc, Scores
from esft.loop.iteration_metrics import budget_spent, iteration_row
from esft.trainer import ESTrainer

TRL_METRICS = ("loss", "grad_norm", "learning_rate", "kl", "entropy")
"""What TRL logs per step that metrics.jsonl keeps, as grpo/<name>."""


class GRPOBaseline(ESTrainer):
    """TRL's GRPO with ESTrainer's interface, task, rewards, evaluation and run directory.

    Arguments are ESTrainer's (train_dataset, eval_dataset, processing_class, reward_weights,
    accuracy_func, run as keywords; `model`: hub id, directory, "embedded" or a loaded model with its
    `processing_class`); `args.algorithm` must be "grpo". `args.iterations` counts optimizer steps
    (TRL's max_steps); the "GRPO (TRL)" settings of ESConfig are TRL's GRPOConfig fields (the rollout
    temperature is `rollout_temperature`). ConfigError (before any model loads) if TRL is missing.
    """

    def __init__(self, model: Any = None, reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
                 args: ESConfig | None = None, **kwargs: Any):
        args = es_config(args, algorithm="grpo")
        if args.algorithm != "grpo":
            raise ConfigError("algorithm", f"GRPOBaseline trains with --algorithm grpo, got {args.algorithm!r} "
                              "(ESTrainer runs es)")
        require_trl()
        self._trl: Any = None
        self._pending: list[tuple[list[float], Scores, int]] = []
        """The step's generation batches: (rewards given to TRL, their Scores, generated tokens)."""
        self._row: dict[str, float] | None = None
        self._step_started = 0.0
        self._last: dict[str, float] = {}
        super().__init__(model, reward_funcs, args, **kwargs)

    def _build_engine(self, model: Any, processing_class: Any) -> TrainedModelEngine:
        """The model TRL trains, as an engine for esft's evaluation (loaded after the data is checked)."""
        args = self.args
        options = dict(max_tokens=args.max_tokens, trainable=args.trainable)
        with loading_errors(EngineSettings.of(args), model):
            if model is not None and not isinstance(model, str):
                if processing_class is None:
                    raise ConfigError("model", "a loaded model needs its tokenizer: pass processing_class=tokenizer")
                return TrainedModelEngine(model, processing_class, **options)
            check_device(args.device)
            check_hub_id(model_path(args, model))
            return TrainedModelEngine.from_pretrained(model_path(args, model), dtype=args.dtype, device=args.device,
                                                      **options)

    def evaluate(self, iteration: int | None = None) -> dict[str, float]:
        """ESTrainer.evaluate with the model in eval mode (dropout off), training mode put back after."""
        model = self.engine.model
        training = model.training
        model.eval()
        try:
            return super().evaluate(iteration)
        finally:
            model.train(training)

    # ------------------------------------------------------------------- loop
    def _train(self) -> dict[str, float]:
        args = self.args
        start = self._begin()
        try:
            if start < args.iterations and not budget_spent(args, self._budget):
                self._last = {}
                resume = self.run.resume.checkpoint / TRL_DIR if start else None
                self._trl = build_trl_trainer(self, self.run_dir / STAGING_DIR, self._reward_for_trl)
                self._trl.train(resume_from_checkpoint=str(resume) if resume else None)
            return self._end(self._last, start)
        finally:
            shutil.rmtree(self.run_dir / STAGING_DIR, ignore_errors=True)

    def _load_checkpoint(self, checkpoint: Path) -> None:
        if not (checkpoint / TRL_DIR).is_dir():
            raise CheckpointError(f"{checkpoint} holds no TRL training state ({TRL_DIR}/): it was not written by "
                                  "--algorithm grpo; resume it with the algorithm that wrote it")
        super()._load_checkpoint(checkpoint)

    def _reward_for_trl(self, prompts, completions, completion_ids, **columns) -> list[float]:
        """TRL's reward function: the batch's rows scored by esft's RewardRunner (sandbox, failure
        rules); RewardError (after a checkpoint) when a generation batch cannot be scored."""
        rows = [self.task.train_dataset[index] for index in columns[ROW_COLUMN]]
        self._tell_rewards()
        scores = self.rewards.score(rows, completions, completion_ids)
        self._stop_if_unscorable([scores])
        values = [self.args.failure_reward if value is None else value for value in scores.total]
        self._pending.append((values, scores, sum(len(ids) for ids in completion_ids)))
        return values

    # called by esft.grpo.trl_trainer.StepCallback around each optimizer step
    def step_began(self) -> None:
        """An optimizer step starts (its time counts in budget/seconds; evaluations do not)."""
        self._step_started = time.perf_counter()

    def step_ended(self, step: int) -> None:
        """An optimizer step ended: its row, from the generation batches scored during it."""
        elapsed = time.perf_counter() - self._step_started
        self.state = ESState(self.args.seed, step)
        if self._pending:
            rewards = [value for values, _, _ in self._pending for value in values]
            self._row, self._budget = iteration_row(step, rewards, [scores for _, scores, _ in self._pending],
                                                    sum(tokens for *_, tokens in self._pending), elapsed, self._budget)
        else:  # a step that reused an earlier generation batch (--num-iterations > 1, accumulation)
            self._budget = {**self._budget, "seconds": self._budget["seconds"] + elapsed}
            self._row = {"iteration": step, "perf/iteration_s": elapsed, **{f"budget/{k}": v for k, v in self._budget.items()}}
        self._pending = []

    def step_logged(self, logs: dict[str, Any]) -> bool:
        """TRL logged the step: its metrics join the row, which is evaluated, logged and checkpointed
        as an ES iteration's. Returns whether training ends here."""
        if self._row is None:
            return False
        row = self._row | {f"grpo/{name}": float(logs[name]) for name in TRL_METRICS if isinstance(logs.get(name), (int, float))}
        self._row = None
        self._last, final = self._end_iteration(row)
        return final

    # ----------------------------------------------------------------- saving
    def _save(self, directory: Path) -> None:
        """An esft checkpoint holding TRL's own (`trl/`): written by TRL now, or, before TRL has run in
        this process (a run resumed at its end), the resumed checkpoint's."""
        if self._trl is not None:
            self._trl._save_checkpoint(self._trl.model, trial=None)
            files = TRLCheckpointFiles(self.run_dir / STAGING_DIR / f"checkpoint-{self._trl.state.global_step}", move=True)
        else:
            files = TRLCheckpointFiles(self.run.resume.checkpoint / TRL_DIR, move=False)
        state = {"iteration": self.state.iteration, "seed": self.args.seed, "run_id": self.run.run_id,
                 "named_files": self.run.named_files, "config": self.args.to_dict(), "checksum": self.engine.checksum(), "train_eval_overlap": self.task.metadata.get("train_eval_overlap", {})}
        save_checkpoint(files, directory, state, save_master=False)
