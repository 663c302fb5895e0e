"""The trainer's loop helpers: evaluation, reward-function faults (reward_faults), iteration_metrics."""
