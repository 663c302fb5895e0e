"""Bring your own task: `--task module:make_task` / `--task file.py:make_task`, or no code at all:
`--train-data FILE --reward-funcs module:fn[,module:fn2] [--reward-weights 1,0.5]`.

Everything here runs before the model loads, so bad input fails fast with one message that names
the file, row, split or function at fault.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from esft.rewards import conventions, usercode
from esft.settings.rules import split_list
from esft.rewards.remote import RewardServiceError, remote_reward
from esft.rewards.models import RewardModel, RewardModelError
from esft.rewards.runner import PROVIDED_ARGUMENTS, reward_name
from esft.tasks.base import Task, TaskError
from esft.tasks.loading import apply_template, check_rows, common_columns, load_splits, train_split
from esft.tasks.selection import with_prompts
from esft.rewards.usercode import describe

# The arguments a task factory may take (it receives those it names, or all with **kwargs).
FACTORY_SETTINGS = ("train_data", "eval_data", "seed", "difficulty", "train_size", "eval_size")


def is_spec(value: str) -> bool:
    """True for "module:function" or "path/to/file.py:function"."""
    return ":" in value


def load_callable(spec: str, option: str) -> Callable:
    """The function named by "module:function" or "path/to/file.py:function" (esft.rewards.usercode), with
    a TaskError naming `option` when it cannot be loaded."""
    try:
        return usercode.load_callable(spec, option)
    except usercode.UserCodeError as error:
        raise TaskError(str(error)) from None


def check_reward_func(func: Any, columns: set[str], where: str, role: str = "reward function",
                      rows: Sequence[dict[str, Any]] = (), target: str | None = None) -> None:
    """TaskError unless `func` can be called as f(prompts=..., completions=..., **columns) with
    `columns` (TRL's convention): it must take `completions`, take its arguments by keyword, and
    every argument without a default must be one of PROVIDED_ARGUMENTS or a column of the data
    (`columns`: those every row has; `rows`, when given, name the first row that lacks one)."""
    name = reward_name(func)
    if not callable(func):
        raise TaskError(f"{role} {func!r} is not callable")
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return  # a builtin or extension: nothing to check
    params = list(signature.parameters.values())
    convention = conventions.convention_of(func)
    if convention != conventions.TRL:  # ES-at-Scale's reward(model_output, target) or verl's compute_score
        if conventions.target_column(columns, target) is None:
            wanted = f"column {target!r}" if target else f"a target column ({', '.join(conventions.TARGET_COLUMNS)})"
            raise TaskError(f"{role} {name}{signature} is called per completion with its row's target ({convention}'s "
                            f"signature), but {where} has no {wanted} (its columns: {', '.join(sorted(columns)) or 'none'}); "
                            "name it with --target-column")
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    convention = ("reward functions are called as f(prompts=..., completions=..., **columns), TRL's convention (or "
                  "per completion: ES-at-Scale's reward(model_output, target), verl's compute_score(data_source, "
                  "solution_str, ground_truth, extra_info))")
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        raise TaskError(f"{role} {name}{signature} has a wrong signature: positional-only {positional_only}; {convention}")
    if "completions" not in by_keyword and not takes_any:
        raise TaskError(f"{role} {name}{signature} has a wrong signature: it takes no 'completions' (nor **kwargs); {convention}")
    required = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
    missing = [column for column in required if column not in PROVIDED_ARGUMENTS and column not in columns]
    if missing:
        lacking = next((i for i, row in enumerate(rows) if missing[0] not in row), None)
        if lacking is not None and any(missing[0] in row for row in rows):
            raise TaskError(f"{role} {name} needs column {missing[0]!r}, which {where} row {lacking} does not have "
                            "(every row needs it)")
        raise TaskError(f"{role} {name} needs column {missing[0]!r}, which {where} does not have "
                        f"(its columns: {', '.join(sorted(columns)) or 'none besides prompt'})")


def _eval_splits(eval_dataset: Any, label: str) -> dict[str, Any]:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, Mapping):  # a dict of splits or a datasets.DatasetDict
        return dict(eval_dataset)
    return {label: eval_dataset}


def prepare_task(task: Any, origin: str = "the task") -> Task:
    """Check a Task before the policy model loads: rows (dicts with a prompt, after the optional template),
    reward and accuracy functions against the columns of every dataset; RewardModel rewards are loaded
    (a bad one is a TaskError here). Returns it normalised."""
    if not isinstance(task, Task):
        raise TaskError(f"{origin} returned a {type(task).__name__}, not an esft Task")
    train_where = task.metadata.get("train_where", "train_dataset")
    eval_where = task.metadata.get("eval_where", "eval_dataset")
    raw_train = [] if task.train_dataset is None else list(task.train_dataset)
    splits = {split: list(rows) for split, rows in _eval_splits(task.eval_datasets, "eval").items()}
    labels = {split: task.metadata.get("eval_labels", {}).get(split, f"{eval_where}[{split!r}]") for split in splits}
    if task.prompt_template:
        raw_train = apply_template([dict(r) for r in raw_train], task.prompt_template, train_where)
        splits = {s: apply_template([dict(r) for r in rows], task.prompt_template, labels[s]) for s, rows in splits.items()}
    train = check_rows(raw_train, train_where) if raw_train else []
    evals = {split: check_rows(rows, labels[split]) for split, rows in splits.items()}
    funcs = list(task.reward_funcs) if isinstance(task.reward_funcs, Sequence) else [task.reward_funcs]
    if not funcs:
        raise TaskError(f"{origin} has no reward functions")
    if task.reward_weights is not None and len(task.reward_weights) != len(funcs):
        raise TaskError(f"{origin}: {len(task.reward_weights)} reward weights for {len(funcs)} reward functions")
    for func in funcs:  # a RewardModel built by hand loads now, as one named by a string does: a bad one fails here
        if isinstance(func, RewardModel):
            try:
                func.load()
            except RewardModelError as error:
                raise TaskError(str(error)) from None
    datasets = ([(train_where, train)] if train else []) + [(labels[s], rows) for s, rows in evals.items()]
    target = task.metadata.get("target_column")
    for where, rows in datasets:
        columns = common_columns(rows)
        for func in funcs:
            check_reward_func(func, columns, where, rows=rows, target=target)
        if task.accuracy_func is not None:
            check_reward_func(task.accuracy_func, columns, where, role="accuracy function", rows=rows)
    return dataclasses.replace(task, train_dataset=train, eval_datasets=evals, reward_funcs=funcs)


def service_rewards(reward_model: str | None, reward_url: str | None, device: str = "auto",
                    deadline: float | None = None) -> list[Any]:
    """--reward-model models (loaded now) and --reward-url services (asked for /health now, with a few
    quick retries) as reward functions: a bad model or an unreachable service fails here, before the
    policy model loads. During the run, a service's calls retry for `deadline` seconds."""
    funcs: list[Any] = [_load_reward_model(spec, device, f"--reward-model {spec}") for spec in split_list(reward_model)]
    for group in split_list(reward_url):
        remote = remote_reward(group.split("|"))
        try:
            remote.health()
        except RewardServiceError as error:
            raise TaskError(f"--reward-url {group}: {error} (start one with esft serve-reward --model DIR, or set "
                            "$ESFT_REWARD_API_KEY if it asks for a key)") from None
        remote.deadline = deadline
        funcs.append(remote)
    seen: dict[str, int] = {}
    for func in funcs:  # metrics are keyed by name: two models called "final" become final and final-2
        seen[func.__name__] = seen.get(func.__name__, 0) + 1
        if seen[func.__name__] > 1:
            func.__name__ += f"-{seen[func.__name__]}"
    return funcs


def _load_reward_model(spec: str, device: str, where: str) -> RewardModel:
    try:
        return RewardModel(spec, device=device, where=where).load()
    except RewardModelError as error:
        raise TaskError(str(error)) from None


def _reward_from_string(spec: str, device: str) -> Any:
    """As in TRL: "module:function" is a function, anything else (a directory, a hub id) a reward model."""
    if is_spec(spec) and not Path(spec).is_dir():
        return load_callable(spec, "reward_funcs")
    return _load_reward_model(spec, device, f"reward_funcs {spec!r}")


def task_from_objects(reward_funcs: Any, train_dataset: Any, eval_dataset: Any, reward_weights: Any,
                      accuracy_func: Any, reward_model_device: str = "auto", prompt_column: str | None = None,
                      prompt_template: str | None = None, target_column: str | None = None) -> Task:
    """The ESTrainer(reward_funcs=..., train_dataset=..., eval_dataset=...) task. Reward functions
    may be callables, "module:function" strings or, as in TRL, reward model directories / hub ids
    (loaded on `reward_model_device`). A DatasetDict (or dict of splits) as `train_dataset` trains on
    its `train` split (its only split, if it has one) and, without `eval_dataset`, evaluates its other
    splits, as --train-data does."""
    if reward_funcs is None:
        raise TaskError("reward_funcs is required when train_dataset or eval_dataset is given")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    funcs = [_reward_from_string(f, reward_model_device) if isinstance(f, str) else f for f in funcs]
    if isinstance(accuracy_func, str):
        accuracy_func = load_callable(accuracy_func, "accuracy_func")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise TaskError(f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward functions")
    eval_where = "eval_dataset"
    if isinstance(train_dataset, Mapping):  # load_dataset(...) returns a DatasetDict
        splits, (name, train_dataset) = train_dataset, _train_of(train_dataset)
        if eval_dataset is None and len(splits) > 1:  # its other splits are the evaluation splits, as with --train-data
            eval_dataset, eval_where = {split: rows for split, rows in splits.items() if split != name}, "train_dataset"
    single = eval_dataset is not None and not isinstance(eval_dataset, Mapping)
    # one eval dataset: reported under its own split name (load_dataset(...)["test"] -> eval/test/...), else heldout
    label = str(getattr(eval_dataset, "split", None) or "heldout") if single else "eval"
    evals = {split: with_prompts(rows, prompt_column, prompt_template, f"{eval_where}[{split!r}]")
             for split, rows in _eval_splits(eval_dataset, label).items()}
    train_dataset = with_prompts(train_dataset, prompt_column, prompt_template, "train_dataset") if train_dataset is not None else []
    task = Task("custom", train_dataset, evals, funcs,
                list(reward_weights) if reward_weights is not None else None, accuracy_func,
                metadata=({"eval_labels": {label: "eval_dataset"}} if single else {}) | {"target_column": target_column})
    return prepare_task(task, "the given datasets")


def _train_of(splits: Mapping) -> tuple[Any, Any]:
    """The training split of a dict of splits / DatasetDict, and its name: its only split, else 'train'."""
    if len(splits) == 1:
        return next(iter(splits.items()))
    if "train" in splits:
        return "train", splits["train"]
    raise TaskError(f"train_dataset is a DatasetDict (or dict) with splits {', '.join(map(str, splits)) or 'none'} and none "
                    "is named 'train'; pass one split, e.g. train_dataset=data['<split>']")


def task_from_data(train_data: str | None, eval_data: str | None, reward_funcs: str | None, reward_weights: list[float] | None,
                   reward_model: str | None = None, reward_url: str | None = None, reward_model_device: str = "auto",
                   reward_url_deadline: float | None = None, prompt_column: str | None = None,
                   prompt_template: str | None = None, target_column: str | None = None) -> Task:
    """`--train-data/--eval-data` + `--reward-funcs` (and/or `--reward-model`, `--reward-url`): no
    code beyond the reward functions. Rewards in that order (the order of --reward-weights)."""
    if train_data is None and eval_data is None:
        flag = "--reward-funcs" if reward_funcs else "--reward-model" if reward_model else "--reward-url"
        raise TaskError(f"{flag}: give the data too, with --train-data FILE (and/or --eval-data FILE)")
    funcs = [load_callable(spec.strip(), "--reward-funcs") for spec in (reward_funcs or "").split(",") if spec.strip()]
    train, evals, metadata = [], {}, {}
    if train_data is not None:
        splits = load_splits(train_data)
        name, train = train_split(splits, train_data)
        if not train:
            raise TaskError(f"--train-data {train_data}: has no rows; give a file with one row per prompt")
        metadata["train_where"] = f"{train_data}" if len(splits) == 1 else f"{train_data} (split 'train')"
        if eval_data is None:  # a DatasetDict's other splits are its evaluation splits
            evals = {split: rows for split, rows in splits.items() if split != name}
            metadata["eval_labels"] = {split: f"{train_data} (split {split!r})" for split in evals}
    if eval_data is not None:
        evals = load_splits(eval_data)
        single_file = Path(eval_data).is_file()
        metadata["eval_labels"] = {split: str(eval_data) if single_file else f"{eval_data} (split {split!r})" for split in evals}
    train = with_prompts(train, prompt_column, prompt_template, metadata.get("train_where", "--train-data"))
    labels = metadata.get("eval_labels", {})
    evals = {split: with_prompts(rows, prompt_column, prompt_template, labels.get(split, split)) for split, rows in evals.items()}
    funcs += service_rewards(reward_model, reward_url, reward_model_device, reward_url_deadline)  # after the data: bad data fails faster
    task = Task("custom", train, evals, funcs, reward_weights, metadata=metadata | {"target_column": target_column})
    return prepare_task(task, "--reward-funcs")


def task_from_factory(spec: str, settings: dict[str, Any]) -> Task:
    """`--task module:make_task`: call the factory with the settings it takes, check its Task."""
    factory = load_callable(spec, "--task")
    try:
        parameters = inspect.signature(factory).parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
        names = {p.name for p in parameters}
    except (TypeError, ValueError):
        takes_any, names = False, set()
    kwargs = {k: v for k, v in settings.items() if k in FACTORY_SETTINGS and (takes_any or k in names)}
    try:
        task = factory(**kwargs)
    except TaskError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's factory failed: say where
        raise TaskError(f"--task {spec}: the task factory raised {describe(error)}") from None
    return prepare_task(task, f"--task {spec}")
