"""The GRPO baseline (`--algorithm grpo`): TRL's GRPOTrainer behind ESTrainer's interface (baseline) and
the TRL side of it (trl_trainer: GRPOConfig, the step callback, TRL checkpoints inside esft's)."""

from esft.grpo.baseline import GRPOBaseline

__all__ = ["GRPOBaseline"]
