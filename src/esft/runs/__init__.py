"""A run's files: claiming the run directory and resuming it (directory), checkpoints and their
verification (checkpoint), metrics.jsonl and TensorBoard (metrics), and the HTML report (report, report_data)."""

__all__ = ["checkpoint", "directory", "metrics", "report", "report_data"]
