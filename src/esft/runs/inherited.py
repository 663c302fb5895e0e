"""What a run directory hands on: `esft train --resume DIR` takes the run's settings, `esft eval
--model DIR` its task, data and generation settings. A directory is data (it may be a copy, a
download): its settings never import code by themselves. Code they name (`--task module:function`,
`--reward-funcs`) is loaded only when the user names it again (a flag or --config) or passes
--trust-run-code; otherwise the command stops with one line saying which code and the two ways on.
Built-in tasks and rewards are not code from the directory and are always taken. Which settings
`esft eval` takes from a run's weights: esft.runs.eval_origin."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from esft.settings.config import ESConfig

NOT_INHERITED = ("run_name", "output_dir", "resume", "trust_run_code")
"""Settings a resumed run sets itself, and the opt-in, which only the user can give."""



class InheritedSettingsError(ValueError):
    """A run directory's settings that cannot be taken; the message says which and what to do."""


def settings_of_run(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The settings a resume takes from the run's `config` (read from `source`), or an error naming
    the first one this esft version does not know (a checkpoint of another version)."""
    known = {field.name for field in dataclasses.fields(ESConfig)}
    unknown = sorted(str(name) for name in config if name not in known)
    if unknown:
        raise InheritedSettingsError(f"{source} records the setting {unknown[0]!r}, which this esft version does not "
                                     "know (written by another version, or renamed since); give its current name or "
                                     "remove it there, or start a new run")
    return {name: value for name, value in config.items() if name not in NOT_INHERITED}


def code_named(settings: dict[str, Any]) -> list[str]:
    """The code (as flags) that `settings` would import: a task factory and reward functions."""
    code = []
    task = settings.get("task")
    if isinstance(task, str) and ":" in task:
        code.append(f"--task {task}")
    if settings.get("reward_funcs"):
        code.append(f"--reward-funcs {settings['reward_funcs']}")
    return code


def check_inherited_code(inherited: dict[str, Any], explicit: set[str], trusted: bool, where: str) -> None:
    """Stop (InheritedSettingsError) when settings taken from a directory, and not given again by the
    user (`explicit`), name code, unless `trusted` (--trust-run-code); with it, say which code loads."""
    code = code_named({name: value for name, value in inherited.items() if name not in explicit})
    if not code:
        return
    if trusted:
        print(f"esft: --trust-run-code: loading the code that {where} names: {', '.join(code)}", file=sys.stderr)
        return
    raise InheritedSettingsError(f"{where} names code ({', '.join(code)}), which esft does not load from a run's "
                                 f"settings by itself: if you trust it, give it again ({' '.join(code)}) or pass "
                                 "--trust-run-code")

