"""The ES math: strategies (ask/tell), reward shaping, fitness, the optimizer on the ES gradient, seeded noise
(noise, lowrank), the one update and each iteration's prompts (batches). Pure functions of seeds and numbers: no
model, no files, no processes."""

__all__ = ["batches", "fitness", "lowrank", "noise", "optimizers", "shaping", "strategies", "update"]
