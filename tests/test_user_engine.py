"""An engine of the user's own, passed to ESTrainer as the model (issue 62, item 4): one that keeps the
Engine contract but holds no in-process model. Population batching then says why it cannot batch (one
line, or a ConfigError when insisted on) instead of an AttributeError; RandOpt's vote with batching on
(as under --executor ray, whose RayEngine holds no model either) generates member by member. And the one
update of every engine: a non-finite step puts back the master and adam's state alike. And a shaping,
a strategy and an engine registered in a user's own file (tests/user_extensions.py), run with `esft train`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from esft import ESConfig, ESTrainer
from esft.engines.base import Engine, NonFiniteWeights
from esft.engines.transformers_engine import TransformersEngine
from esft.es.shaping import REWARD_SHAPING
from esft.randopt.trainer import RandOptTrainer
from esft.settings.config import ConfigError
from tiny_model import subprocess_env
from toy_task import byte_reward, exact_answer, toy_rows

QUIET = dict(max_tokens=3, eval_batch_size=8, progress=False, logging="none", reward_sandbox=False, iterations=1,
             population_size=2, batch_size=2)


class ModelFreeEngine:
    """The Engine contract by delegation to a transformers engine, without exposing its model."""

    def __init__(self, inner: TransformersEngine):
        self._inner = inner
        self.tokenizer = inner.tokenizer

    def __getattr__(self, name):
        if name in ("model", "master", "trainable", "generated_chunks", "population_class"):
            raise AttributeError(name)  # what a user's engine (or the Ray proxy) does not have
        return getattr(self._inner, name)

    def perturb(self, member_seed, sigma):
        self._inner.perturb(member_seed, sigma)

    def restore(self):
        self._inner.restore()

    def update(self, member_seeds, coefficients, learning_rate=1.0):
        self._inner.update(member_seeds, coefficients, learning_rate)

    def generate(self, prompts, mini_batch_size=None, sampling=None):
        return self._inner.generate(prompts, mini_batch_size, sampling)


@pytest.fixture
def model_free(tiny_model_dir):
    return ModelFreeEngine(TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=3))


def test_population_batching_on_an_engine_without_a_model_is_one_reason(model_free, tmp_path, capfd, one_torch_thread):
    assert isinstance(model_free, Engine) and not hasattr(model_free, "model")
    args = ESConfig(output_dir=str(tmp_path), population_batching=True, **QUIET)
    with pytest.raises(ConfigError, match="ModelFreeEngine engine holds no in-process model to batch members on"):
        ESTrainer(model_free, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(4))
    args = ESConfig(output_dir=str(tmp_path), population_batching="auto", **QUIET)
    trainer = ESTrainer(model_free, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(4))
    assert "members are evaluated one at a time (population batching is off): the ModelFreeEngine engine" in \
        capfd.readouterr().err
    assert trainer.train()["iteration"] == 1  # trained, member by member


def test_randopt_votes_member_by_member_where_the_engine_holds_no_model(model_free, tiny_model_dir, tmp_path,
                                                                        one_torch_thread):
    args = ESConfig(algorithm="randopt", output_dir=str(tmp_path), sigma=0.05, max_tokens=3, eval_batch_size=8,
                    progress=False, logging="none", reward_sandbox=False, iterations=0, population_size=2, randopt_top_k=2)
    trainer = RandOptTrainer(model_free, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(12),
                             eval_dataset=toy_rows(3, start=1000), accuracy_func=exact_answer)
    trainer.executor.population_batching = True  # as a RayExecutor whose actors batch: this process cannot
    prompts = [row["prompt"] for row in toy_rows(3, start=1000)]
    voted = trainer._member_generations([11, 12], prompts, None, None)
    reference = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=3)
    expected = []
    for seed in (11, 12):
        reference.perturb(seed, 0.05)
        expected.append(reference.generate(prompts).texts)
        reference.restore()
    assert [g.texts for g in voted] == expected
    trainer.close()


@pytest.mark.parametrize("optimizer, coefficient, learning_rate", [("sgd", 1e37, 1.0), ("adam", 1.0, 1e37)])
def test_a_non_finite_update_puts_back_the_master_and_the_optimizer_state(tiny_model_dir, optimizer, coefficient,
                                                                          learning_rate):
    """esft.es.update.apply_update for every engine: the last tensor overflows float32, after every other
    tensor was stepped; the master and adam's moments of all of them are as before the update."""
    engine = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=3,
                                                optimizer={"kind": optimizer})
    engine.update([1, 2], [0.5, -0.5], 1e-3)  # adam: a state to put back
    name = engine.trainable[-1][1]
    engine.model.get_parameter(name).data.fill_(3.4e38)  # the last tensor at float32's limit: its step overflows
    engine.master[name].fill_(3.4e38)
    master = {key: tensor.clone() for key, tensor in engine.master.items()}
    state = {key: tensor.clone() for key, tensor in engine.optimizer_state().items()}
    assert (optimizer == "adam") == bool(state)
    with pytest.raises(NonFiniteWeights, match=f"1 tensor\\(s\\) non-finite \\({name}\\)"):
        engine.update([3, 4], [coefficient, -coefficient], learning_rate)
    assert all(torch.equal(engine.master[key], master[key]) for key in master)
    after = engine.optimizer_state()
    assert after.keys() == state.keys() and all(torch.equal(after[key], state[key]) for key in state)
    engine.update([3, 4], [0.5, -0.5], 1e-3)  # a finite step after it still moves every other tensor
    assert not torch.equal(engine.master[engine.trainable[0][1]], master[engine.trainable[0][1]])


def test_a_shaping_a_strategy_and_an_engine_of_the_users_own_run_esft_train(tiny_model_dir, tmp_path):
    """docs/architecture.md's walkthroughs, as a user runs them: tests/user_extensions.py registers the
    `sign` shaping, the `elite` strategy and the `counting` engine, then is `esft train` (a subprocess)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in toy_rows(8)))
    rewards = Path(__file__).parent / "toy_task.py"
    command = [sys.executable, str(Path(__file__).parent / "user_extensions.py"), "train", "--model", str(tiny_model_dir),
               "--engine", "counting", "--reward-shaping", "sign", "--strategy", "elite", "--train-data", str(data), "--eval-data", str(data),
               "--reward-funcs", f"{rewards}:byte_reward", "--iterations", "2", "--population-size", "4",
               "--batch-size", "2", "--max-tokens", "4", "--eval-batch-size", "8", "--sigma", "0.05", "--no-progress",
               "--logging", "none", "--output-dir", str(tmp_path), "--run-name", "mine"]
    proc = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "counting engine: first generate call" in proc.stderr
    assert re.search(r"elite strategy: members \[\d, \d\] of 4 move the weights", proc.stderr)  # the better half
    assert "members are evaluated one at a time (population batching is off)" not in proc.stderr  # auto: off, silently
    config = yaml.safe_load((tmp_path / "mine" / "config.yaml").read_text())
    assert config["engine"] == "counting" and config["reward_shaping"] == "sign" and config["strategy"] == "elite"
    rows = [json.loads(line) for line in (tmp_path / "mine" / "metrics.jsonl").read_text().splitlines()]
    training = [row for row in rows if "reward/mean" in row]
    assert [row["iteration"] for row in training] == [1, 2] and all(row["es/update_ratio"] > 0 for row in training)
    # the registry is the user's file's: a plain `esft train` does not know the engine (one line, exit 2)
    proc = subprocess.run([sys.executable, "-m", "esft.cli", *command[2:]], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    built_in = ", ".join(name for name in REWARD_SHAPING if name != "sign")  # this process may hold the user's too
    assert proc.returncode == 2 and f"--reward-shaping: must be one of {built_in}; got 'sign'" in proc.stderr, proc.stderr


def test_the_walkthroughs_engine_keeps_the_contract():
    from user_extensions import CountingEngine

    from test_architecture import test_every_engine_keeps_the_contract

    test_every_engine_keeps_the_contract(CountingEngine)
