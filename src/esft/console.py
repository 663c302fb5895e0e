"""What a run says on stderr besides its errors: the accuracy lines and the progress bars."""

from __future__ import annotations

import sys
from typing import Any


def report_accuracy(when: str, metrics: dict[str, float]) -> None:
    """`<split> accuracy before|after: x%`, one line per split, each on a line of its own."""
    for key, value in metrics.items():
        if key.startswith("eval/") and key.endswith("/accuracy") and key.count("/") == 2:
            print(f"{key.split('/')[1]} accuracy {when}: {100 * value:.1f}%", file=sys.stderr, flush=True)


def progress_bar(total: int, initial: int = 0, desc: str = "ES", unit: str = "it", enabled: bool = True,
                 leave: bool = True) -> Any:
    """A tqdm bar on stderr (a no-op bar when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=not enabled or total == 0,
                leave=leave)
