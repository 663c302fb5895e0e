"""`esft train` / `esft eval`: every ESConfig field is a kebab-case flag; `--config run.yaml` sets
any of them (flags override). `esft report RUN_DIR...`: a run's (or several runs') curves as an HTML
page (esft.runs.report). `esft prepare-model NAME`: a pretrained model's folder, made offline
(esft.models.prepared). User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import re
import sys
from pathlib import Path
from typing import Any

from esft.models.prepared import add_prepare_parser, prepare_command
from esft.sigma_scan import SCAN_OPTIONS, SCAN_SUMMARY, add_scan_arguments, run_scan
from esft.settings.config import DEMO_PRESET, GROUPS, MODEL_PRESET, ConfigError, ESConfig
from esft.settings.presets import PRESET_CHOICES, PRESET_NAMES, PRESET_WHY, preset_for, preset_flags
from esft.runs.checkpoint import CheckpointError
from esft.runs.eval_origin import check_evaluated_weights, run_settings_of, settings_line
from esft.runs.inherited import InheritedSettingsError, check_inherited, settings_of_run
from esft.settings.trl_names import unknown_setting

USER_ERROR = 2
_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def _flag_type(annotation: str):
    base = annotation.replace("| None", "").strip()
    return {"int": int, "float": float, "str": str, "int | str": _int_or_word, "float | str": _float_or_word}[base]


def _int_or_word(text: str) -> int | str:
    """A number, or a word such as "auto" (the setting's rule checks which words it takes)."""
    return int(text) if text.isdigit() else text


def _float_or_word(text: str) -> float | str:
    """A number, or a word such as "auto" (the setting's rule checks which words it takes)."""
    try:
        return float(text)
    except ValueError:
        return text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like every other user error
        unknown = re.match(r"unrecognized arguments: --([\w-]+)", message)
        known = [f.name for f in dataclasses.fields(ESConfig)]
        if unknown and unknown.group(1).replace("-", "_") not in known:  # TRL's name, or a typo (esft.settings.trl_names)
            hint = unknown_setting(unknown.group(1), known)
            if "did you mean" in hint:
                message = f"{message}: {hint}"
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
        ("eval", "Evaluate a model on a task's eval splits (train without iterations). Given a run's checkpoint or "
                 "final directory, it takes that run's task, data and generation settings (flags override)."),
        ("sigma-scan", SCAN_SUMMARY),
    ):
        description = summary
        if name == "train":
            description += (f" Demo preset: on the embedded model's Countdown demo (no data or reward of yours) train "
                            f"uses {preset_flags(DEMO_PRESET)} as defaults (same accuracy gain, faster; docs/benchmarks.md). "
                            f"Model preset: on any other model, ES uses {preset_flags(MODEL_PRESET)} as defaults (the "
                            "design that learned most per completion across tasks on SmolLM2; docs/models.md). Each flag "
                            "you give overrides its own value. The defaults below are otherwise the paper's.")
        sub = commands.add_parser(name, help=summary, description=description)
        sub.add_argument("--config", metavar="YAML", help="YAML file of settings (keys as the flags, with - or _); flags override it.", default=argparse.SUPPRESS)
        groups = {group: sub.add_argument_group(group) for group in GROUPS}
        for field in dataclasses.fields(ESConfig):
            if name in ("eval", "sigma-scan") and field.name == "iterations":
                continue  # eval never trains; the scan evaluates members, no update
            flag = "--" + field.name.replace("_", "-")
            help_text = f"{field.metadata['help']} [default: {field.default}]"
            group = groups[field.metadata["group"]]
            if field.type in ("bool", "bool | str", "bool | None"):  # bool | str: on, off, or a word ("auto") left as the default
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, default=argparse.SUPPRESS)
            elif field.metadata.get("repeatable"):
                group.add_argument(flag, action=_Repeated, metavar=field.name.upper(), help=help_text, default=argparse.SUPPRESS)
            else:
                group.add_argument(flag, type=_flag_type(field.type), metavar=field.name.upper(), help=help_text, default=argparse.SUPPRESS)
        if name == "sigma-scan":
            add_scan_arguments(sub)
        if name == "train":
            sub.add_argument("--preset", choices=PRESET_CHOICES, default=argparse.SUPPRESS,
                             help="auto: the demo preset on the demo, the model preset on any other model (above), as "
                                  "defaults; none: no preset, the defaults below (the paper's). Also a --config key. "
                                  "[default: auto]")
    _add_report_parser(commands)
    _add_serve_reward(commands)
    add_prepare_parser(commands)
    for each in (parser, *commands.choices.values()):  # --sigma-schedul is a typo (as in YAML), not --sigma-schedule
        each.allow_abbrev = False
    return parser


def _add_report_parser(commands) -> None:
    summary = "Plot one run, or several side by side, as a self-contained HTML page (PNGs beside it)."
    report = commands.add_parser("report", help=summary, description=summary + " Every train writes RUN_DIR/report.html itself.")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (holds metrics.jsonl and config.yaml)")
    report.add_argument("--out", metavar="FILE.html", help="page to write; PNGs go beside it as <FILE>-<figure>.png "
                        "[default: RUN_DIR/report.html for one run, ./esft-report.html for several]")


def run_report(run_dirs: list[str], out: str | None) -> int:
    """`esft report`: write the page and print where it is; a directory that is not a run is a user error."""
    from esft.runs.report import ReportError, write_report

    try:
        print(f"report: {write_report(run_dirs, out)}")
    except ReportError as error:
        print(f"esft: error: {_one_line(error)}", file=sys.stderr)
        return USER_ERROR
    return 0


def _add_serve_reward(commands) -> None:
    """`esft serve-reward`: esft.rewards.serve's settings (README "Reward models")."""
    from esft.rewards.models import DTYPE_NAMES

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
        ("--max-request-seconds", float, 120.0, "Longest a request may take (waiting included); then 503, the rest unscored."),
        ("--max-text-chars", int, None, "Longest prompt + completion (as rendered) in characters, else 413. Default: 16 per token of context."),
    ):
        sub.add_argument(flag, type=kind, default=default, help=f"{text} [default: {default}]",
                         choices=DTYPE_NAMES if flag == "--dtype" else None)


def join_negative_numbers(argv: list[str]) -> list[str]:
    """`--sigma -1e-3` → `--sigma=-1e-3`: argparse reads a value like -1e-3 as an unknown flag."""
    joined: list[str] = []
    for token in argv:
        if joined and _NUMBER.match(token) and joined[-1].startswith("--") and "=" not in joined[-1]:
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    from esft.files import SETTINGS_LIMIT, YamlTooLarge, load_yaml, read_regular_text

    try:
        data = load_yaml(read_regular_text(Path(path).expanduser(), SETTINGS_LIMIT, follow_links=True)) or {}
    except OSError as error:
        raise UserError(f"--config {path}: cannot read it ({error.strerror})") from None
    except YamlTooLarge as error:
        raise UserError(f"--config {path}: refused ({error})") from None
    except UnicodeDecodeError as error:
        raise UserError(f"--config {path}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except yaml.YAMLError as error:
        raise UserError(f"--config {path}: not valid YAML ({_yaml_problem(error)})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: must be a mapping of setting: value")
    fields = {f.name: f for f in dataclasses.fields(ESConfig)}
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "preset":  # esft train's --preset, not a setting of the run (resolve_config reads it)
            settings[name] = value
            continue
        if name not in fields:
            raise UserError(f"--config {path}: {unknown_setting(str(key), list(fields))}")
        settings[name] = _coerce_number(value, fields[name].type)
    return settings


def _coerce_number(value: Any, annotation: str) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string; numeric strings become the field's number type,
    as they would on the command line. Anything else is left for ESConfig to reject."""
    base = annotation.replace("| None", "").strip()
    if isinstance(value, str) and base in ("int", "float", "float | str"):
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


def resolve_config(command: str, given: dict[str, Any]):
    """checkpoint's config (when resuming; for eval: the evaluated run's) < --config YAML < flags.
    Returns (ESConfig, (the preset `train` added: "demo", "model" or None, its settings), the ResumePoint or None)."""
    from esft.runs.directory import ResumeError, find_resume_point

    settings: dict[str, Any] = {}
    inherited: dict[str, Any] = {}
    yaml_path = given.pop("config", None)
    from_yaml = _read_yaml(yaml_path) if yaml_path else {}
    wanted = given.pop("preset", from_yaml.pop("preset", "auto"))  # esft train's, not a setting of the run
    if wanted not in PRESET_CHOICES:
        raise UserError(f"--config {yaml_path}: preset: must be one of {', '.join(PRESET_CHOICES)}, got {wanted!r}")
    if command == "eval" and (given.get("resume") or from_yaml.get("resume")):
        checkpoint = given.get("resume") or from_yaml.get("resume")
        raise UserError(f"--resume: to evaluate a checkpoint, pass it as the model: esft eval --model {checkpoint}")
    resume = given.get("resume", from_yaml.get("resume")) if command == "train" else None
    point = None
    if resume:
        try:
            point = find_resume_point(resume)
        except ResumeError as error:
            raise UserError(f"--resume {resume}: {error}") from None
        where = f"--resume {resume}"
        source = point.checkpoint / "trainer_state.json" if point.checkpoint else point.run_dir / "config.yaml"
        settings |= (inherited := settings_of_run(point.config, str(source)))
        trained_with = point.config.get("algorithm", "es")
        if given.get("algorithm", from_yaml.get("algorithm", trained_with)) != trained_with:
            raise UserError(f"--algorithm: {resume} was trained with --algorithm {trained_with}; resume it with that "
                            "algorithm, or start a new run")
    model = given.get("model", from_yaml.get("model"))
    adapter = given.get("lora_adapter", from_yaml.get("lora_adapter"))
    if command == "eval":
        try:
            check_evaluated_weights(model, adapter)
        except CheckpointError as error:
            raise UserError(str(error)) from None
    if command == "eval" and (model or adapter) and (found := run_settings_of(model, adapter)):
        inherited, path, signed, named = found
        where = f"--lora-adapter {adapter}" if adapter and Path(adapter).expanduser() == path else f"--model {model}"
        overridden = set(from_yaml) | set(given)
        settings |= inherited
        shown = ", ".join(f"{k}={str(v)[:200]}" for k, v in inherited.items() if k not in overridden and v is not None)
        print(f"esft: evaluating with the settings of the run that wrote {path} (flags override): {shown}", file=sys.stderr)
    settings |= from_yaml | given
    if command == "eval" and inherited.get("algorithm") == "randopt" and model and Path(model).expanduser().is_dir():
        settings["model"] = inherited["model"]  # a RandOpt run directory: its base model, perturbed by its members
    if inherited:  # a directory's settings import no code, read no data, reach no service by themselves (esft.runs.inherited)
        signed, named = (point.signed, point.named_files) if point is not None else (signed, named)
        check_inherited(inherited, set(from_yaml) | set(given), bool(settings.get("trust_run_code")), where, signed,
                        named)
    presets = command == "train" and not point and wanted == "auto"
    which, preset, dropped = preset_for(settings) if presets else (None, {}, [])
    for line in dropped:
        print(f"esft: {line}", file=sys.stderr)
    settings |= preset
    if command == "eval":
        if from_yaml.get("iterations"):
            raise UserError(f"--config {yaml_path}: iterations: esft eval does not train; use esft train")
        settings["iterations"] = 0
    try:
        return ESConfig(**settings), (which, preset), point
    except ConfigError as error:
        raise UserError(str(error) + (f" (settings from {yaml_path})" if yaml_path and error.name in from_yaml else "")) from None


def _print_summary(trainer, config: ESConfig, final: dict[str, float]) -> None:
    from esft.tasks.selection import overlap_line  # the task's data is loaded by now
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
    if config.iterations and (line := overlap_line(trainer.task)) and line.startswith("warning"):
        print(line)  # said before training too, where the lines of a long run bury it
    if final.get("reward/failures_total"):
        print(f"reward failures: {final['reward/failures_total']} samples got the failure reward (see above)")
    print(f"run directory: {trainer.run_dir}")
    if trainer.report_path is not None:
        print(f"report: {trainer.report_path}")


def _serve_reward(settings: dict[str, Any]) -> int:
    try:
        from esft.rewards.serve import serve
    except ImportError as error:
        raise UserError(f"esft serve-reward needs FastAPI and uvicorn ({error}): pip install 'esft[serve]'") from None
    from esft.rewards.models import RewardModelError

    try:
        serve(**settings)
    except (RewardModelError, ConfigError) as error:
        raise UserError(str(error)) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(join_negative_numbers(list(sys.argv[1:] if argv is None else argv)))
    if args.command == "report":
        return run_report(args.run_dirs, args.out)
    if args.command == "prepare-model":
        return prepare_command(args)
    given = {k: v for k, v in vars(args).items() if k != "command"}
    scan_options = {k: given.pop(k) for k in SCAN_OPTIONS if k in given}  # sigma-scan's own flags
    from esft.engines.base import NonFiniteWeights
    from esft.rewards.runner import RewardError
    from esft.models.gguf import GGUFError
    from esft.runs.randopt_record import RecordError, record_path
    from esft.tasks.base import TaskError

    run = trainer = None
    try:
        if args.command == "serve-reward":
            return _serve_reward(given)
        ensemble = record_path(given["model"]) if args.command == "eval" and given.get("model") else None
        config, (which, preset), point = resolve_config(args.command, given)
        if args.command == "sigma-scan":
            return run_scan(config, scan_options)
        from esft.allocator import steady_allocator
        from esft.runs.directory import open_run
        from esft.trainer import ESTrainer

        steady_allocator()  # no page faults per generate call once the heap has grown (esft.allocator)

        try:
            run = open_run(config, point)  # claimed before the model loads: a busy directory fails fast
            if config.algorithm == "grpo":  # TRL's GRPOTrainer behind ESTrainer's interface (README "GRPO baseline")
                from esft.grpo.baseline import GRPOBaseline

                trainer = GRPOBaseline(args=config, run=run)
            elif config.algorithm == "randopt":  # esft eval RUN_DIR: that run's kept members vote
                from esft.randopt.trainer import RandOptTrainer

                trainer = RandOptTrainer(args=config, run=run, record=ensemble)  # records checked before the model loads
            else:
                trainer = ESTrainer(args=config, run=run)
        except (TaskError, ConfigError, ImportError, FileNotFoundError, RecordError, GGUFError) as error:
            if run is not None:
                run.discard_if_unused()
            if preset and getattr(error, "name", None) in preset:  # the user never typed that flag
                raise UserError(f"{error} (set by the {PRESET_NAMES[which]} {preset_flags(preset)}; give the flag "
                                "yourself, e.g. --noise iid for the paper's full-rank noise)") from None
            raise UserError(str(error)) from None
        if args.command == "eval":  # every time: which task, data, size and tokens these numbers are for
            print(settings_line(config), file=sys.stderr)
        if preset:  # once the trainer is built: bad input before it stays one error line
            print(f"esft: {PRESET_NAMES[which]}: {preset_flags(preset)} ({PRESET_WHY[which]}; a flag you give overrides "
                  "its value)", file=sys.stderr)
        try:
            final = trainer.train()
        except (TaskError, ConfigError, CheckpointError, NonFiniteWeights) as error:
            raise UserError(str(error)) from None
        except RewardError as error:
            print(f"esft: error: {error.headline}", file=sys.stderr)
            if error.failure.traceback:
                print(error.failure.traceback, file=sys.stderr)
            return USER_ERROR
        _print_summary(trainer, config, final)
    except (UserError, InheritedSettingsError) as error:
        print(f"esft: error: {_one_line(error)}", file=sys.stderr)
        return USER_ERROR
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
            raise
        where = f" ({error.filename})" if error.filename else ""
        print(f"esft: error: {error.strerror}{where}; free space or fix permissions, then "
              f"{'--resume ' + str(run.path) if run else 'run again'}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        hint = f"resume with --resume {run.path}" if run is not None else "nothing was written"
        report = f"; report: {trainer.report_path}" if trainer is not None and trainer.report_path else ""
        print(f"esft: interrupted; {hint}{report}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
