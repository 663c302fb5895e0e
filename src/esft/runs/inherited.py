"""What a run directory hands on: `esft train --resume DIR` takes the run's settings, `esft eval
--model DIR` its task, data and generation settings. A directory is data (it may be a copy, a
download): its settings never import code, read the user's files or reach a service by themselves.
Code they name (`--task module:function`, `--reward-funcs`), data files (`--train-data`,
`--eval-data`) and reward services (`--reward-url`, which receive every row and
$ESFT_REWARD_API_KEY) are taken only when the user names them again (a flag or --config) or passes
--trust-run-code (then one line says what was taken); otherwise the command stops with one line
saying which and the two ways on. Built-in tasks and rewards are not code from the directory and are
always taken; so are the other settings (columns, sizes, generation settings), which only shape
what the user's own data and services receive. Which settings
`esft eval` takes from a run's weights: esft.runs.eval_origin."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from esft.runs.named_files import changed_files
from esft.settings.config import ESConfig
from esft.settings.rules import SHOWN_CHARS, shown

NOT_INHERITED = ("run_name", "output_dir", "resume", "trust_run_code")
"""Settings a resumed run sets itself, and the opt-in, which only the user can give."""



class InheritedSettingsError(ValueError):
    """A run directory's settings that cannot be taken; the message says which and what to do."""


def settings_of_run(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The settings a resume takes from the run's `config` (read from `source`), or an error naming
    the first one this esft version does not know (a checkpoint of another version)."""
    if not config:
        raise InheritedSettingsError(f"{source} records no settings (its config is empty): a resume would train with "
                                     "defaults that are not the run's; resume from another checkpoint, or start a new run")
    known = {field.name for field in dataclasses.fields(ESConfig)}
    unknown = sorted(str(name) for name in config if name not in known)
    if unknown:
        raise InheritedSettingsError(f"{source} records the setting {shown(unknown[0])}, which this esft version does not "
                                     "know (written by another version, or renamed since); give its current name or "
                                     "remove it there, or start a new run")
    return {name: value for name, value in config.items() if name not in NOT_INHERITED}


PLACES = ("train_data", "eval_data", "reward_url")
"""Settings that name a place outside the directory: files of the user's that would be read (and their
rows sent to the reward functions, services and evaluation files) and services that would receive them
with $ESFT_REWARD_API_KEY. Taken from a directory only as its code is (module docstring)."""


def named_outside(settings: dict[str, Any]) -> list[str]:
    """The code (a task factory, reward functions), data files and reward services that `settings`
    name, as the flags that would name them."""
    named = []
    task = settings.get("task")
    if isinstance(task, str) and ":" in task:
        named.append(f"--task {task}")
    if settings.get("reward_funcs"):
        named.append(f"--reward-funcs {settings['reward_funcs']}")
    named += [f"--{name.replace('_', '-')} {settings[name]}" for name in PLACES if settings.get(name)]
    return [item if len(item) <= SHOWN_CHARS else item[:SHOWN_CHARS - 3] + "..." for item in named]


def check_inherited(inherited: dict[str, Any], explicit: set[str], trusted: bool, where: str,
                    signed: bool = False, recorded_files: Any = None) -> None:
    """Stop (InheritedSettingsError) when settings taken from a directory, and not given again by the
    user (`explicit`), name code, data files or reward services, unless `trusted` (--trust-run-code)
    or `signed` (this user's esft wrote them, unedited: esft.runs.signature) and each code and data file
    they name is the one the run recorded (`recorded_files`, esft.runs.named_files: same absolute path,
    same digest); then say in one line what was taken. The refusal names each file that moved or changed."""
    taken = {name: value for name, value in inherited.items() if name not in explicit}
    named = named_outside(taken)
    if not named:
        return
    if trusted:
        print(f"esft: --trust-run-code: taking the code, data and services that {where} names: {', '.join(named)}",
              file=sys.stderr)
        return
    changed = changed_files(recorded_files, taken, set(taken)) if signed else []
    if signed and not changed:
        print(f"esft: taking the code, data and services that {where} names (settings written by your esft, unedited: "
              f"their signature verifies, and so do the files they name): {', '.join(named)}", file=sys.stderr)
        return
    why = f" (your esft wrote these settings, but {'; '.join(changed)})" if changed else ""
    raise InheritedSettingsError(f"{where} names code, data files or reward services ({', '.join(named)}), which esft "
                                 f"does not take from a run's settings by itself{why} (a copied run could run other "
                                 f"code or send your files and API key elsewhere): if you trust it, give them again "
                                 f"({' '.join(named)}) or pass --trust-run-code")
