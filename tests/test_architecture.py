"""The architecture stays as the README draws it: one-way imports (no cycles, module-level or inside
functions), rooms that do not reach upwards, files under 600 lines, and every engine keeping the
Engine contract of esft.engines.base."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from esft.engines.base import Engine

PACKAGE = Path(__file__).parents[1] / "src" / "esft"
MAX_LINES = 600
"""A module past this is the signal to split it where one of its concerns ends (issue 62), not a count to fill."""

# room -> rooms it must never import (directly or inside a function): arrows run
# cli → trainer → {loop, es (pure math), executors → engines, tasks → rewards, runs} → settings (ESConfig) → models;
# grpo beside the trainer.
# A key is a package (every module in it) or one module; imports inside the key itself are allowed.
FORBIDDEN = {
    "esft.es": ("esft.",),  # the ES math needs nothing else of esft
    "esft.es.strategies": ("esft.",),  # ask/tell is pure: not even the noise (ALLOWED: fitness and its shaping)
    "esft.es.fitness": ("esft.",),  # fitness as data: numpy only
    "esft.es.shaping": ("esft.",),  # the shaping registry reads a Fitness, nothing else (ALLOWED)
    "esft.es.noise": ("esft.",),  # but for ALLOWED's mirror helper
    "esft.es.batches": ("esft.",),
    "esft.engines.registry": ("esft.",),  # what engines there are, read by the settings: data, no imports
    "esft.child_processes": ("esft.",),
    "esft.template_probe": ("esft.",),  # a chat template's first rendering bounded: for tasks and reward models alike  # how engines and the reward sandbox start children: needs nothing of esft
    "esft.engines": ("esft.executors", "esft.trainer", "esft.cli", "esft.tasks", "esft.rewards", "esft.loop",
                     "esft.runs", "esft.grpo"),
    "esft.executors": ("esft.trainer", "esft.cli", "esft.runs", "esft.loop", "esft.grpo"),
    "esft.rewards": ("esft.tasks", "esft.trainer", "esft.cli", "esft.executors", "esft.runs", "esft.loop",
                     "esft.grpo", "esft.es"),
    "esft.rewards.runner": ("esft.engines",),
    "esft.rewards.values": ("esft.engines", "esft.rewards.runner"),
    "esft.rewards.sandbox": ("esft.engines", "esft.rewards.runner"),
    "esft.rewards.usercode": ("esft.",),
    "esft.rewards.models": ("esft.rewards.runner",),
    "esft.rewards.remote": ("esft.engines", "esft.rewards.runner"),
    "esft.runs": ("esft.trainer", "esft.cli", "esft.executors", "esft.engines", "esft.tasks", "esft.rewards",
                  "esft.loop", "esft.grpo", "esft.es"),  # a run's settings (esft.settings) it may read
    "esft.tasks": ("esft.trainer", "esft.cli", "esft.executors", "esft.engines", "esft.loop", "esft.runs",
                   "esft.grpo"),
    "esft.loop": ("esft.cli", "esft.trainer", "esft.grpo"),  # the trainer's helpers: below it
    "esft.trainer": ("esft.cli", "esft.grpo"),
    "esft.grpo": ("esft.cli",),
    "esft.randopt": ("esft.cli", "esft.grpo"),  # --algorithm randopt: a trainer beside trainer.py, as grpo
    "esft.randopt.selection": ("esft.",),  # which members are kept, their vote, their weights: pure math
    "esft.sigma_scan": ("esft.cli", "esft.grpo"),  # σ measured with a trainer's engine and rewards: beside the trainer  # TRL's GRPO behind ESTrainer's interface: a trainer, beside trainer.py
    "esft.grpo.trl_trainer": ("esft.cli", "esft.trainer", "esft.grpo.baseline", "esft.tasks", "esft.rewards",
                              "esft.loop"),
    # ESConfig and its validation: below every room but the root's esft.files (rules reads paths with it)
    # (the ES choices come from esft.es's registries: ALLOWED)
    "esft.settings": ("esft.trainer", "esft.cli", "esft.executors", "esft.engines", "esft.tasks", "esft.rewards",
                      "esft.runs", "esft.loop", "esft.grpo", "esft.es"),
    "esft.settings.fields": ("esft.settings.config", "esft.settings.rules"),  # the definition: below its rules
    "esft.settings.rules": ("esft.settings.config",),
    "esft.settings.trl_names": ("esft.",),
    # a GGUF file or a registry wheel made into a model folder: below settings (model_path, rules use it)
    "esft.models": ("esft.trainer", "esft.cli", "esft.executors", "esft.engines", "esft.tasks", "esft.rewards",
                    "esft.runs", "esft.loop", "esft.grpo", "esft.es", "esft.settings"),
}

ALLOWED = {
    "esft.es.noise": ("esft.es.strategies.antithetic",),
    "esft.es.strategies": ("esft.es.fitness", "esft.es.shaping"),
    "esft.es.shaping": ("esft.es.fitness",),
    "esft.settings": ("esft.es.batches", "esft.es.fitness", "esft.es.groups", "esft.es.noise", "esft.es.optimizers",
                      "esft.es.schedules", "esft.es.shaping", "esft.es.step_rules", "esft.es.strategies",
                      "esft.engines.registry"),
    "esft.rewards": ("esft.es.fitness",),
    "esft.runs": ("esft.rewards.usercode",),
}
"""Exceptions to FORBIDDEN: a negative member seed is a mirrored one (strategies.antithetic.mirror), and the noise
must know how to undo it; tell shapes a Fitness with the shaping registry; the settings' ES choices are
esft.es's registries (one list of each: the prompt choices are esft.es.batches'), a schedule is what esft.es.schedules parses, a prompt-group split what
esft.es.groups can make, and the engines' what esft.engines.registry says of each; a Scores'
mean is fitness's mean; the file a run's code setting names is the one esft.rewards.usercode would load (found
without importing it, for the run's signed record). All of these are pure."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def esft_imports(path: Path) -> set[str]:
    """Every esft module `path` imports, anywhere in the file (functions included). `from esft.a import b`
    counts as esft.a.b when that is a module, else as esft.a."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("esft")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("esft"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found - {module_name(path)}


GRAPH = {module_name(path): esft_imports(path) for path in PACKAGE.rglob("*.py")}


def test_the_import_graph_is_read():
    assert "esft.trainer" in GRAPH["esft.cli"] and "esft.rewards.runner" in GRAPH["esft.trainer"]
    assert "esft.engines.registry" in GRAPH["esft.engines"]  # imports inside functions count


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target in GRAPH and target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_do_not_import_upwards(room):
    members = [m for m in GRAPH if m == room or m.startswith(room + ".")]
    assert members, room
    for module in members:
        bad = [t for t in GRAPH[module] for prefix in FORBIDDEN[room]
               if (t == prefix.rstrip(".") or t.startswith(prefix if prefix.endswith(".") else prefix + "."))
               and not (t == room or t.startswith(room + ".")) and t not in ALLOWED.get(room, ())]
        assert not bad, f"{module} imports {bad}"


def test_no_engine_name_is_compared_outside_the_engines():
    """What an engine can do is its EngineSpec's (esft.engines.registry): settings, executors and the trainer
    ask it, never `args.engine == "vllm"`."""
    from esft.engines.registry import ENGINES

    found = []
    for path in PACKAGE.rglob("*.py"):
        if module_name(path).startswith("esft.engines"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                strings = [n.value for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)]
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {name!r}" for name in strings if name in ENGINES]
    assert not found, found
    assert set(ENGINES) >= {"transformers", "vllm"}


def test_no_file_over_600_lines():
    """The package's modules and the benchmark scripts (the tests are left out: one file per subject)."""
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parents[1] / "benchmarks").glob("*.py")]
    long = {str(p.relative_to(PACKAGE.parents[1])): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_room_is_a_package_that_names_itself():
    """Each folder of modules has an __init__.py whose docstring says its room (a folder without one was
    once hidden by a .gitignore line, `runs/`, that also matched src/esft/runs/)."""
    folders = sorted({p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts})
    missing = [str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py: {missing}"
    silent = [str(f.relative_to(PACKAGE)) for f in folders
              if not ast.get_docstring(ast.parse((f / "__init__.py").read_text()))]
    assert not silent, f"__init__.py without a docstring naming the room: {silent}"


# ----------------------------------------------------------------------------- the engine contract
CONTRACT = [name for name, member in vars(Engine).items() if callable(member) and not name.startswith("_")]


def engine_classes():
    from esft.engines.trained_model import TrainedModelEngine
    from esft.engines.transformers_engine import TransformersEngine

    classes = [TransformersEngine, TrainedModelEngine]
    try:
        from esft.executors.ray_executor import RayEngine

        classes.append(RayEngine)
    except ImportError:  # the ray extra not installed (a GPU image, say): its engine is checked where it is
        pass
    try:
        from esft.engines.vllm_engine import VLLMEngine

        classes.append(VLLMEngine)
    except ImportError:  # vLLM not installed: its engine is checked where it is
        pass
    return classes


def test_the_contract_lists_every_call():
    assert set(CONTRACT) >= {"perturb", "restore", "update", "generate", "checksum", "master_state", "load_master_state",
                             "trainable_names", "num_trainable", "max_length", "embedding_rows", "feeds_padding",
                             "save_pretrained", "close"}
    for name in CONTRACT:
        assert inspect.getdoc(getattr(Engine, name)), f"Engine.{name} says nothing of what it must guarantee"


@pytest.mark.parametrize("cls", engine_classes(), ids=lambda c: c.__name__)
def test_every_engine_keeps_the_contract(cls):
    for name in CONTRACT:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        wanted = [p for p in inspect.signature(getattr(Engine, name)).parameters if p != "self"]
        have = [p for p in inspect.signature(method).parameters if p != "self"]
        assert have[: len(wanted)] == wanted, f"{cls.__name__}.{name}{have} does not take {wanted}"
    assert any("self.tokenizer" in inspect.getsource(c) for c in cls.__mro__ if c is not object), \
        f"{cls.__name__} never sets its tokenizer"


def test_an_in_process_engine_is_an_engine(tiny_model_dir):
    from esft.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=2)
    assert isinstance(engine, Engine)
    assert engine.trainable_names()[0] == next(iter(engine.master)) and engine.max_length() == 1024
    assert engine.embedding_rows() == len(engine.tokenizer) == 258 and engine.feeds_padding()
    engine.model.resize_token_embeddings(100)
    assert engine.embedding_rows() == 100  # read from the model, not from its config at load


@pytest.mark.parametrize("room", ["esft.tasks.building:TaskSettings", "esft.rewards.runner:SandboxSettings",
                                  "esft.engines.settings:EngineSettings", "esft.executors.settings:PoolSettings"])
def test_a_rooms_settings_are_esconfig_fields_of_the_same_names_and_defaults(room):
    """A room receives its own settings (esft.settings.config.settings_for), each an ESConfig field of that name
    with ESConfig's default: a field renamed or re-defaulted on one side only fails here."""
    import dataclasses
    import importlib

    from esft import ESConfig
    from esft.settings.config import settings_for

    module, _, name = room.partition(":")
    settings = getattr(importlib.import_module(module), name)
    fields = {f.name: f for f in dataclasses.fields(ESConfig)}
    for field in dataclasses.fields(settings):
        assert field.name in fields, f"{name}.{field.name} is no ESConfig setting"
        assert field.default == fields[field.name].default, field.name
    config = ESConfig(seed=5, reward_timeout=3.0)
    taken = settings_for(settings, config)
    assert all(getattr(taken, f.name) == getattr(config, f.name) for f in dataclasses.fields(settings))
