"""The ES math: ask/tell and reward shaping (strategy), seeded noise (noise, lowrank), and each
iteration's prompts (batches). Pure functions of seeds and numbers: no model, no files, no processes."""

__all__ = ["batches", "lowrank", "noise", "strategy"]
