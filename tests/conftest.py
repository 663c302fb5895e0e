from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import build_tiny_model, build_tiny_reward_model  # noqa: E402


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
