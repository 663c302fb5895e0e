"""LoRA-ES (esft.engines.lora): ES over a PEFT adapter only, on a tiny Llama whose outputs move under
perturbation (initializer_range=0.3, as in test_checkpoint). Real PEFT, real runs, the CLI as users
call it: adapter-only changes, bit-exact restore, the exports against the trained engine's logits,
resume and Ray equality, population batching, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="install esft[lora] to test LoRA-ES")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from cli_runner import run_esft_here, without_model_preset
from tiny_model import build_tiny_model, subprocess_env  # noqa: E402
from toy_task import byte_reward, toy_rows  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from esft.runs.checkpoint import load_master  # noqa: E402
from esft.cli import main  # noqa: E402
from esft.settings.config import ConfigError, ESConfig  # noqa: E402
from esft.engines import build_engine  # noqa: E402
from esft.engines.settings import EngineSettings  # noqa: E402
from esft.engines.population import check_population_batching, generate_population  # noqa: E402
from esft.es.noise import draw_noise  # noqa: E402
from esft.trainer import ESTrainer  # noqa: E402

TESTS = Path(__file__).parent
IDS = torch.tensor([[5, 77, 120, 33, 9, 201], [64, 3, 18, 150, 250, 41]])


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("toy-data")
    for name, rows in (("train.jsonl", toy_rows(20)), ("eval.jsonl", toy_rows(4, start=1000))):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def train_args(model: Path, data: Path, out: Path, run_name: str, *extra: str) -> list[str]:
    return ["train", "--preset", "none", "--model", str(model), "--train-data", str(data / "train.jsonl"), "--eval-data",
            str(data / "eval.jsonl"), "--reward-funcs", f"{TESTS / 'toy_task.py'}:byte_reward", "--no-reward-sandbox",
            "--population-size", "4", "--batch-size", "2", "--max-tokens", "6", "--eval-batch-size", "4",
            "--sigma", "0.05", "--logging", "none", "--no-progress", "--output-dir", str(out), "--run-name", run_name,
            "--lora-r", "4", *extra]


def esft(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**subprocess_env(),
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "esft.cli", *without_model_preset(args)], cwd=cwd, env=env,
                          capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def cli_run(lively_model_dir, data_dir, tmp_path_factory) -> Path:
    """`python -m esft.cli train --lora-r 4 ...`: 4 iterations, checkpoints every 2."""
    out = tmp_path_factory.mktemp("cli-runs")
    proc = esft(*train_args(lively_model_dir, data_dir, out, "A", "--iterations", "4", "--save-every", "2"), cwd=out)
    assert proc.returncode == 0, proc.stderr
    return out / "A"


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def lora_args(model: Path, **settings) -> ESConfig:
    return ESConfig(model=str(model), device="cpu", logging="none", progress=False,
                    **{"lora_r": 4, "max_tokens": 6, **settings})


def engine_at(checkpoint: Path, model: Path):
    """The engine a resume builds from `checkpoint`: the run's LoRA on the base, master loaded and verified."""
    engine = build_engine(EngineSettings.of(lora_args(model)))
    load_master(checkpoint, engine)
    return engine


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_es_moves_only_the_adapter_and_restores_bit_exactly(lively_model_dir, dtype):
    engine = build_engine(EngineSettings.of(lora_args(lively_model_dir, dtype=dtype)))
    names = engine.trainable_names()
    assert names and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    # every linear layer of attention and MLP (all-linear), not the LM head / embedding
    assert {n.split(".")[-4] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    params = dict(engine.model.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if n not in names}
    adapter = {n: params[n].detach().clone() for n in names}
    assert all(params[n].dtype == torch.float32 for n in names)  # PEFT keeps adapters float32: master = adapter

    # the noise index of an adapter tensor is its position in the PeftModel's named_parameters()
    index = list(params).index(names[0])
    engine.perturb(7, 0.05)
    expected = torch.add(adapter[names[0]], draw_noise("iid", 7, index, adapter[names[0]].shape), alpha=0.05)
    assert torch.equal(params[names[0]], expected)
    assert all(torch.equal(params[n], base[n]) for n in base)
    engine.restore()
    assert all(torch.equal(params[n], adapter[n]) for n in names)

    before = engine.checksum()
    engine.update([7, 8], [0.02, -0.01])
    assert engine.checksum() != before
    assert all(not torch.equal(params[n], adapter[n]) for n in names)
    assert all(torch.equal(params[n], base[n]) for n in base), "a base weight changed"
    assert engine.master_state().keys() == set(names)


@pytest.mark.parametrize("noise", ["iid", "lowrank"])  # adapter hooks; low-rank hooks on lora_A/lora_B
def test_population_batching_gives_the_sequential_completions(lively_model_dir, noise):
    engine = build_engine(EngineSettings.of(lora_args(lively_model_dir, noise=noise, population_batching=True)))
    engine.update([1, 2, 3], [0.3, -0.2, 0.1])  # B away from 0, so perturbations of A count too
    check_population_batching(engine)  # the once-per-engine logits check passes
    prompts = [f"Q{i}: {i} + {i} =" for i in range(3)]
    seeds, sigma = [11, 12, 13, 14], 0.05
    batched = generate_population(engine, prompts, seeds, sigma)
    sequential = []
    for seed in seeds:
        engine.perturb(seed, sigma)
        sequential.append(engine.generate(prompts).texts)
        engine.restore()
    assert [g.texts for g in batched] == sequential
    assert len({tuple(texts) for texts in sequential}) > 1, "members wrote the same text: the test would be vacuous"


def test_population_batching_follows_dropped_rows_with_correlated_noise(monkeypatch):
    """The embedded model ends its completions at EOS at different steps, so the decoder drops finished
    rows and the hooks must give each remaining row its own member's noise."""
    from esft.es.batches import prompt_batch
    from esft.settings.config import embedded_model_path
    from esft.engines import decoding
    from esft.tasks.countdown_task import make_countdown_task

    engine = build_engine(EngineSettings.of(lora_args(embedded_model_path(), noise="correlated", population_batching=True, max_tokens=48)))
    engine.update([1, 2, 3], [1e-2, -1e-2, 5e-3])  # B away from 0
    running, real = [], decoding.decode

    def watched(*args, on_rows=None, **kwargs):  # records how many rows each population step still runs
        if on_rows is None:
            return real(*args, **kwargs)
        return real(*args, on_rows=lambda active: (running.append(len(active)), on_rows(active)), **kwargs)

    monkeypatch.setattr("esft.engines.transformers_engine.decode", watched)
    prompts = prompt_batch(make_countdown_task(seed=0).train_dataset, 0, 8, 0).prompts
    seeds, sigma = [11, 12, 13], 3e-3
    batched = generate_population(engine, prompts, seeds, sigma)
    assert len(running) > 2 and running == sorted(running, reverse=True), running  # rows were dropped
    for seed, generation in zip(seeds, batched):
        engine.perturb(seed, sigma)
        assert engine.generate(prompts).token_ids == generation.token_ids, seed
        engine.restore()
    assert len({tuple(map(tuple, g.token_ids)) for g in batched}) == len(seeds)  # members really differ


# ----------------------------------------------------------------------------- exports
def test_cli_run_exports_an_adapter_and_a_merged_model_with_the_engines_logits(cli_run, lively_model_dir):
    final, merged_dir = cli_run / "final", cli_run / "final-merged"
    assert (final / "adapter_config.json").is_file() and not list(final.glob("model*.safetensors"))
    engine = engine_at(final, lively_model_dir)  # master loaded and checked against the recorded checksum
    expected = logits(engine.model)
    assert not torch.allclose(expected, logits(AutoModelForCausalLM.from_pretrained(lively_model_dir)))  # it trained

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lively_model_dir), final)
    assert torch.equal(logits(adapter), expected)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert torch.allclose(logits(merged), expected, atol=1e-5, rtol=1e-5)

    base = load_file(str(lively_model_dir / "model.safetensors"))
    merged_weights = load_file(str(merged_dir / "model.safetensors"))
    changed = {n for n in base if not torch.equal(base[n], merged_weights[n])}
    assert changed and all(n.split(".")[-2].endswith("_proj") for n in changed)  # only the adapted linear layers
    assert json.loads((merged_dir / "generation_config.json").read_text())["eos_token_id"] == \
        json.loads((lively_model_dir / "generation_config.json").read_text())["eos_token_id"]


def test_eval_of_the_adapter_the_run_and_the_merged_model_agree(cli_run, lively_model_dir, data_dir, tmp_path, capsys):
    common = ["--train-data", str(data_dir / "train.jsonl"), "--eval-data", str(data_dir / "eval.jsonl"),  # named again:
              "--reward-funcs", f"{TESTS / 'toy_task.py'}:byte_reward", "--no-reward-sandbox",  # never taken silently
              "--max-tokens", "6", "--logging", "none", "--no-progress", "--output-dir", str(tmp_path)]
    lines = {}
    for name, model in (("adapter", ["--model", str(lively_model_dir), "--lora-adapter", str(cli_run / "final")]),
                        ("run", ["--model", str(cli_run / "final")]), ("merged", ["--model", str(cli_run / "final-merged")]),
                        ("base", ["--model", str(lively_model_dir)])):
        capsys.readouterr()
        assert main(["eval", *model, *common, "--run-name", name]) == 0
        lines[name] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("eval: reward"))
    assert lines["adapter"] == lines["run"] == lines["merged"] != lines["base"]


def test_eval_takes_the_runs_settings_however_its_lora_result_is_named(cli_run, lively_model_dir, tmp_path):
    """Issue 25: `--model BASE --lora-adapter RUN/final` and `--model RUN/final-merged` used the
    defaults (other data, 64 tokens); every form must take the run's settings and say which it used."""
    results = {}
    for name, model in (("run", ["--model", str(cli_run / "final")]),
                        ("adapter", ["--model", str(lively_model_dir), "--lora-adapter", str(cli_run / "final")]),
                        ("merged", ["--model", str(cli_run / "final-merged")])):
        proc = run_esft_here("eval", *model, "--trust-run-code",  # the run names a reward file (issue 26: the opt-in)
                             "--logging", "none", "--no-progress", "--output-dir", str(tmp_path), "--run-name", name,
                             cwd=tmp_path)  # in this process: cli_run is the LoRA path's run as a subprocess
        assert proc.returncode == 0, proc.stderr[-2000:]
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("esft eval: evaluating with")]
        assert "max_tokens=6" in line and "eval.jsonl" in line and "task=custom" in line, line
        (row,) = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        results[name] = {k: v for k, v in row.items() if k.startswith("eval/")}
    trained = [json.loads(r) for r in (cli_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert results["run"] == results["adapter"] == {k: v for k, v in trained.items() if k.startswith("eval/")}
    assert results["merged"] == pytest.approx(results["run"], abs=1e-6)


def test_a_run_can_start_from_an_adapter(cli_run, lively_model_dir):
    engine = build_engine(EngineSettings.of(ESConfig(model=str(lively_model_dir), lora_adapter=str(cli_run / "checkpoint-2"), device="cpu")))
    stored = load_file(str(cli_run / "checkpoint-2" / "master.safetensors"))
    assert engine.master_state().keys() == stored.keys()
    assert all(torch.equal(engine.master_state()[n], stored[n]) for n in stored)


# ----------------------------------------------------------------------------- resume, Python API, Ray
def test_resume_ends_bitwise_equal_to_the_uninterrupted_run(cli_run, lively_model_dir, data_dir, tmp_path):
    assert main(train_args(lively_model_dir, data_dir, tmp_path, "B", "--iterations", "2", "--save-every", "1")) == 0
    assert main(["train", "--resume", str(tmp_path / "B" / "checkpoint-1"), "--iterations", "4", "--trust-run-code"]) == 0
    for name in ("final/master.safetensors", "final/adapter_model.safetensors", "final-merged/model.safetensors"):
        a, b = load_file(str(cli_run / name)), load_file(str(tmp_path / "B" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), name
    # what the run did after iteration 1 was set aside, the merged export of its final/ with it
    assert {p.name for p in next((tmp_path / "B").glob("superseded-*")).iterdir()} >= {"checkpoint-2", "final", "final-merged"}


def peft_model(model_dir: Path, **lora) -> PeftModel:
    return get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(**lora))


def test_a_peft_model_passed_in_python_is_trained_and_exported(lively_model_dir, tmp_path):
    model = peft_model(lively_model_dir, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    args = ESConfig(population_size=4, batch_size=2, max_tokens=6, sigma=0.05, iterations=2, save_every=0, device="cpu",
                    logging="none", progress=False, output_dir=str(tmp_path), run_name="py", eval_batch_size=4)
    trainer = ESTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(lively_model_dir),
                        reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(20), eval_dataset=toy_rows(4, start=1000))
    trainer.train()
    assert len(trainer.engine.trainable_names()) == 8  # q and v of 2 layers, A and B
    expected = logits(trainer.engine.model)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "py" / "final-merged")  # merged from a CPU copy
    assert torch.allclose(logits(merged), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lively_model_dir),
                                                        tmp_path / "py" / "final")), expected)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base), "a base weight changed"


@pytest.mark.slow  # a Ray cluster takes ~20 s to start on 2 cores
def test_ray_run_ends_bitwise_equal_to_the_local_run(lively_model_dir, tmp_path):
    """LoRA-ES on Ray (2 actors) saves the local run's adapter and merged model bit for bit (slow: Ray actors)."""
    pytest.importorskip("ray")
    for name, ray_settings in (("local", {}), ("ray", {"executor": "ray", "workers": 2})):
        args = lora_args(lively_model_dir, population_size=4, batch_size=2, sigma=0.05, iterations=2, save_every=0,
                         population_batching=True, eval_batch_size=4, output_dir=str(tmp_path), run_name=name, **ray_settings)
        trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(20),
                            eval_dataset=toy_rows(4, start=1000))
        trainer.train()
        trainer.executor.close()
    for name in ("final/master.safetensors", "final-merged/model.safetensors"):  # Ray merges from the saved adapter
        a, b = load_file(str(tmp_path / "local" / name)), load_file(str(tmp_path / "ray" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), name


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("flags, message", [
    (["--lora-dropout", "0.05"], "--lora-dropout: ES uses no gradients"),
    (["--engine", "vllm", "--noise", "lowrank"], "--noise: LoRA-ES on --engine vllm perturbs the adapter with --noise iid"),
    (["--lora-adapter", "."], "--lora-adapter: '.' is not a PEFT adapter directory"),
    (["--lora-target-modules", "nonexistent_proj"], "--lora-target-modules: Target modules"),
    (["--population-batching", "--engine", "vllm", "--lora-r", "0"], "--population-batching: with --engine vllm needs --noise lowrank"),
])
def test_refusals_are_one_line_and_exit_2(flags, message, lively_model_dir, data_dir, tmp_path, capsys):
    assert main(train_args(lively_model_dir, data_dir, tmp_path, "x", *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("esft: error: ") and message in err[-1], err


def test_settings_that_would_be_ignored_are_refused(lively_model_dir, cli_run):
    with pytest.raises(ConfigError, match="--lora-alpha: is a setting of --lora-r"):
        ESConfig(lora_alpha=16)
    with pytest.raises(ConfigError, match="--lora-r: the adapter .* sets its own rank"):
        ESConfig(model=str(lively_model_dir), lora_adapter=str(cli_run / "final"), lora_r=8)
    with pytest.raises(ConfigError, match="--algorithm: LoRA-ES .* is an ES path"):
        ESConfig(model=str(cli_run / "final"), algorithm="grpo")
    with pytest.raises(ConfigError, match="--lora-adapter: --model .* is itself a LoRA adapter"):
        ESConfig(model=str(cli_run / "final"), lora_adapter=str(cli_run / "final"))
    tokenizer = AutoTokenizer.from_pretrained(lively_model_dir)
    with pytest.raises(ConfigError, match="--lora-dropout: the PeftModel's adapter 'default' has lora_dropout=0.05"):
        build_engine(EngineSettings.of(ESConfig(device="cpu")), peft_model(lively_model_dir, r=2, lora_dropout=0.05), tokenizer)
    with pytest.raises(ConfigError, match="--lora-r: the model is already a PeftModel"):
        build_engine(EngineSettings.of(ESConfig(device="cpu", lora_r=2)), peft_model(lively_model_dir, r=2), tokenizer)
