"""Status lines beside the progress bar: each on its own line, never glued onto the bar.

While a training run's bar is open (`attach`), `say` and the warnings of the "esft" logger are
written with tqdm.write (the bar is cleared, the line printed, the bar drawn again below it), and
`waiting` shows what the run is waiting for (a reward service that does not answer) in the bar
itself. Without a bar they are plain stderr lines. Also the bars themselves (`progress_bar`, for
training and evaluation) and the accuracy lines. Imports nothing of esft: any room may use it.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

_lock = threading.Lock()
_bar: Any = None
_handler: logging.Handler | None = None
_waits: dict[str, str] = {}


class _BarHandler(logging.Handler):
    """The "esft" logger's lines, above the bar (installed only when nobody configured logging)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never break a run
            self.handleError(record)


def attach(bar: Any) -> None:
    """Route status lines around `bar` (a tqdm bar) until `detach`."""
    global _bar, _handler
    with _lock:
        _bar = bar
        logger = logging.getLogger("esft")
        if _handler is None and not logger.handlers and not logging.getLogger().handlers:
            _handler = _BarHandler(logging.WARNING)
            logger.addHandler(_handler)


def detach() -> None:
    global _bar, _handler
    with _lock:
        _bar = None
        _waits.clear()
        if _handler is not None:
            logging.getLogger("esft").removeHandler(_handler)
            _handler = None


def say(text: str) -> None:
    """One status line on stderr, on its own line (above the progress bar when one is open)."""
    bar = _bar
    if bar is not None and not getattr(bar, "disable", True):
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def waiting(key: str, text: str | None) -> None:
    """Show (`text`) or clear (None) what the run waits for under `key`, in the progress bar."""
    with _lock:
        if text is None:
            if _waits.pop(key, None) is None:
                return
        else:
            _waits[key] = text
        shown = "; ".join(_waits.values())
        bar = _bar
    if bar is not None and not getattr(bar, "disable", True):
        bar.set_postfix_str(shown, refresh=True)


def report_accuracy(when: str, metrics: dict[str, float]) -> None:
    """`<split> accuracy before|after: x% (reward r)`, or `<split> reward before|after: r` for a task
    without accuracy (the user's own reward), one line per split, each on a line of its own."""
    splits = dict.fromkeys(key.split("/")[1] for key in metrics if key.startswith("eval/") and key.count("/") == 2)
    for split in splits:
        accuracy, reward = metrics.get(f"eval/{split}/accuracy"), metrics.get(f"eval/{split}/reward")
        if accuracy is not None:
            line = f"{split} accuracy {when}: {100 * accuracy:.1f}%" + (f" (reward {reward:.4g})" if reward is not None else "")
        elif reward is not None:
            line = f"{split} reward {when}: {reward:.4g}"
        else:
            continue
        print(line, file=sys.stderr, flush=True)


def progress_bar(total: int, initial: int = 0, desc: str = "ES", unit: str = "it", enabled: bool = True,
                 leave: bool = True) -> Any:
    """A tqdm bar on stderr (a no-op bar when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=not enabled or total == 0,
                leave=leave)
