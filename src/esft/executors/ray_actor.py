"""The Ray actor of the Ray executor (esft.executors.ray_executor): one engine plus the task, in
its own process on some node of the cluster."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import ray

from esft.engines.base import Sampling, optional
from esft.es.batches import PromptBatch, prompt_batch
from esft.executors.local import LocalExecutor, MemberResult
from esft.rewards.conventions import RewardTrainerState
from esft.executors.settings import ExecutorSettings
from esft.rewards.runner import reward_runners


class ESActor:
    """One engine plus the task, inside a Ray actor process."""

    def __init__(self, settings: ExecutorSettings, model: str | None, driver_path: Sequence[str] = ()):
        # Modules the driver imports reward functions from (a script's directory, tests/) are
        # importable here too when this node has them; on other nodes install them or ship them
        # with Ray's runtime_env (README).
        sys.path.extend(p for p in driver_path if p not in sys.path and os.path.isdir(p))
        import torch

        from esft.allocator import steady_allocator

        self.allocator = steady_allocator()  # as `esft train` does in its own process: no fresh page faults per call

        threads = max(1, int(settings.pool.ray_cpus_per_worker))
        torch.set_num_threads(threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # several engines share a node's cores
        from esft.engines import build_engine

        self.settings, self.task = settings, None
        # The engine's own lines (what is frozen, ...) would stay in this actor's log (the driver runs
        # Ray with log_to_driver=False): kept for the driver to print once (startup_notes).
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):
                self.engine = build_engine(settings.engine, model)
        finally:
            sys.stderr.write(printed.getvalue())
        self._notes = [line for line in printed.getvalue().splitlines() if line.startswith("esft: ")]
        self._batch: PromptBatch | None = None

    def set_task(self, task, population_batching: bool) -> None:
        """Hold the task (datasets, reward functions) and score exactly as the trainer does, through
        the same reward runners (esft.rewards.runner.reward_runners); members batched as the driver resolved
        --population-batching (esft.executors.local.resolve_population_batching)."""
        self.task, self._batch = task, None
        self.rewards, _ = reward_runners(task, self.settings.sandbox)
        self._local = LocalExecutor(self.engine, self.rewards.score, population_batching=population_batching)

    def close(self) -> None:
        """Stop the engine (a vLLM engine's processes and socket files) and the reward workers, then end
        this actor's process as a normal exit does (multiprocessing removes its files): killed, it leaves
        them in the temporary directory."""
        self.engine.close()
        if self.task is not None:
            self.rewards.close()
        ray.actor.exit_actor()

    def startup_notes(self) -> list[str]:
        """The `esft: ...` lines the engine printed while it was built."""
        return list(self._notes)

    def identity(self) -> tuple[int, str]:
        """(pid, node ip): names the actor in errors; the test kills the pid."""
        return os.getpid(), ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this actor runs on (the node tests check where a replacement landed)."""
        return ray.get_runtime_context().get_node_id()

    def process_settings(self) -> dict[str, str | int]:
        """What this actor's process runs with: malloc (esft.allocator) and torch threads."""
        import torch

        return {"allocator": self.allocator, "threads": torch.get_num_threads()}

    def evaluate(self, seeds: Sequence[int], iteration: int, rows: list | None, sigma: float,
                 sampling: Sampling | None = None) -> list[MemberResult]:
        """These members on this actor's engine, exactly as the LocalExecutor evaluates them (one at
        a time, or batched with --population-batching), perturbed by `sigma` (the iteration's σ),
        on the iteration's prompt batch: rebuilt here from the task's train set
        (esft.es.batches.prompt_batch) unless `rows` are given; greedy unless `sampling` says otherwise."""
        if rows is not None:
            batch = PromptBatch(iteration, rows)
        else:
            if self._batch is None or self._batch.iteration != iteration:
                pool = self.settings.pool
                self._batch = prompt_batch(self.task.train_dataset, pool.seed, pool.batch_size, iteration)
            batch = self._batch
        self.rewards.trainer_state = RewardTrainerState(iteration, self.settings.pool.iterations)  # TRL's trainer_state
        return self._local.evaluate_population(seeds, batch, sigma, sampling)

    def population_batching_problem(self) -> str | None:
        """Why this actor's model cannot evaluate members batched (None: it can)."""
        from esft.engines.population import population_batching_problem

        return population_batching_problem(self.engine)

    def update(self, seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> str:
        self.engine.update(seeds, coefficients, learning_rate)
        return self.engine.checksum()

    def update_ratio(self) -> float | None:
        return self._local.update_ratio()

    def update_survival(self) -> float | None:
        return self._local.update_survival()

    def synchronise(self, base: dict | None, updates: Sequence[tuple[list[int], list[float], float]], state: dict | None,
                    base_optimizer: dict | None = None, optimizer: dict | None = None) -> str:
        """Become a replica: load `state` and `optimizer` (a live actor's weights and optimizer state) or
        replay `updates` (seeds, coefficients, learning rate) from the base weights and optimizer state
        (`base`, `base_optimizer` = those of a resume, else the model as loaded and a fresh optimizer)."""
        if state is not None:
            self.engine.load_master_state(state)
            self.engine.load_optimizer_state(optimizer or {})
        else:
            if base is not None:
                self.engine.load_master_state(base)
            if base_optimizer is not None:
                self.engine.load_optimizer_state(base_optimizer)
            for seeds, coefficients, learning_rate in updates:
                self.engine.update(seeds, coefficients, learning_rate)
        return self.engine.checksum()

    def checksum(self) -> str:
        return self.engine.checksum()

    def generate_log(self) -> list[tuple[int, int]]:
        """(rows, distinct LoRA adapters) of each generate call of an engine that logs them (the vLLM
        engine: esft.engines.vllm_engine), else []: how this actor evaluated its share."""
        return list(optional(self.engine, "generate_log"))

    def generate(self, prompts, mini_batch_size=None, sampling=None):
        return self.engine.generate(prompts, mini_batch_size=mini_batch_size, sampling=sampling)

    def master_state(self) -> dict:
        return self.engine.master_state()

    def load_master_state(self, state: dict) -> str:
        self.engine.load_master_state(state)
        return self.engine.checksum()

    def optimizer_state(self) -> dict:
        return self.engine.optimizer_state()

    def load_optimizer_state(self, state: dict) -> None:
        self.engine.load_optimizer_state(state)

    def saved_files(self) -> dict[str, bytes]:
        """The engine's save_pretrained output as {relative path: bytes} (the driver may be on
        another node than this actor)."""
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_pretrained(tmp)
            return {str(p.relative_to(tmp)): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}

    def num_trainable(self) -> int:
        return self.engine.num_trainable()

    def trainable_names(self) -> list[str]:
        return self.engine.trainable_names()

    def max_length(self) -> int | None:
        return self.engine.max_length()

    def embedding_rows(self) -> int | None:
        return self.engine.embedding_rows()

    def feeds_padding(self) -> bool:
        return self.engine.feeds_padding()

    def perturb(self, seed: int, sigma: float) -> None:
        self.engine.perturb(seed, sigma)

    def restore(self) -> None:
        self.engine.restore()
