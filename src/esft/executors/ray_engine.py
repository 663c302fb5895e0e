"""The engine of a run whose weights live in Ray actors (esft.executors.ray_executor)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ray

from esft.engines.base import Generation, Sampling
from esft.settings.config import model_path


class RayEngine:
    """The Engine (esft.engines.base) of a run whose weights live in Ray actors: every call goes to
    the actors (all of them for weight changes, one for reads), so checkpoints, resume and
    evaluation work as with an in-process engine."""

    def __init__(self, executor):  # the RayExecutor (esft.executors.ray_executor) that built it
        from transformers import AutoTokenizer

        self._executor = executor
        self.tokenizer = AutoTokenizer.from_pretrained(model_path(executor.settings.engine, executor.model))
        self._names: list[str] | None = None

    def _all(self, method: str, *args) -> list:
        return ray.get([getattr(slot.actor, method).remote(*args) for slot in self._executor._live()])

    def perturb(self, member_seed: int, sigma: float) -> None:
        self._all("perturb", member_seed, sigma)

    def restore(self) -> None:
        self._all("restore")

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        self._executor.update(member_seeds, coefficients, learning_rate)

    def generate(self, prompts: Sequence[str], mini_batch_size: int | None = None,
                 sampling: Sampling | None = None) -> Generation:
        return self._executor.generate(prompts, mini_batch_size, sampling)

    def checksum(self) -> str:
        return self._executor.checksum()

    def master_state(self) -> dict:
        return self._executor._call_one("master_state")

    def load_master_state(self, state: dict) -> None:
        """Every actor loads `state`; it becomes the base replacements start from."""
        executor = self._executor
        executor._base_ref = ray.put({name: tensor.clone() for name, tensor in state.items()})
        executor.updates = []
        executor._checksum = executor._agreed(ray.get([slot.actor.load_master_state.remote(executor._base_ref) for slot in executor._live()]))

    def optimizer_state(self) -> dict:
        return self._executor._call_one("optimizer_state")

    def load_optimizer_state(self, state: dict) -> None:
        """Every actor loads `state` (after load_master_state); replacements start from it too."""
        executor = self._executor
        executor._base_optimizer_ref = ray.put({name: tensor.clone() for name, tensor in state.items()})
        ray.get([slot.actor.load_optimizer_state.remote(executor._base_optimizer_ref) for slot in executor._live()])

    def trainable_names(self) -> list[str]:
        if self._names is None:
            self._names = self._executor._call_one("trainable_names")
        return list(self._names)

    def num_trainable(self) -> int:
        return self._executor._call_one("num_trainable")

    def max_length(self) -> int | None:
        return self._executor._call_one("max_length")

    def embedding_rows(self) -> int | None:
        return self._executor._call_one("embedding_rows")

    def feeds_padding(self) -> bool:
        return self._executor._call_one("feeds_padding")

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        for name, data in self._executor._call_one("saved_files").items():
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def close(self) -> None:
        self._executor.close()
