from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# vLLM's CPU KV cache, GiB per engine (esft's default is 2): the smallest it takes is plenty for the tests'
# few short rows, and a session holds up to four engines at once (the shared one, a test's own, two Ray
# actors', which inherit this environment): at 2 GiB each they came within 1 GB of a 24 GB machine's limit.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiny_model import build_tiny_model, build_tiny_reward_model  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (the README's test command): one worker per core,
    torch.set_num_threads(1)  # each with one torch thread; two threads per worker oversubscribe 2 cores


def _starts_ray_or_vllm(nodeid: str) -> bool:
    """Whether a test starts Ray or a vLLM engine: its file or name says `ray` or `vllm`."""
    name = nodeid.lower()
    return "vllm" in name or "_ray" in name or "ray_" in name


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the test extra); without it, unused
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n 2` (the README's test command), the tests that start Ray or a vLLM engine go to one
    worker, one after another as in a serial run: the session's shared vLLM engine starts once, and no two Ray
    clusters or vLLM KV caches share the machine; the other tests are shared out one by one. (A scheduler, not
    `xdist_group` marks: with pytest 9.2, --dist loadgroup ignores them, pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayAndVllmOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray-and-vllm" if _starts_ray_or_vllm(nodeid) else nodeid

    return RayAndVllmOnOneWorker(config, log)


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
