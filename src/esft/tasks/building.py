"""The one way in to the tasks room: `build_task(TaskSettings, ...)` builds a run's task from the settings
it names (a registered task, a `--task module:function` factory, or data files with reward functions) or
from the objects given to ESTrainer, and applies --train-rows, --eval-rows and --eval-size. The trainer
hands over a `TaskSettings` (esft.settings.config.settings_for), never the whole ESConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from esft.settings.rules import ConfigError, custom_rewards, reward_weights
from esft.tasks import TASKS, load_task
from esft.tasks.base import Task, TaskError
from esft.tasks.custom import FACTORY_SETTINGS, is_spec, prepare_task, task_from_data, task_from_factory, task_from_objects
from esft.tasks.selection import select_rows


@dataclass(frozen=True)
class TaskSettings:
    """The settings a task is built from: ESConfig's fields of these names (esft.settings.fields, where each
    is documented), defaults as there."""

    task: str = "countdown"
    train_data: str | None = None
    eval_data: str | None = None
    train_rows: str | None = None
    eval_rows: str | None = None
    prompt_column: str | None = None
    prompt_template: str | None = None
    difficulty: str = "easy"
    train_size: int = 1000
    eval_size: int | None = None
    seed: int = 0
    reward_funcs: str | None = None
    reward_model: str | None = None
    reward_url: str | None = None
    reward_weights: str | None = None
    target_column: str | None = None
    reward_model_device: str = "auto"
    reward_url_deadline: float = 60.0


def build_task(settings: TaskSettings, reward_funcs: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
               weights: Any = None, accuracy_func: Any = None) -> Task:
    """The run's task, checked before any model loads (TaskError or ConfigError, one line): the objects given to
    ESTrainer when there are any (`weights`: theirs, else --reward-weights), else the task `settings` name; then
    the rows --train-rows, --eval-rows and --eval-size select."""
    if reward_funcs is None and train_dataset is None and eval_dataset is None:
        task = _task_named(settings)
    else:
        weights = weights if weights is not None else reward_weights(settings)  # GRPOConfig's reward_weights
        task = task_from_objects(reward_funcs, train_dataset, eval_dataset, weights, accuracy_func,
                                 settings.reward_model_device, settings.prompt_column, settings.prompt_template,
                                 settings.target_column)
    return select_rows(task, settings.train_rows, settings.eval_rows, settings.eval_size)


def _task_named(settings: TaskSettings) -> Task:
    """The task the settings name: --reward-funcs/--reward-model/--reward-url data, a --task module:function
    factory, or a registered task (countdown, arithmetic, times-table, word-problems, conciseness, math)."""
    if custom_rewards(settings):
        return task_from_data(settings.train_data, settings.eval_data, settings.reward_funcs, reward_weights(settings),
                              settings.reward_model, settings.reward_url, settings.reward_model_device,
                              settings.reward_url_deadline, settings.prompt_column, settings.prompt_template,
                              settings.target_column)
    if settings.task not in TASKS and not is_spec(settings.task):
        raise TaskError(f"--task: unknown task {settings.task!r}; registered tasks: {', '.join(sorted(TASKS))}, "
                        "or module:function / path/to/file.py:function")
    if settings.reward_weights is not None:
        raise ConfigError("reward_weights", "weights need --reward-funcs, --reward-model or --reward-url, or reward "
                          "functions given to ESTrainer (a --task sets its own weights)")
    factory_settings = {name: getattr(settings, name) for name in FACTORY_SETTINGS}
    if factory_settings["eval_size"] is None:  # ESConfig's "every row of --eval-data; 500 generated problems"
        factory_settings["eval_size"] = 500
    if is_spec(settings.task):
        return task_from_factory(settings.task, factory_settings)
    return prepare_task(load_task(settings.task, **factory_settings), f"--task {settings.task}")
