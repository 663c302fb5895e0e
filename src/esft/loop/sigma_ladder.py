"""The σ ladder: a few members at each σ of a ladder, on a few training prompts, as an ES iteration would
evaluate them (perturb → greedy generate → restore → reward), and the rule that picks σ from what they did.
`esft sigma-scan` prints it (esft.sigma_scan); `--sigma auto` runs it before the first iteration and trains
at the σ it picks (ESTrainer).

ES moves the weights only where members' rewards differ. A σ too small leaves every member's greedy
output as the unperturbed model's (they all tie: no update); too large and members write garbage
(the mean reward collapses). How small is too small depends on the weights' scale: the embedded
model was rescaled for the paper's σ = 1e-3, most pretrained models need about 1e-2. Per σ:

- changed: the fraction of completions that differ from the unperturbed model's;
- spread: the standard deviation of the members' mean rewards (0: they tie, the update is zero);
- reward: the members' mean reward (beside the unperturbed model's: a fall is collapse);
- garbled: the fraction of completions that are empty or degenerate (`degenerate`).

RULE (the recommendation): among the σ of the ladder that are intact (no more than GARBLED_MARGIN
more garbled completions than the unperturbed model writes, and a mean reward no lower than the
unperturbed model's by more than COLLAPSE of the reward range seen in the scan, or by more than the
standard error of the unperturbed model's mean reward over the scan's prompts where that is larger)
and at which at least MIN_CHANGED of the completions differ from the unperturbed model's, the largest σ
whose spread of members' rewards (> 0) is at least NEAR_MAX of the largest spread among them: the spread is
what the z-scored update follows, and within what a few members on a few prompts can tell apart the larger σ
wins (α follows it, so the step is larger).
α follows σ (esft.es.step_rules.default_alpha: σ/2, the paper's ratio; σ/(2√8) under the √N step rule). No such σ: "no signal at
any σ" when no σ gave a spread (the reward does not tell members apart on these prompts), else
"none intact".

Why a fall of up to three quarters of the range: a random perturbation lowers the reward on average, the more
the larger σ, while the update averages many of them into a far smaller step; what the rule must refuse is a σ
at which members' rewards have collapsed to the floor. Measured on SmolLM2-135M-Instruct (8 members × 8
prompts, 2026-12-06): on arithmetic at seed 1 the unperturbed model scores 0.375, members 0.391 at σ = 1e-3,
0.125 at 1e-2 and 0.0 at 3e-2; σ = 1e-2, the σ measured to train this model on every task tried
(docs/benchmarks.md), is kept and 3e-2 refused (with COLLAPSE = 0.25 the rule took 1e-3, and the run gained one
point). The standard error matters when the scan's few prompts make the unperturbed reward itself uncertain.

Why the larger σ among near-equal spreads: 8 members' mean rewards over 8 prompts of 0/1 rewards move in steps
of 1/8, so spreads within a quarter of each other are not told apart. On SmolLM2 (2026-12-06) times-table at seed
3 spread 0.0625 at both σ = 3e-3 and 1e-2; taking the smaller (the rule until then) gave α = 5.3e-4 and 38.0%
held-out after 4 iterations, where σ = 1e-2's α = 1.77e-3 is measured to learn most on that model (stage (b) of
docs/benchmarks.md: σ = 3e-3 at the same α learned less).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from esft.engines.base import perturbed
from esft.es.strategies.base import ESState, draw_seeds

RULE = " ".join(__doc__.split("RULE (the recommendation): ")[1].split())
"""The rule in words, as sigma-scan.json records it."""
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
SCAN_MEMBERS = 8
SCAN_PROMPTS = 8
"""Members per σ and training prompts each answers, by default (esft sigma-scan --members/--prompts; --sigma auto)."""
MIN_CHANGED = 0.25
GARBLED_MARGIN = 0.2
COLLAPSE = 0.75
NEAR_MAX = 0.75


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
    base_error: float = 0.0
    """The standard error of the unperturbed model's mean reward over the prompts (RULE's tolerance)."""
    reason: str = ""
    """Why the rule picked the recommended σ, in words ("" when it picked none)."""

    def record(self) -> dict[str, Any]:
        """What the scan measured and chose, as sigma-scan.json holds it (esft sigma-scan; a --sigma auto run)."""
        return {"recommended_sigma": self.recommended, "verdict": self.verdict, "rule": RULE,
                "base": {"reward": self.base_reward, "reward_standard_error": self.base_error,
                         "garbled": self.base_garbled},
                "members": self.members, "prompts": self.prompts, "steps": [dataclasses.asdict(step) for step in self.steps]}

    def table(self) -> str:
        lines = [f"{'sigma':>8} {'changed':>8} {'spread':>9} {'reward':>9} {'garbled':>8}",
                 f"{'(base)':>8} {0.0:>8.2f} {0.0:>9.4f} {self.base_reward:>9.4f} {self.base_garbled:>8.2f}"]
        for step in self.steps:
            mark = "  <- recommended" if step.sigma == self.recommended else ""
            lines.append(f"{step.sigma:>8.0e} {step.changed:>8.2f} {step.spread:>9.4f} {step.reward:>9.4f} "
                         f"{step.garbled:>8.2f}{mark}")
        return "\n".join(lines)


def why_chosen(step: Step, largest: float) -> str:
    """Why the rule picked `step`'s σ, in words (`largest`: the largest spread among the σ it weighed)."""
    return (f"the largest σ whose members' rewards spread near the most ({step.spread:.3g}; the most {largest:.3g}), "
            f"without collapse; {100 * step.changed:.0f}% of completions change")


def recommend(base_reward: float, base_garbled: float, steps: list[Step], base_error: float = 0.0
              ) -> tuple[float | None, str, str]:
    """The module docstring's RULE: (σ or None, the verdict line, why that σ in words or ""); `base_error`, the
    standard error of the unperturbed model's mean reward over the scan's prompts."""
    rewards = [base_reward] + [step.reward for step in steps]
    scale = max(rewards) - min(rewards)
    intact = [step for step in steps if step.garbled <= base_garbled + GARBLED_MARGIN
              and step.reward >= base_reward - max(COLLAPSE * scale, base_error)]
    moving = [step for step in intact if step.spread > 0 and step.changed >= MIN_CHANGED]
    if moving:
        largest = max(step.spread for step in moving)
        step = max((step for step in moving if step.spread >= NEAR_MAX * largest), key=lambda step: step.sigma)
        why = why_chosen(step, largest)
        return step.sigma, f"recommended: --sigma {step.sigma:g} ({why}; α: its default with it, see --alpha)", why
    if not any(step.spread > 0 for step in steps):
        moved = next((step.sigma for step in steps if step.changed > 0), None)
        where = f"completions change from σ = {moved:g}, but " if moved is not None else "no completion changed and "
        return None, (f"no signal at any σ: {where}every member got the same reward at every σ; the reward does not "
                      "tell members apart on these prompts (check it on the model's completions, or use easier data)"), ""
    return None, ("no σ of the ladder is both moving and intact: rewards differ only where completions collapse "
                  f"(more than {GARBLED_MARGIN:.0%} more garbled, or the reward falls); try σ between the ladder's steps "
                  "(--sigmas) or a model that does the task"), ""


def scan(engine: Any, score: Callable[..., Any], rows: Sequence[dict], seed: int, sigmas: Sequence[float],
         members: int, mini_batch_size: int | None = None, said: Callable[[float], None] = lambda sigma: None
         ) -> ScanResult:
    """Evaluate `members` members (the seeds of iteration 0 of run seed `seed`, the same at every σ) at each σ
    on the training `rows` with `engine` (greedy) and `score(rows, texts, token_ids) -> Scores`; `said(σ)` after
    each σ. The caller tells the reward functions their trainer_state first."""
    prompts = [row["prompt"] for row in rows]

    def generate_and_score():
        generation = engine.generate(prompts, mini_batch_size=mini_batch_size)
        scores = score(rows, generation.texts, generation.token_ids)
        return generation, scores.mean(), [value for value in scores.total if value is not None]

    base, base_reward, base_values = generate_and_score()
    base_error = statistics.pstdev(base_values) / len(base_values) ** 0.5 if len(base_values) > 1 else 0.0
    base_prints = base.fingerprints()
    base_garbled = sum(map(degenerate, base.texts)) / len(base.texts)
    seeds = draw_seeds(ESState(seed), members)
    steps = []
    for sigma in sigmas:
        rewards, changed, garbled = [], 0, 0
        for member_seed in seeds:
            with perturbed(engine, member_seed, sigma):
                generation, reward, _ = generate_and_score()
            rewards.append(reward)
            changed += sum(a != b for a, b in zip(generation.fingerprints(), base_prints))
            garbled += sum(map(degenerate, generation.texts))
        total = members * len(rows)
        steps.append(Step(sigma, changed / total, statistics.pstdev(rewards), statistics.fmean(rewards), garbled / total))
        said(sigma)
    recommended, verdict, reason = recommend(base_reward, base_garbled, steps, base_error)
    return ScanResult(base_reward, base_garbled, steps, members, len(rows), recommended, verdict, base_error, reason)
