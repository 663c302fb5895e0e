"""The in-process executor: one engine, members one after another or all in one batched generate
call. Every executor answers the same calls (evaluate_population, update, generate, checksum), so
the trainer never knows where the weights live."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from esft.console import say
from esft.es.batches import PromptBatch
from esft.settings.config import ConfigError
from esft.engines.base import Engine, Generation, Sampling, optional, perturbed
from esft.engines.registry import engine_spec
from esft.executors.settings import ExecutorSettings
from esft.rewards.runner import Scores

Scorer = Callable[[Sequence[dict[str, Any]], Sequence[str], Sequence[Sequence[int]]], Scores]
"""scorer(rows, completions, completion_ids) -> Scores (RewardRunner.score)."""


@dataclass
class MemberResult:
    """What one perturbed member scored on the iteration's prompt batch."""

    seed: int
    reward: float
    """Mean reward over the batch, failed samples counting --failure-reward (Scores.mean); the trainer's
    fitness is esft.loop.member_fitness.fitness_of, which leaves them out by default."""
    scores: Scores
    num_tokens: int
    fingerprints: tuple[int, ...] = ()
    """A digest of each completion (Generation.fingerprints): whether members wrote the same text."""


def resolve_population_batching(settings: ExecutorSettings, problem: Callable[[], str | None]) -> bool:
    """Whether members are evaluated batched, from --population-batching: True needs the model to pass
    the batched path's self-check (`problem()` says why not: a ConfigError); "auto" is on for the
    transformers engine when it passes and for `--engine vllm` with `--noise lowrank` or LoRA-ES
    (members as LoRA adapters), else off with the reason said in one line; False is off."""
    pool, engine = settings.pool, settings.engine
    wanted = pool.population_batching
    if wanted is False or pool.algorithm not in ("es", "randopt") or pool.iterations == 0:  # no ES members to evaluate
        return False
    if wanted == "auto" and not engine_spec(engine.engine).batches_members(engine.noise, engine.uses_lora()):
        return False  # e.g. vLLM batches members itself only as LoRA adapters (low-rank noise, LoRA-ES)
    reason = problem()
    if reason is None:
        return True
    if wanted is True:
        raise ConfigError("population_batching", reason)
    print(f"esft: members are evaluated one at a time (population batching is off): {reason}", file=sys.stderr)
    return False


class LocalExecutor:
    """Evaluates members on a single in-process engine: one after another, or together in batched
    generate calls (`population_batching`: esft.engines.population) where a call holds more than one
    member's rows."""

    def __init__(self, engine: Engine, scorer: Scorer, population_batching: bool = False, overlap_rewards: bool = True):
        self.engine = engine
        self.scorer = scorer
        self.population_batching = population_batching
        self.overlap_rewards = overlap_rewards
        """Sequential path: score member i in a background thread while member i+1 generates (torch
        kernels release the GIL; sandboxed reward functions run in other processes)."""
        self._said_batching = False

    def evaluate_population(self, member_seeds: Sequence[int], batch: PromptBatch, sigma: float,
                            sampling: Sampling | None = None) -> list[MemberResult]:
        """Perturb (θ + σ·ε, σ this iteration's) → generate → restore → score, for each member, on the same
        prompt batch: greedy, or as `sampling` says (ES's sampled rollouts: common random numbers)."""
        rows, prompts = batch.rows, batch.prompts
        sigma = float(sigma)
        if self.population_batching:
            from esft.engines.population import generate_population, members_per_call

            group = members_per_call(self.engine, len(member_seeds), prompts)
            self._say_batching(group, len(member_seeds))
            if group > 1:  # else one member's prompts fill a call: the path below, weights in place, no copies
                generations = generate_population(self.engine, prompts, member_seeds, sigma, group=group,
                                                  sampling=sampling)
                return [self._result(seed, generation, self.scorer(rows, generation.texts, generation.token_ids))
                        for seed, generation in zip(member_seeds, generations)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="esft-reward") as pool:
            pending = []
            for seed in member_seeds:
                with perturbed(self.engine, seed, sigma):
                    generation = self.engine.generate(prompts, sampling=sampling)
                pending.append((seed, generation, pool.submit(self.scorer, rows, generation.texts, generation.token_ids)))
                if not self.overlap_rewards:
                    pending[-1][2].result()
            return [self._result(seed, generation, future.result()) for seed, generation, future in pending]

    def _say_batching(self, group: int, members: int) -> None:
        """Once per executor: what population batching chose (full-rank members each hold their own
        weights: as many per call as fit in free memory, esft.engines.sizing)."""
        if self._said_batching:
            return
        self._said_batching = True
        what = (f"{group} of {members} members per generate call" if group > 1 else
                "members one at a time (one member's copy of the weights and its rows fill a call)")
        say(f"esft: population batching: {what}")  # above the progress bar, on a line of its own

    @staticmethod
    def _result(seed: int, generation: Generation, scores: Scores) -> MemberResult:
        return MemberResult(seed, scores.mean(), scores, sum(generation.num_tokens), generation.fingerprints())

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """Apply the optimizer's step on G = Σ coefficientsᵢ·εᵢ on the engine (sgd: θ += G; Engine.update)."""
        self.engine.update(member_seeds, coefficients, learning_rate)

    def update_ratio(self) -> float | None:
        """‖Δθ‖/‖θ‖ of the last update, where the engine measures it (esft.es.update: transformers, vLLM), else None."""
        return optional(self.engine, "last_update_ratio")

    def update_survival(self) -> float | None:
        """How much of the last update survived rounding without a master (esft.es.update), else None."""
        return optional(self.engine, "last_update_survival")

    def generate(
        self, prompts: Sequence[str], mini_batch_size: int | None = None, sampling: Sampling | None = None
    ) -> Generation:
        """Completions of the unperturbed model (evaluation): greedy unless `sampling` says otherwise."""
        return self.engine.generate(prompts, mini_batch_size=mini_batch_size, sampling=sampling)

    def checksum(self) -> str:
        return self.engine.checksum()

    def close(self) -> None:
        self.engine.close()
