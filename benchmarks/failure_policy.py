"""Do failed reward samples bias the ES update? --failed-samples fill against omit (issue 50, item 3).

No model: a population of N members × B prompts whose true rewards follow a hidden direction. Member
i's perturbation has quality qᵢ along it (qᵢ = εᵢ·g ~ N(0, 1)); prompt j has a difficulty aⱼ; a
sample is correct with probability sigmoid(aⱼ + β·qᵢ) (binary, Countdown-like) or scores that
sigmoid plus noise (dense, in (0, 1)). Failures are then injected: at random (5%, 10%, 30% of samples),
more often on wrong/low answers or on right/high ones (10% on average, 3 : 1), or as whole member
batches (10% of members: a timed-out reward call fails a member's batch).

Each member's batch is scored by esft's own reward runner (esft.rewards.runner.RewardRunner, a reward
function returning NaN for a failed sample, as a real failure is recorded), and the update
coefficients come from esft's own code: esft.loop.member_fitness.fitness_of
under each policy, then the paper strategy's tell (esft.es.strategies) with each --reward-shaping. Printed per scenario:
the cosine between the coefficient vector with failures and the failure-free one (= the cosine of
the updates Σ cᵢ·εᵢ, the εᵢ of a model with millions of weights being orthogonal), median and 10th to
90th percentile over seeds; how often omit is the closer one; and the cosine with the hidden
direction (c against q: what the update is for; the failure-free update's own is the ceiling).

    python benchmarks/failure_policy.py --seeds 200 --json failure_policy.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

import numpy as np

from esft.es.strategies.paper import STRATEGY as PAPER
from esft.es.fitness import FAILED_SAMPLES
from esft.loop.member_fitness import fitness_of
from esft.rewards.runner import RewardRunner, Scores

SHAPINGS = ("zscore", "rank", "per_prompt")
SCENARIOS = ("random 5%", "random 10%", "random 30%", "wrong/low fail 3x (10%)", "right/high fail 3x (10%)",
             "whole batches (10% of members)")


def flaky(prompts, completions, **kwargs):
    """The reward function of the simulation: a completion is its own true reward, or FAIL."""
    return [math.nan if text == "FAIL" else float(text) for text in completions]


def true_rewards(rng: np.random.Generator, n: int, b: int, kind: str, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """(members × prompts true rewards, member qualities q)."""
    quality = rng.standard_normal(n)
    difficulty = rng.normal(-0.5, 1.5, b)
    p = 1 / (1 + np.exp(-(difficulty[None, :] + beta * quality[:, None])))
    if kind == "binary":
        return (rng.random((n, b)) < p).astype(float), quality
    return np.clip(p + rng.normal(0, 0.1, (n, b)), 0.0, 1.0), quality


def failures(rng: np.random.Generator, rewards: np.ndarray, scenario: str) -> np.ndarray:
    """Which samples fail (members × prompts booleans)."""
    n, b = rewards.shape
    if scenario.startswith("random"):
        return rng.random((n, b)) < float(scenario.split()[1].rstrip("%")) / 100
    if scenario.startswith("whole"):
        return np.repeat(rng.random((n, 1)) < 0.1, b, axis=1)
    weight = 3 - 2 * rewards if scenario.startswith("wrong") else 1 + 2 * rewards  # 3 : 1 between 0 and 1
    return rng.random((n, b)) < weight * (0.1 / weight.mean())


def scored(runner: RewardRunner, values: np.ndarray, failed: np.ndarray | None) -> list[Scores]:
    """Each member's batch as esft's reward runner scores it (a failed sample: the function returned NaN)."""
    rows = [{"prompt": str(j)} for j in range(values.shape[1])]
    return [runner.score(rows, ["FAIL" if failed is not None and failed[i, j] else repr(float(v))
                                for j, v in enumerate(member)]) for i, member in enumerate(values)]


def coefficients(batches: list[Scores], shaping: str, policy: str) -> np.ndarray:
    """The update coefficients esft computes for these members' scored batches."""
    _, coefficients = PAPER.tell(PAPER.init(0), fitness_of(batches, policy), 1.0, shaping)
    return np.asarray(coefficients)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm > 0 else 0.0


def spread(values: list[float]) -> dict[str, float]:
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(median), "p10": float(p10), "p90": float(p90)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--population", type=int, default=30, help="N (esft's default)")
    parser.add_argument("--batch", type=int, default=32, help="B, prompts per member (esft's default)")
    parser.add_argument("--beta", type=float, default=0.25, help="how strongly member quality moves the reward")
    parser.add_argument("--rewards", default="binary,dense")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    logging.getLogger("esft").setLevel(logging.ERROR)  # the runner's one line per failure kind: not wanted here
    runner = RewardRunner([flaky], sandbox=False)
    started = time.time()
    results: dict[str, dict] = {"command": sys.argv, "settings": vars(args), "tables": {}}
    for kind in args.rewards.split(","):
        print(f"\n{kind} rewards: N = {args.population}, B = {args.batch}, β = {args.beta}, {args.seeds} seeds; "
              "cosine to the failure-free update, median [10th-90th pct]; omit closer: share of seeds")
        print("| failures | shaping | fill | omit | omit closer | cos(update, truth): free / fill / omit |")
        print("| --- | --- | --- | --- | --- | --- |")
        table = results["tables"][kind] = {}
        for scenario in SCENARIOS:
            cos = {shaping: {policy: [] for policy in FAILED_SAMPLES} for shaping in SHAPINGS}
            truth = {shaping: {policy: [] for policy in ("free", *FAILED_SAMPLES)} for shaping in SHAPINGS}
            for seed in range(args.seeds):
                rng = np.random.default_rng([seed, SCENARIOS.index(scenario)])
                values, quality = true_rewards(rng, args.population, args.batch, kind, args.beta)
                clean, faulty = scored(runner, values, None), scored(runner, values, failures(rng, values, scenario))
                for shaping in SHAPINGS:
                    free = coefficients(clean, shaping, "omit")
                    truth[shaping]["free"].append(cosine(free, quality - quality.mean()))
                    for policy in FAILED_SAMPLES:
                        update = coefficients(faulty, shaping, policy)
                        cos[shaping][policy].append(cosine(update, free))
                        truth[shaping][policy].append(cosine(update, quality - quality.mean()))
            for shaping in SHAPINGS:
                closer = float(np.mean(np.array(cos[shaping]["omit"]) > np.array(cos[shaping]["fill"])))
                row = {policy: spread(cos[shaping][policy]) for policy in FAILED_SAMPLES}
                row |= {"omit_closer": closer, "truth": {k: float(np.median(v)) for k, v in truth[shaping].items()}}
                table.setdefault(scenario, {})[shaping] = row
                cell = lambda s: f"{s['median']:.3f} [{s['p10']:.3f}-{s['p90']:.3f}]"  # noqa: E731
                t = row["truth"]
                print(f"| {scenario} | {shaping} | {cell(row['fill'])} | {cell(row['omit'])} | {closer:.0%} | "
                      f"{t['free']:.3f} / {t['fill']:.3f} / {t['omit']:.3f} |", flush=True)
    results["seconds"] = time.time() - started
    print(f"\n{results['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
