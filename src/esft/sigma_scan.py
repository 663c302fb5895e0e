"""`esft sigma-scan`: σ measured for the user's model, task and reward, before training (issue 50): the σ ladder
and its rule (esft.loop.sigma_ladder) on the trainer's engine and rewards, printed as a table with the rule's
verdict, and written as sigma-scan.json and sigma-scan.png. `esft train --sigma auto` runs the same ladder and
trains at the σ it recommends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from esft.es.step_rules import default_alpha
from esft.files import nearest_existing, write_text_atomic
from esft.loop.sigma_ladder import LADDER, SCAN_MEMBERS, SCAN_PROMPTS, ScanResult


def write_outputs(result: ScanResult, out: Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    """sigma-scan.json (the table, the rule's verdict, the settings scanned) and sigma-scan.png, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    alpha = None if result.recommended is None else default_alpha(result.recommended, settings["step_rule"])
    record = {**result.record(), "recommended_alpha": alpha, "settings": settings}
    json_path = out / "sigma-scan.json"
    write_text_atomic(json_path, json.dumps(record, indent=2) + "\n")
    return json_path, _plot(result, out / "sigma-scan.png")


def _plot(result: ScanResult, path: Path) -> Path:
    """Four panels against σ (log scale), drawn as esft report draws (matplotlib's Agg canvas)."""
    from matplotlib.figure import Figure

    from esft.runs.report import _png, _write_bytes_atomic

    figure = Figure(figsize=(10, 3.2))
    sigmas = [step.sigma for step in result.steps]
    panels = (("completions changed", "changed", None), ("member reward spread (std)", "spread", None),
              ("mean reward", "reward", result.base_reward), ("garbled completions", "garbled", result.base_garbled))
    for i, (title, key, base) in enumerate(panels):
        axes = figure.add_subplot(1, 4, i + 1)
        axes.plot(sigmas, [getattr(step, key) for step in result.steps], marker="o")
        if base is not None:
            axes.axhline(base, color="grey", linestyle="--", label="unperturbed")
            axes.legend(fontsize=7)
        if result.recommended is not None:
            axes.axvline(result.recommended, color="green", alpha=0.4)
        axes.set_xscale("log")
        axes.set_title(title, fontsize=9)
        axes.set_xlabel("σ", fontsize=8)
        axes.tick_params(labelsize=7)
    figure.tight_layout()
    _write_bytes_atomic(path, _png(figure))
    return path


# --------------------------------------------------------------------------- the command
def _sigmas(text: str) -> list[float]:
    import argparse

    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (e.g. 1e-3,1e-2)") from None
    if not values or any(not 0 < value < 10 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every σ must be a number above 0 and below 10")
    return sorted(set(values))


def _count(least: int, most: int = 4096):
    import argparse

    def parse(text: str) -> int:
        if not text.isdigit() or not least <= int(text) <= most:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {least} to {most}")
        return int(text)
    return parse


def out_problem(out: Path) -> str | None:
    """Why --out cannot hold the scan's files (said before the scan, whose minutes would otherwise be lost)."""
    existing = nearest_existing(out)
    if not existing.is_dir():
        return f"--out {out}: {existing} is a file, not a folder; give a folder (or one to create)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {out}: {existing} is not writable by this user; give another folder"
    return None


def add_scan_arguments(parser) -> None:
    """The scan's own flags (beside every ESConfig flag, which say model, task, data and reward)."""
    group = parser.add_argument_group("sigma-scan")
    group.add_argument("--sigmas", type=_sigmas, default=list(LADDER), metavar="S1,S2,...",
                       help=f"σ values to try [default: {','.join(f'{s:g}' for s in LADDER)}]")
    group.add_argument("--members", type=_count(2), default=SCAN_MEMBERS,
                       help=f"perturbed members per σ, 2 to 4096 [default: {SCAN_MEMBERS}]")
    group.add_argument("--prompts", type=_count(1), default=SCAN_PROMPTS,
                       help=f"training prompts each member answers, 1 to 4096 [default: {SCAN_PROMPTS}]")
    group.add_argument("--out", default="sigma-scan", metavar="DIR",
                       help="folder for sigma-scan.json and sigma-scan.png [default: ./sigma-scan]")


SCAN_OPTIONS = ("sigmas", "members", "prompts", "out")
SCAN_SUMMARY = ("Measure σ for this model, task and reward: a few members at each σ of a ladder, on a few training "
                "prompts; prints how many completions change, the members' reward spread, the mean reward and garbled "
                "outputs per σ, and recommends --sigma and --alpha (rule: esft.sigma_scan).")


def run_scan(config, options: dict[str, Any]) -> int:
    """`esft sigma-scan`: the table on stdout, the verdict line, the JSON and PNG written. A problem with
    the model, data or reward is one line and exit code 2, as in esft train."""
    from esft.rewards.runner import RewardError
    from esft.settings.config import ConfigError
    from esft.tasks.base import TaskError
    from esft.trainer import ESTrainer

    if (problem := out_problem(Path(options["out"]))) is not None:
        print(f"esft: error: {problem}", file=sys.stderr)
        return 2
    if config.sigma == "auto":  # the scan is the ladder itself: ESTrainer would run it once more to choose σ
        config = dataclasses.replace(config, sigma=LADDER[0], alpha=None)
    try:
        trainer = ESTrainer(args=config)
    except (TaskError, ConfigError, ImportError, FileNotFoundError) as error:
        print(f"esft: error: {error}", file=sys.stderr)
        return 2
    try:
        print(f"esft: sigma-scan: {options['members']} members × {options['prompts']} prompts at σ = "
              f"{', '.join(f'{s:g}' for s in options['sigmas'])} (greedy, --max-tokens {config.max_tokens})",
              file=sys.stderr)
        result = trainer.scan_sigmas(options["sigmas"], options["members"], options["prompts"],
                                     lambda sigma: print(f"esft: sigma-scan: σ = {sigma:g} done", file=sys.stderr, flush=True))
    except RewardError as error:
        print(f"esft: error: {error.headline}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    print(result.table())
    print(result.verdict)
    settings = {key: value for key, value in config.to_dict().items()
                if key in ("model", "task", "train_data", "reward_funcs", "noise", "rank", "max_tokens", "seed", "dtype",
                           "step_rule")}
    json_path, png_path = write_outputs(result, Path(options["out"]), settings)
    print(f"written: {json_path}, {png_path}")
    return 0
