"""`esft sigma-scan`: σ measured for the user's model, task and reward, before training (issue 50).

ES moves the weights only where members' rewards differ. A σ too small leaves every member's greedy
output as the unperturbed model's (they all tie: no update); too large and members write garbage
(the mean reward collapses). How small is too small depends on the weights' scale: the embedded
model was rescaled for the paper's σ = 1e-3, most pretrained models need about 1e-2. So the scan
evaluates a few members at each σ of a ladder on a few training prompts, as an ES iteration would
(perturb → greedy generate → restore → reward), and reports per σ:

- changed: the fraction of completions that differ from the unperturbed model's;
- spread: the standard deviation of the members' mean rewards (0: they tie, the update is zero);
- reward: the members' mean reward (beside the unperturbed model's: a fall is collapse);
- garbled: the fraction of completions that are empty or degenerate (`degenerate`).

RULE (the recommendation): among the σ of the ladder that are intact (no more than GARBLED_MARGIN
more garbled completions than the unperturbed model writes, and a mean reward no lower than the
unperturbed model's by more than COLLAPSE of the reward range seen in the scan) and at which at
least MIN_CHANGED of the completions differ from the unperturbed model's, the one with the largest
spread of members' rewards (> 0): the spread is what the z-scored update follows. α = σ/2, the
paper's ratio (σ = 1e-3, α = 5e-4). No such σ: "no signal at any σ" when no σ gave a spread (the
reward does not tell members apart on these prompts), else "none intact".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from esft.engines.base import perturbed
from esft.es.strategies.base import ESState, draw_seeds
from esft.es.batches import prompt_batch
from esft.files import nearest_existing, write_text_atomic

LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
MIN_CHANGED = 0.25
GARBLED_MARGIN = 0.2
COLLAPSE = 0.25


def degenerate(text: str) -> bool:
    """Empty (after stripping), holding U+FFFD (bytes that decode to nothing), or 8+ non-space characters
    of which one character makes 90% (a stuck token: "!!!!!!!!")."""
    visible = "".join(text.split())
    if not visible or "\ufffd" in text:
        return True
    return len(visible) >= 8 and max(visible.count(c) for c in set(visible)) >= 0.9 * len(visible)


@dataclass
class Step:
    """What the scan measured at one σ."""

    sigma: float
    changed: float
    spread: float
    reward: float
    garbled: float


@dataclass
class ScanResult:
    base_reward: float
    base_garbled: float
    steps: list[Step]
    members: int
    prompts: int
    recommended: float | None
    verdict: str
    """One line: the recommendation and why, or why there is none."""

    def table(self) -> str:
        lines = [f"{'sigma':>8} {'changed':>8} {'spread':>9} {'reward':>9} {'garbled':>8}",
                 f"{'(base)':>8} {0.0:>8.2f} {0.0:>9.4f} {self.base_reward:>9.4f} {self.base_garbled:>8.2f}"]
        for step in self.steps:
            mark = "  <- recommended" if step.sigma == self.recommended else ""
            lines.append(f"{step.sigma:>8.0e} {step.changed:>8.2f} {step.spread:>9.4f} {step.reward:>9.4f} "
                         f"{step.garbled:>8.2f}{mark}")
        return "\n".join(lines)


def recommend(base_reward: float, base_garbled: float, steps: list[Step]) -> tuple[float | None, str]:
    """The module docstring's RULE: (σ or None, the verdict line)."""
    rewards = [base_reward] + [step.reward for step in steps]
    scale = max(rewards) - min(rewards)
    intact = [step for step in steps if step.garbled <= base_garbled + GARBLED_MARGIN
              and step.reward >= base_reward - COLLAPSE * scale]
    moving = [step for step in intact if step.spread > 0 and step.changed >= MIN_CHANGED]
    if moving:
        step = max(moving, key=lambda step: step.spread)
        return step.sigma, (f"recommended: --sigma {step.sigma:g} --alpha {step.sigma / 2:g} (the largest spread of "
                            f"members' rewards, {step.spread:.3g}, without collapse; {100 * step.changed:.0f}% of "
                            "completions change; α = σ/2 as in the paper)")
    if not any(step.spread > 0 for step in steps):
        moved = next((step.sigma for step in steps if step.changed > 0), None)
        where = f"completions change from σ = {moved:g}, but " if moved is not None else "no completion changed and "
        return None, (f"no signal at any σ: {where}every member got the same reward at every σ; the reward does not "
                      "tell members apart on these prompts (check it on the model's completions, or use easier data)")
    return None, ("no σ of the ladder is both moving and intact: rewards differ only where completions collapse "
                  f"(more than {GARBLED_MARGIN:.0%} more garbled, or the reward falls); try σ between the ladder's steps "
                  "(--sigmas) or a model that does the task")


def scan(trainer: Any, sigmas: list[float], members: int, prompts: int) -> ScanResult:
    """Evaluate `members` members at each σ on `prompts` training prompts with the trainer's engine and
    rewards (members and prompts are the same at every σ: seeds of iteration 0)."""
    args = trainer.args
    batch = prompt_batch(trainer.task.train_dataset, args.seed, prompts, 0)
    engine = trainer.engine
    trainer._tell_rewards()

    def generate_and_score():
        generation = engine.generate(batch.prompts, mini_batch_size=args.eval_batch_size)
        return generation, trainer.rewards.score(batch.rows, generation.texts, generation.token_ids).mean()

    base, base_reward = generate_and_score()
    base_prints = base.fingerprints()
    base_garbled = sum(map(degenerate, base.texts)) / len(base.texts)
    seeds = draw_seeds(ESState(args.seed), members)
    steps = []
    for sigma in sigmas:
        rewards, changed, garbled = [], 0, 0
        for seed in seeds:
            with perturbed(engine, seed, sigma):
                generation, reward = generate_and_score()
            rewards.append(reward)
            changed += sum(a != b for a, b in zip(generation.fingerprints(), base_prints))
            garbled += sum(map(degenerate, generation.texts))
        total = members * len(batch.rows)
        steps.append(Step(sigma, changed / total, statistics.pstdev(rewards), statistics.fmean(rewards), garbled / total))
        print(f"esft: sigma-scan: σ = {sigma:g} done", file=sys.stderr, flush=True)
    recommended, verdict = recommend(base_reward, base_garbled, steps)
    return ScanResult(base_reward, base_garbled, steps, members, len(batch.rows), recommended, verdict)


def write_outputs(result: ScanResult, out: Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    """sigma-scan.json (the table, the rule's verdict, the settings scanned) and sigma-scan.png, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"recommended_sigma": result.recommended,
              "recommended_alpha": None if result.recommended is None else result.recommended / 2,
              "verdict": result.verdict, "rule": __doc__.split("RULE (the recommendation): ")[1].split("\n\"\"\"")[0]
              .replace("\n", " ").strip(), "base": {"reward": result.base_reward, "garbled": result.base_garbled},
              "members": result.members, "prompts": result.prompts, "steps": [asdict(step) for step in result.steps],
              "settings": settings}
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
    group.add_argument("--members", type=_count(2), default=8, help="perturbed members per σ, 2 to 4096 [default: 8]")
    group.add_argument("--prompts", type=_count(1), default=8, help="training prompts each member answers, 1 to 4096 [default: 8]")
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
    try:
        trainer = ESTrainer(args=config)
    except (TaskError, ConfigError, ImportError, FileNotFoundError) as error:
        print(f"esft: error: {error}", file=sys.stderr)
        return 2
    try:
        print(f"esft: sigma-scan: {options['members']} members × {options['prompts']} prompts at σ = "
              f"{', '.join(f'{s:g}' for s in options['sigmas'])} (greedy, --max-tokens {config.max_tokens})",
              file=sys.stderr)
        result = scan(trainer, options["sigmas"], options["members"], options["prompts"])
    except RewardError as error:
        print(f"esft: error: {error.headline}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    print(result.table())
    print(result.verdict)
    settings = {key: value for key, value in config.to_dict().items()
                if key in ("model", "task", "train_data", "reward_funcs", "noise", "rank", "max_tokens", "seed", "dtype")}
    json_path, png_path = write_outputs(result, Path(options["out"]), settings)
    print(f"written: {json_path}, {png_path}")
    return 0
