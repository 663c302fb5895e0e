"""`esft train` / `esft eval`: every ESConfig field is a kebab-case flag; `--config run.yaml` sets
any of them (flags override). User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from esft.config import DEMO_PRESET, DEMO_PRESET_OVERRIDDEN_BY, ConfigError, ESConfig, demo_preset_for

USER_ERROR = 2


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def _flag_type(annotation: str):
    base = annotation.replace("| None", "").strip()
    return {"int": int, "float": float, "str": str}[base]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like every other user error
        self.exit(USER_ERROR, f"esft: error: {message} (see '{self.prog} --help')\n")


class _Repeated(argparse.Action):
    """A flag that may be repeated: its values are joined with commas (--reward-model A --reward-model B = A,B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous},{values}" if previous else values)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="esft", description="Fine-tune causal LMs with Evolution Strategies (reward is maximized).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, summary in (
        ("train", "Run ES fine-tuning (evaluates before and after)."),
        ("eval", "Evaluate a model on a task's eval splits (same as train --iterations 0)."),
    ):
        description = summary
        if name == "train":
            description += (f" Demo preset: on the embedded model, unless you set any of {', '.join(_flags(DEMO_PRESET_OVERRIDDEN_BY))}, "
                            f"train adds {preset_flags(DEMO_PRESET)} (same accuracy gain, faster; benchmarks/RESULTS.md). "
                            "The defaults below are otherwise the paper's.")
        sub = commands.add_parser(name, help=summary, description=description)
        sub.add_argument("--config", metavar="YAML", help="YAML file of settings (keys as the flags, with - or _); flags override it.", default=argparse.SUPPRESS)
        for field in dataclasses.fields(ESConfig):
            flag = "--" + field.name.replace("_", "-")
            help_text = f"{field.metadata['help']} [default: {field.default}]"
            if field.type == "bool":
                sub.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, default=argparse.SUPPRESS)
            elif field.metadata.get("repeatable"):
                sub.add_argument(flag, action=_Repeated, metavar=field.name.upper(), help=help_text, default=argparse.SUPPRESS)
            else:
                sub.add_argument(flag, type=_flag_type(field.type), metavar=field.name.upper(), help=help_text, default=argparse.SUPPRESS)
    _add_serve_reward(commands)
    return parser


def _add_serve_reward(commands) -> None:
    """`esft serve-reward`: esft.serve's settings (README "Reward models")."""
    from esft.reward_models import DTYPE_NAMES

    sub = commands.add_parser("serve-reward", help="Serve a reward model over HTTP (pip install 'esft[serve]').",
                              description="Serve a sequence-classification reward model over HTTP: POST /score, POST "
                              "/get_reward (OpenRLHF), GET /health. Concurrent requests are scored in shared batches.")
    sub.add_argument("--model", required=True, help="Local directory or hub id of the reward model (one output logit).")
    for flag, kind, default, text in (
        ("--host", str, "127.0.0.1", "Address to listen on (loopback by default; 0.0.0.0 for every interface)."),
        ("--port", int, 8000, "Port (0 = any free port; the chosen one is printed)."),
        ("--batch-size", int, 32, "Most completions per forward pass; concurrent requests are coalesced up to it."),
        ("--api-key-env", str, None, "Name of an environment variable holding an API key: requests then need "
                                     "'Authorization: Bearer <key>' (else 401)."),
        ("--device", str, "auto", "cpu, cuda, cuda:N or auto (CUDA if available)."),
        ("--dtype", str, "auto", "float32, bfloat16, float16 or auto (the checkpoint's on a GPU, float32 on CPU)."),
        ("--max-queue", int, 256, "Requests that may wait for the model; more get 503."),
        ("--max-request-items", int, 4096, "Most completions in one request; more get 413."),
        ("--max-body-mb", float, 16.0, "Largest request body in MiB; larger get 413."),
    ):
        sub.add_argument(flag, type=kind, default=default, help=f"{text} [default: {default}]",
                         choices=DTYPE_NAMES if flag == "--dtype" else None)


def _flags(names) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names]


def preset_flags(preset: dict[str, Any]) -> str:
    """{'noise': 'lowrank', 'population_batching': True} -> '--noise lowrank --population-batching'."""
    return " ".join(flag + ("" if value is True else f" {value}") for flag, value in zip(_flags(preset), preset.values()))


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise UserError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise UserError(f"--config {path}: not valid YAML ({_yaml_problem(error)})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: must be a mapping of setting: value")
    fields = {f.name: f for f in dataclasses.fields(ESConfig)}
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise UserError(f"--config {path}: unknown setting {key!r}; see 'esft train --help' for the settings")
        settings[name] = _coerce_number(value, fields[name].type)
    return settings


def _coerce_number(value: Any, annotation: str) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string; numeric strings become the field's number type,
    as they would on the command line. Anything else is left for ESConfig to reject."""
    base = annotation.replace("| None", "").strip()
    if isinstance(value, str) and base in ("int", "float"):
        try:
            return _flag_type(annotation)(value)
        except ValueError:
            return value
    return value


def _yaml_problem(error: Exception) -> str:
    """A PyYAML error on one line: 'line L, column C: problem'."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return _one_line(where + problem)


def _one_line(text: str) -> str:
    """Errors are printed as a single line."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def resolve_config(command: str, given: dict[str, Any]) -> tuple[ESConfig, dict[str, Any]]:
    """checkpoint's config (when resuming) < --config YAML < flags; eval forces 0 iterations.
    Also returns the demo preset's settings that `train` added (empty unless it applies)."""
    settings: dict[str, Any] = {}
    yaml_path = given.pop("config", None)
    from_yaml = _read_yaml(yaml_path) if yaml_path else {}
    resume = given.get("resume", from_yaml.get("resume"))
    if resume and command == "eval":
        raise UserError(f"--resume: to evaluate a checkpoint, pass it as the model: esft eval --model {resume}")
    if resume:
        from esft.checkpoint import read_state, resolve_resume

        try:
            settings |= read_state(resolve_resume(resume))["config"]
        except (FileNotFoundError, KeyError, ValueError) as error:
            raise UserError(f"--resume {resume}: {error}") from None
        settings.pop("run_name", None)
        settings.pop("output_dir", None)
    settings |= from_yaml | given
    preset = demo_preset_for(settings) if command == "train" else {}
    settings |= preset
    if command == "eval":
        settings["iterations"] = 0
    try:
        return ESConfig(**settings), preset
    except ConfigError as error:
        raise UserError(str(error) + (f" (settings from {yaml_path})" if yaml_path and error.name in from_yaml else "")) from None


def _print_summary(trainer, config: ESConfig, final: dict[str, float]) -> None:
    for key, value in final.items():
        if key.startswith("eval/") and key.endswith("/accuracy"):
            before = trainer.initial_metrics.get(key)
            change = ""
            if config.iterations and before is not None:
                change = f" (before training {100 * before:.1f}%, {100 * (value - before):+.1f} points)"
            print(f"{key.split('/')[1]} accuracy: {100 * value:.1f}%{change}")
    splits: dict[str, list[str]] = {}
    for key, value in final.items():  # the other eval metrics: reward, pass@k, kl, ... per split
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] != "accuracy" and isinstance(value, (int, float)):
            splits.setdefault(parts[1], []).append(f"{parts[2]} {value:.4g}")
    for split, items in splits.items():
        print(f"{split}: {', '.join(items)}")
    print(f"run directory: {trainer.run_dir}")


def _serve_reward(settings: dict[str, Any]) -> int:
    from esft.tasks.base import TaskError

    try:
        from esft.serve import serve
    except ImportError as error:
        raise UserError(f"esft serve-reward needs FastAPI and uvicorn ({error}): pip install 'esft[serve]'") from None
    try:
        serve(**settings)
    except (TaskError, ConfigError) as error:
        raise UserError(str(error)) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k != "command"}
    from esft.tasks.base import TaskError

    try:
        if args.command == "serve-reward":
            return _serve_reward(given)
        config, preset = resolve_config(args.command, given)
        from esft.trainer import ESTrainer, new_run_dir

        try:
            if config.resume is None:
                new_run_dir(config)  # an existing run directory fails here, before the model loads
            trainer = ESTrainer(args=config)
        except (TaskError, ConfigError, ImportError, FileNotFoundError) as error:
            if preset and getattr(error, "name", None) in preset:  # the user never typed that flag
                raise UserError(f"{error} (set by the demo preset {preset_flags(preset)}; pass --noise iid to "
                                "turn the preset off)") from None
            raise UserError(str(error)) from None
        if preset:
            print(f"esft: demo preset: {preset_flags(preset)} (the fastest setting that keeps the demo's accuracy gain; "
                  "any of these flags, --engine or --executor turns it off, e.g. --noise iid for the paper's "
                  "full-rank noise)", file=sys.stderr)
        try:
            final = trainer.train() or trainer.initial_metrics
        except (TaskError, ConfigError) as error:
            raise UserError(str(error)) from None
        _print_summary(trainer, config, final)
    except UserError as error:
        print(f"esft: error: {_one_line(error)}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("esft: interrupted; resume with --resume <run directory>", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
