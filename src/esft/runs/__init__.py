"""A run's files: claiming the run directory and resuming it (directory), checkpoints and their
verification (checkpoint), metrics.jsonl and TensorBoard (metrics), the HTML report (report, report_data), and
the settings a run hands on to `esft train --resume` and `esft eval` (inherited, eval_origin)."""

__all__ = ["checkpoint", "directory", "eval_origin", "inherited", "metrics", "report", "report_data"]
