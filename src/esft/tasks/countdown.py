"""Countdown: combine the given numbers with + - * / to reach a target (the paper's main task).

Prompt and reward follow the reference implementation of arXiv 2509.24372 exactly (see
`../shared/reference/ALGORITHM.md` in the developer docs): reward = 0.1 * format + answer, scored on
the completion only. Model output is never passed to `eval`: answers are parsed into an AST that may
only hold numbers, + - * / and parentheses, and evaluated with bounds on size and depth.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from numbers import Integral

from esft.tasks.base import completion_text, trusted_reward

SYSTEM = ("You are a helpful assistant. You first think about the reasoning process in your mind and then "
          "provide the user with the answer.")
QUESTION = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
            "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
            "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
REPLY_START = "Let me solve this step by step.\n<think>"
PROMPT_TEMPLATE = SYSTEM + QUESTION + REPLY_START
"""The paper's raw prompt: its three parts run together, as the reference writes them."""

_FULL_FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
_THINK_PAIR = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_PAIR = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_ANSWER_CONTENT = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"^[0-9+\-*/() ]+$")

# Bounds that keep a hostile answer from costing time or memory: every literal and intermediate
# value must stay below this magnitude, and the expression may not nest deeper than this.
MAX_MAGNITUDE = 10**12
MAX_DEPTH = 32
MAX_ANSWER_CHARS = 512


def format_numbers(numbers: Sequence[int]) -> str:
    """Print numbers the way numpy prints an int array (the reference prompts): `[21 68  8 36]`."""
    width = max(len(str(n)) for n in numbers)
    return "[" + " ".join(str(n).rjust(width) for n in numbers) + "]"


def format_target(target: float | int | str) -> str:
    """The target as the reference prints it: integers without a decimal point."""
    if isinstance(target, str):
        return target
    if isinstance(target, Integral):
        return str(int(target))  # not via float: large ints would lose digits
    if float(target).is_integer():
        return str(int(target))
    return repr(float(target))


def make_prompt(numbers: Sequence[int], target: float | int | str) -> str:
    """The paper's raw Countdown prompt (no chat template), ending in `<think>`."""
    return PROMPT_TEMPLATE.format(numbers=format_numbers(numbers), target=format_target(target))


def chat_prompt(row: dict) -> list[dict[str, str]]:
    """--prompt-format chat: the paper's instructions as the system turn, the question as the user's, and the
    assistant's reply continued from 'Let me solve this step by step.\n<think>' (as in the raw prompt)."""
    question = QUESTION.format(numbers=format_numbers(row["numbers"]), target=format_target(row["target"]))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": REPLY_START}]


class UnsafeExpression(ValueError):
    """The answer is not plain arithmetic, or it is too large or too deep to evaluate."""


def safe_arithmetic(expression: str) -> Fraction:
    """Evaluate `expression` exactly, allowing only integers, + - * /, unary minus and parentheses.

    Raises UnsafeExpression (or ZeroDivisionError) for anything else, for values above
    MAX_MAGNITUDE and for nesting deeper than MAX_DEPTH.
    """
    if len(expression) > MAX_ANSWER_CHARS:
        raise UnsafeExpression("expression too long")
    if expression.count("(") > MAX_DEPTH:
        # Checked before parsing: Python's own parser recurses on parentheses.
        raise UnsafeExpression("expression nested too deeply")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise UnsafeExpression(f"not an expression: {error}") from None
    return _evaluate(tree.body, depth=0)


def _evaluate(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise UnsafeExpression("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, depth + 1)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Add):
            value = left + right
        elif isinstance(node.op, ast.Sub):
            value = left - right
        elif isinstance(node.op, ast.Mult):
            value = left * right
        else:
            value = left / right  # ZeroDivisionError propagates and scores 0
    else:
        # Name the operator too: "Pow is not allowed" says more than "BinOp is not allowed".
        op = getattr(node, "op", None)
        raise UnsafeExpression(f"{type(op or node).__name__} is not allowed")
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise UnsafeExpression("value out of range")
    return value


def format_score(completion: str) -> float:
    """1.0 for the exact `<think>…</think>\\n<answer>…</answer>` shape, else partial credit.

    Scored on "<think>" + completion because the prompt ends with the opening `<think>`.
    """
    text = "<think>" + completion
    if _FULL_FORMAT.match(text):
        return 1.0
    score = 0.0
    if _THINK_PAIR.search(text):
        score += 0.1
    if _ANSWER_PAIR.search(text):
        score += 0.5
    return score


def final_answer(completion: str) -> str | None:
    """The last `<answer>` expression with its spaces removed (what RandOpt's members vote on), or None."""
    answers = _ANSWER_CONTENT.findall(completion)
    expression = "".join(answers[-1].split()) if answers else ""
    return expression or None


def answer_score(completion: str, numbers: Sequence[int], target: float | int | str) -> float:
    """1.0 if the last `<answer>` uses each given number exactly once and equals the target."""
    answers = _ANSWER_CONTENT.findall(completion)
    if not answers:
        return 0.0
    expression = answers[-1].strip()
    if not expression or not _ALLOWED_CHARS.match(expression):
        return 0.0
    used = Counter(int(token) for token in re.findall(r"\d+", expression))
    if used != Counter(int(n) for n in numbers):
        return 0.0
    try:
        value = safe_arithmetic(expression)
        goal = float(target)
    except (UnsafeExpression, ZeroDivisionError, ValueError, TypeError, OverflowError):
        return 0.0
    if not math.isfinite(goal):
        return 0.0
    return 1.0 if abs(float(value) - goal) < 1e-5 else 0.0


@trusted_reward  # our own code, safe on any model output: runs in-process, no sandbox overhead
def countdown_reward(
    prompts: Sequence, completions: Sequence, *, numbers: Sequence, target: Sequence, **kwargs
) -> list[float]:
    """The paper's reward, one float per completion: 0.1 * format + answer (at most 1.1).

    TRL reward signature; `numbers` and `target` are the dataset columns of the same rows; completions are
    text, or TRL's chat form under --prompt-format chat.
    """
    texts = [completion_text(completion) for completion in completions]
    return [
        0.1 * format_score(text) + answer_score(text, nums, goal)
        for text, nums, goal in zip(texts, numbers, target, strict=True)
    ]


@trusted_reward
def countdown_accuracy(
    prompts: Sequence, completions: Sequence, *, numbers: Sequence, target: Sequence, **kwargs
) -> list[float]:
    """1.0 where the answer is correct, else 0.0 (format ignored): the task's accuracy."""
    return [
        answer_score(completion_text(completion), nums, goal)
        for completion, nums, goal in zip(completions, numbers, target, strict=True)
    ]
