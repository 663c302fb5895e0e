r"""Grading `\boxed{}` answers: extraction, normalisation, and math-verify.

`grade` runs in a sandbox worker with a time limit per check (see esft.tasks.math_task): sympy can
take unbounded time on hostile input, and math-verify's own timeout uses signal.alarm, which only
works in a main thread. Here it is disabled (timeout None) and the worker is killed instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are not graded (score 0): no real answer is that long."""


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (or `\fbox{...}`) with matched braces; `\boxed 5` → "5"."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    if rest.startswith(" "):  # `\boxed 5`: up to the next space or dollar
        token = re.match(r"\s*([^\s$]+)", rest)
        return token.group(1) if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:index]
    return None  # unbalanced


_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}",
           "\\%", "%", "\\$")


def normalize(answer: Any) -> str:
    """A canonical form for string comparison: no spacing commands, `\\text{}` unwrapped, dfrac →
    frac, no spaces, no trailing period, `x = 5` → `5`, thousands separators dropped, integers
    written without a decimal point."""
    text = str(answer).strip()
    text = _TEXT_COMMANDS.sub(r"\1", text)
    for token in _REMOVE:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"^[a-zA-Z]=", "", text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    try:
        number = float(text)
    except ValueError:
        return text
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return repr(number)


def final_answer(completion: str) -> str | None:
    r"""The last `\boxed{}` answer, normalized (what --algorithm randopt's members vote on), or None."""
    boxed = last_boxed(completion)
    return normalize(boxed) if boxed is not None else None


def gold_answers(answer: Any) -> list[str]:
    """Gold answers as strings: a float 5.0 → "5"; a list (minerva, olympiad_bench) → each item."""
    items = answer if isinstance(answer, (list, tuple)) else [answer]
    golds = []
    for item in items:
        if isinstance(item, float) and item.is_integer():
            golds.append(str(int(item)))
        elif item is not None:
            golds.append(str(item))
    return golds


def grade(completion: str, golds: Sequence[str]) -> float:
    """1.0 if the last boxed answer equals a gold answer after normalisation, or math-verify proves
    them equal; else 0.0."""
    boxed = last_boxed(completion)
    if boxed is None or not boxed.strip() or len(boxed) > MAX_ANSWER_CHARS:
        return 0.0
    predicted = normalize(boxed)
    if any(predicted == normalize(gold) for gold in golds):
        return 1.0
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its own timeout is off
    parsed = parse(f"${boxed}$", parsing_timeout=None)
    if not parsed:
        return 0.0
    for gold in golds:
        gold_parsed = parse(f"${gold}$", parsing_timeout=None)
        if gold_parsed and verify(gold_parsed, parsed, timeout_seconds=None):
            return 1.0
    return 0.0


def warm_up() -> None:
    """Import math-verify and run one check, so a new worker's first real check is not slow."""
    grade("\\boxed{\\frac{1}{2}}", ["0.5"])
