"""`esft train` / `esft eval`: every ESConfig field is a kebab-case flag; `--config run.yaml` sets
any of them (flags override). User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from esft.config import ConfigError, ESConfig

USER_ERROR = 2


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def _flag_type(annotation: str):
    base = annotation.replace("| None", "").strip()
    return {"int": int, "float": float, "str": str}[base]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="esft", description="Fine-tune causal LMs with Evolution Strategies (reward is maximized).")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in (
        ("train", "Run ES fine-tuning (evaluates before and after)."),
        ("eval", "Evaluate a model on a task's eval splits (same as train --iterations 0)."),
    ):
        sub = commands.add_parser(name, help=summary, description=summary)
        sub.add_argument("--config", metavar="YAML", help="YAML file of settings (keys as the flags, with - or _); flags override it.", default=argparse.SUPPRESS)
        for field in dataclasses.fields(ESConfig):
            flag = "--" + field.name.replace("_", "-")
            help_text = f"{field.metadata['help']} [default: {field.default}]"
            if field.type == "bool":
                sub.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, default=argparse.SUPPRESS)
            else:
                sub.add_argument(flag, type=_flag_type(field.type), metavar=field.name.upper(), help=help_text, default=argparse.SUPPRESS)
    return parser


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise UserError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise UserError(f"--config {path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: must be a mapping of setting: value")
    known = {f.name for f in dataclasses.fields(ESConfig)}
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise UserError(f"--config {path}: unknown setting {key!r}; see 'esft train --help' for the settings")
        settings[name] = value
    return settings


def resolve_config(command: str, given: dict[str, Any]) -> ESConfig:
    """checkpoint's config (when resuming) < --config YAML < flags; eval forces 0 iterations."""
    settings: dict[str, Any] = {}
    yaml_path = given.pop("config", None)
    from_yaml = _read_yaml(yaml_path) if yaml_path else {}
    resume = given.get("resume", from_yaml.get("resume"))
    if resume:
        from esft.checkpoint import read_state, resolve_resume

        try:
            settings |= read_state(resolve_resume(resume))["config"]
        except (FileNotFoundError, KeyError, ValueError) as error:
            raise UserError(f"--resume {resume}: {error}") from None
        settings.pop("run_name", None)
        settings.pop("output_dir", None)
    settings |= from_yaml | given
    if command == "eval":
        settings["iterations"] = 0
    try:
        return ESConfig(**settings)
    except ConfigError as error:
        raise UserError(str(error) + (f" (settings from {yaml_path})" if yaml_path and error.name in from_yaml else "")) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        config = resolve_config(args.command, given)
        from esft.tasks.base import TaskError
        from esft.trainer import ESTrainer

        try:
            trainer = ESTrainer(args=config)
        except (TaskError, ConfigError, ImportError, FileNotFoundError) as error:
            raise UserError(str(error)) from None
        trainer.train()
        print(f"run directory: {trainer.run_dir}")
    except UserError as error:
        print(f"esft: error: {error}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("esft: interrupted; resume with --resume <run directory>", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
