"""Countdown: prompt, reward, safe evaluation, problem generator, data loaders and task registry."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from esft.tasks import TASKS, Task, TaskError, load_task
from esft.tasks.countdown import (
    UnsafeExpression,
    answer_score,
    countdown_accuracy,
    countdown_reward,
    format_score,
    make_prompt,
    safe_arithmetic,
)
from esft.tasks.countdown_data import (
    DIFFICULTIES,
    Difficulty,
    generate_problems,
    is_held_out,
    load_countdown_data,
    load_countdown_dataset_dict,
    load_countdown_json,
)

EXPECTED_PROMPT = (
    "You are a helpful assistant. You first think about the reasoning process in your mind and then "
    "provide the user with the answer.Using the numbers [21 68  8 36], create an equation that equals "
    "53. You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
    "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>.Let me solve this step by step.\n<think>"
)


def reward(completion: str, numbers: list[int], target) -> float:
    return countdown_reward(["p"], [completion], numbers=[numbers], target=[target])[0]


# --- prompt -----------------------------------------------------------------------------------


def test_make_prompt_is_verbatim_reference_prompt():
    assert make_prompt([21, 68, 8, 36], 53) == EXPECTED_PROMPT
    assert make_prompt([21, 68, 8, 36], "53") == EXPECTED_PROMPT


def test_make_prompt_pads_numbers_like_numpy():
    prompt = make_prompt([5, 100, 7], "-15.7272")
    assert "Using the numbers [  5 100   7], create an equation that equals -15.7272. You" in prompt
    assert "equals 27.4." in make_prompt([1, 2, 3], 27.4)
    assert "equals 98." in make_prompt([1, 2, 3], 98.0)


# --- format score -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" reasoning </think>\n<answer> 1 + 2 </answer>", 1.0),
        ("line one\nline two\n</think>\n<answer>\n3\n</answer>", 1.0),  # DOTALL think and answer
        (" reasoning </think> no answer tags", 0.1),
        ("no closing think, <answer> 3 </answer>", 0.5),
        (" reasoning </think>\n<answer> 3 </answer> and more text", 0.6),
        (" reasoning </think> <answer> 3 </answer>", 0.6),  # space instead of newline
        ("nothing at all", 0.0),
        ("", 0.0),
    ],
)
def test_format_score(completion, expected):
    assert format_score(completion) == pytest.approx(expected)


# --- answer score and reward ------------------------------------------------------------------

GOOD = " 68 - 21 = 47 </think>\n<answer> (68 - 21) + (36 - 8) - 22 </answer>"


def test_correct_answer_with_good_format_scores_1_1():
    completion = " easy </think>\n<answer> (36 - 8) + (68 - 21) - 22 </answer>"
    assert answer_score(completion, [21, 68, 8, 36, 22], 53) == 1.0
    assert reward(completion, [21, 68, 8, 36, 22], "53") == pytest.approx(1.1)
    assert reward(" t </think>\n<answer>21 + 68 - 36</answer>", [21, 68, 36], "53") == pytest.approx(1.1)


def test_correct_answer_bad_format_scores_answer_plus_partial_format():
    # Answer pair only: 0.1 * 0.5 + 1.
    assert reward("<answer>21 + 68 - 36</answer>", [21, 68, 36], "53") == pytest.approx(1.05)


def test_last_answer_counts():
    numbers, target = [21, 68, 36], "53"
    assert answer_score("<answer>1 + 1</answer> then <answer>21 + 68 - 36</answer>", numbers, target) == 1.0
    assert answer_score("<answer>21 + 68 - 36</answer> then <answer>1 + 1</answer>", numbers, target) == 0.0


@pytest.mark.parametrize(
    "expression",
    [
        "21 + 21 + 11",  # 21 used twice, 68 and 36 missing
        "68 - 36 + 21 + 0",  # extra number
        "68 - 15",  # numbers missing
        "21 + 68 - 36 + 36 - 36",  # 36 used three times
    ],
)
def test_numbers_must_be_used_exactly_once(expression):
    assert answer_score(f"<answer>{expression}</answer>", [21, 68, 36], "53") == 0.0


@pytest.mark.parametrize(
    "expression",
    ["21 + 68 - 36 + a", "2**5 + 21", "__import__('os')", "21 + 68 - 36.0", "abs(21 + 68 - 36)", "21+68-36;"],
)
def test_disallowed_characters_score_zero(expression):
    assert answer_score(f"<answer>{expression}</answer>", [21, 68, 36, 2, 5], "53") == 0.0


def test_power_is_rejected_even_though_its_characters_are_allowed():
    # "*" is an allowed character, so "**" gets past the character filter and must fail in the AST.
    assert answer_score("<answer>2**5 + 21</answer>", [2, 5, 21], "53") == 0.0
    with pytest.raises(UnsafeExpression):
        safe_arithmetic("2**10")


def test_division_by_zero_scores_zero():
    assert answer_score("<answer>53 / (3 - 3)</answer>", [53, 3, 3], "53") == 0.0
    with pytest.raises(ZeroDivisionError):
        safe_arithmetic("1 / (2 - 2)")


def test_non_integer_and_negative_targets():
    assert answer_score("<answer>137 / 5</answer>", [137, 5], "27.4") == 1.0
    completion, numbers = "<answer>(97 + 76) / (86 - 97)</answer>", [97, 76, 86, 97]
    assert answer_score(completion, numbers, "-15.727272727272727") == 1.0
    assert answer_score(completion, numbers, "-15.7272") == 0.0  # off by 7e-5, above the 1e-5 tolerance
    assert answer_score("<answer>3 - 14</answer>", [3, 14], "-11") == 1.0
    assert answer_score("<answer>3 - 14</answer>", [3, 14], "11") == 0.0


def test_empty_or_missing_answer_scores_zero():
    assert answer_score("<answer>   </answer>", [1, 2], "3") == 0.0
    assert answer_score("<answer></answer>", [1, 2], "3") == 0.0
    assert answer_score("1 + 2", [1, 2], "3") == 0.0
    assert reward("<answer></answer>", [1, 2], "3") == pytest.approx(0.05)


def test_huge_values_are_rejected_quickly():
    expression = "99*99*99*99*99*99*99*99"  # 9.2e15, above MAX_MAGNITUDE
    start = time.perf_counter()
    assert answer_score(f"<answer>{expression}</answer>", [99] * 8, str(99**8)) == 0.0
    with pytest.raises(UnsafeExpression):
        safe_arithmetic(expression)
    with pytest.raises(UnsafeExpression):
        safe_arithmetic("9" * 400)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("depth", [100, 1000])
def test_deep_nesting_is_rejected_quickly(depth):
    start = time.perf_counter()
    with pytest.raises(UnsafeExpression):
        safe_arithmetic("(" * depth + "1" + ")" * depth)
    with pytest.raises(UnsafeExpression):
        safe_arithmetic("-" * depth + "1")
    assert time.perf_counter() - start < 1.0


def test_safe_arithmetic_is_exact():
    assert safe_arithmetic("(1 + 2) / 3") == 1
    assert safe_arithmetic("137 / 5") * 5 == 137
    assert safe_arithmetic("-(3 - 14)") == 11


def test_accuracy_is_zero_one_and_ignores_format():
    completions = [
        "<answer>21 + 68 - 36</answer>",
        " ok </think>\n<answer>21 + 68 - 36</answer>",
        "<answer>1</answer>",
    ]
    accuracy = countdown_accuracy(["p"] * 3, completions, numbers=[[21, 68, 36]] * 3, target=["53"] * 3)
    assert accuracy == [1.0, 1.0, 0.0]


# --- generator --------------------------------------------------------------------------------


def _keys(rows):
    return {(tuple(sorted(row["numbers"])), row["target"]) for row in rows}


def test_generate_problems_is_reproducible():
    first = generate_problems(50, seed=3, difficulty="medium")
    assert first == generate_problems(50, seed=3, difficulty="medium")
    assert first != generate_problems(50, seed=4, difficulty="medium")
    assert len(_keys(first)) == 50  # distinct problems


@pytest.mark.parametrize("name", list(DIFFICULTIES))
def test_generated_solutions_are_correct_and_respect_difficulty(name):
    level = DIFFICULTIES[name]
    rows = generate_problems(200, seed=0, difficulty=name)
    for row in rows:
        assert answer_score(f"<answer>{row['solution']}</answer>", row["numbers"], row["target"]) == 1.0
        assert level.num_numbers[0] <= len(row["numbers"]) <= level.num_numbers[1]
        assert all(level.min_number <= n <= level.max_number for n in row["numbers"])
        assert 1 <= int(row["target"]) <= level.max_target
        assert set(row["solution"]) - set("0123456789() ") <= set(level.operators)
        assert row["prompt"] == make_prompt(row["numbers"], row["target"])
    sizes = Counter(len(row["numbers"]) for row in rows)
    assert set(sizes) == set(range(level.num_numbers[0], level.num_numbers[1] + 1))


def test_custom_difficulty_knobs():
    level = Difficulty(num_numbers=(2, 2), min_number=5, max_number=9, operators="*", max_target=81)
    rows = generate_problems(10, seed=1, difficulty=level)
    assert all(len(row["numbers"]) == 2 and "*" in row["solution"] for row in rows)
    assert all(int(row["target"]) == row["numbers"][0] * row["numbers"][1] for row in rows)
    with pytest.raises(ValueError, match="operators"):
        Difficulty(operators="^")


def test_train_and_eval_splits_never_share_a_problem():
    train = generate_problems(1000, seed=0, split="train")
    held_out = generate_problems(500, seed=1, split="eval")
    assert len(_keys(train)) == 1000 and len(_keys(held_out)) == 500
    assert _keys(train) & _keys(held_out) == set()
    assert not any(is_held_out(row["numbers"], row["target"]) for row in train)
    assert all(is_held_out(row["numbers"], row["target"]) for row in held_out)


def test_unknown_difficulty_raises_task_error():
    with pytest.raises(TaskError, match="easy, medium, paper"):
        generate_problems(1, seed=0, difficulty="impossible")


# --- loaders ----------------------------------------------------------------------------------

ROWS = [
    {
        "id": 0,
        "context": make_prompt([44, 19, 35], "98"),
        "numbers": [44, 19, 35],
        "target": "98",
        "solution": "((44 + 19) + 35)",
    },
    {"id": 7, "numbers": [99, 86, 76, 97], "target": "-15.727272727272727", "solution": None},
    {"id": 9, "numbers": [137, 5], "target": 27.4, "extra": "kept"},
    {"id": 11, "numbers": [3, 14], "target": -11},
]


def test_load_countdown_json(tmp_path):
    path = tmp_path / "problems.json"
    path.write_text(json.dumps(ROWS))
    rows = load_countdown_json(path)
    assert [row["target"] for row in rows] == ["98", "-15.727272727272727", "27.4", "-11"]
    assert rows[0]["prompt"] == rows[0]["context"] == make_prompt([44, 19, 35], 98)
    assert "create an equation that equals -15.727272727272727." in rows[1]["prompt"]
    assert rows[2]["extra"] == "kept" and rows[2]["id"] == 9 and rows[1]["solution"] is None
    assert load_countdown_data(path) == {"problems": rows}
    assert answer_score("<answer>137 / 5</answer>", rows[2]["numbers"], rows[2]["target"]) == 1.0


def test_load_dataset_dict_with_two_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{**row, "target": str(row["target"]), "extra": "", "context": ""} for row in ROWS]
    for row in rows:
        row["solution"] = row.get("solution") or ""
    dataset_dict = datasets.DatasetDict(
        {"bench_a": datasets.Dataset.from_list(rows[:3]), "bench_b": datasets.Dataset.from_list(rows[3:])}
    )
    dataset_dict.save_to_disk(str(tmp_path / "suite"))
    splits = load_countdown_data(tmp_path / "suite")
    assert sorted(splits) == ["bench_a", "bench_b"]
    assert [len(splits["bench_a"]), len(splits["bench_b"])] == [3, 1]
    assert splits["bench_b"][0]["target"] == "-11" and splits["bench_b"][0]["numbers"] == [3, 14]
    expected = EXPECTED_PROMPT.replace("[21 68  8 36]", "[44 19 35]").replace("53.", "98.")
    assert splits["bench_a"][0]["prompt"] == expected

    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tmp_path / "single"))
    single = load_countdown_dataset_dict(tmp_path / "single")
    assert list(single) == ["single"] and len(single["single"]) == 2


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ({"target": "98"}, "numbers"),
        ({"numbers": [1, 2]}, "target"),
        ({"numbers": "1 2 3", "target": "6"}, "numbers"),
        ({"numbers": [1, 2.5], "target": "6"}, "numbers"),
        ({"numbers": [1, True], "target": "6"}, "numbers"),
        ({"numbers": [1, 2], "target": "six"}, "target"),
        ({"numbers": [1, 2], "target": [3]}, "target"),
        ({"numbers": [1, 2], "target": "nan"}, "target"),
    ],
)
def test_malformed_row_names_file_row_and_column(tmp_path, row, column):
    path = tmp_path / "broken_rows.json"
    path.write_text(json.dumps([ROWS[0], ROWS[1], row]))
    with pytest.raises(TaskError) as info:
        load_countdown_json(path)
    message = str(info.value)
    assert "broken_rows.json" in message and "row 2" in message and f"column '{column}'" in message
    assert "each row needs `numbers`" in message  # says how to fix it


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("this is not json", "not valid JSON"),
        ('{"numbers": [1]}', "expected a JSON list"),
        ("[]", "no rows"),
        ("[3]", "row 0"),
    ],
)
def test_bad_json_file_raises_task_error_naming_file(tmp_path, text, fragment):
    path = tmp_path / "bad_file.json"
    path.write_text(text)
    with pytest.raises(TaskError, match=fragment) as info:
        load_countdown_data(path)
    assert "bad_file.json" in str(info.value)


def test_missing_path_and_non_dataset_directory_raise_task_error(tmp_path):
    with pytest.raises(TaskError, match="no_such.json"):
        load_countdown_data(tmp_path / "no_such.json")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(TaskError, match="empty_dir"):
        load_countdown_data(tmp_path / "empty_dir")


# --- task registry ----------------------------------------------------------------------------


def test_load_task_default_countdown():
    task = load_task("countdown")
    assert isinstance(task, Task) and task.name == "countdown"
    assert len(task.train_dataset) == 1000
    assert list(task.eval_datasets) == ["heldout"] and len(task.eval_datasets["heldout"]) == 500
    assert _keys(task.train_dataset) & _keys(task.eval_datasets["heldout"]) == set()
    assert task.reward_funcs == [countdown_reward] and task.accuracy_func is countdown_accuracy
    assert task.metadata["train_eval_overlap"] == {"heldout": 0}


def test_load_task_from_files(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(ROWS[:2]))
    (tmp_path / "eval.json").write_text(json.dumps(ROWS[1:]))
    task = load_task("countdown", train_data=tmp_path / "train.json", eval_data=str(tmp_path / "eval.json"))
    assert len(task.train_dataset) == 2
    assert list(task.eval_datasets) == ["eval"] and len(task.eval_datasets["eval"]) == 3
    assert task.metadata["train_eval_overlap"] == {"eval": 1}


def test_train_path_with_several_splits_needs_a_train_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list([{"numbers": [1, 2], "target": "3"}])
    datasets.DatasetDict({"a": one, "b": one}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(TaskError, match="a, b"):
        load_task("countdown", train_data=tmp_path / "ab")
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "tt"))
    assert len(load_task("countdown", train_data=tmp_path / "tt", eval_size=5).train_dataset) == 1


def test_unknown_task_and_difficulty_raise_task_error():
    assert "countdown" in TASKS
    with pytest.raises(TaskError, match="known tasks: countdown"):
        load_task("chess")
    with pytest.raises(TaskError, match="unknown Countdown difficulty 'hardest'"):
        load_task("countdown", difficulty="hardest", train_size=5, eval_size=5)
