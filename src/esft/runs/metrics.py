"""Metrics sinks: metrics.jsonl always, plus TensorBoard (default) or Weights & Biases."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from esft.files import METRICS_LIMIT, open_for_append, read_regular_text, write_text_atomic

METRICS_FILE = "metrics.jsonl"


def check_backend(backend: str) -> None:
    """Fail early (before any model loads) when the chosen backend's package is missing."""
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(backend)
    if package is None:
        return
    try:
        __import__(package)
    except ImportError:
        raise ImportError(f"--logging {backend} needs the '{package}' package: pip install {package}, or use --logging none") from None


class MetricsLogger:
    """One JSON object per line in `<run>/metrics.jsonl`; the same scalars to the chosen backend."""

    def __init__(
        self, run_dir: Path, backend: str = "tensorboard", config: dict[str, Any] | None = None, run_name: str = "", resume_at: int = 0
    ):
        self.path = Path(run_dir) / METRICS_FILE
        self.backend = backend
        self._writer = None
        self._wandb = None
        if backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run hides the events the run logged after its checkpoint.
            self._writer = SummaryWriter(log_dir=str(run_dir), purge_step=resume_at + 1 if resume_at else None)
        elif backend == "wandb":
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "esft"), name=run_name, config=config, dir=str(run_dir))

    def last_budget(self) -> dict[str, float]:
        """The `budget/*` totals of the last row already logged (a resumed run counts on from them;
        esft.runs.directory has set aside the rows after the resume point)."""
        budget = {"completions": 0, "tokens": 0, "seconds": 0.0}
        if self.path.exists():
            for line in self._text().splitlines():
                row = _row(line)
                if row is not None and "budget/completions" in row:
                    budget = {key: row.get(f"budget/{key}", budget[key]) for key in budget}
        return budget

    def row_of(self, iteration: int) -> dict[str, Any] | None:
        """The last row already logged for `iteration` (None if there is none)."""
        found = None
        if self.path.exists():
            for line in self._text().splitlines():
                row = _row(line)
                if row is not None and row.get("iteration") == iteration:
                    found = row
        return found

    def _text(self) -> str:
        return read_regular_text(self.path, METRICS_LIMIT, errors="replace")

    def log(self, row: dict[str, Any]) -> None:
        """Write one row (must hold `iteration`): appended with one write call and flushed, or, when
        the file's last row has the same iteration (the training row written before its evaluation,
        or before a resumed run's final evaluation), merged into that row (the file rewritten
        atomically): one row per iteration, the same keys as an uninterrupted run's."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        lines = self._text().splitlines() if self.path.exists() else []
        last = _row(lines[-1]) if lines else None
        if last is not None and last.get("iteration") == clean["iteration"]:
            clean = {k: v for k, v in clean.items() if last.get(k) != v or k == "iteration"}  # only what is new
            write_text_atomic(self.path, "".join(line + "\n" for line in lines[:-1]) + json.dumps(last | clean) + "\n")
        else:
            with open_for_append(self.path) as handle:
                handle.write(json.dumps(clean) + "\n")
                handle.flush()
        step = row["iteration"]
        scalars = {k: v for k, v in clean.items() if k != "iteration" and isinstance(v, (int, float)) and v is not None}
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


def _row(line: str) -> dict[str, Any] | None:
    """A metrics.jsonl line as a dict, None for a blank, torn or foreign line."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    return row if isinstance(row, dict) else None
