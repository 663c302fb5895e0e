"""Measuring tools of benchmarks/throughput.py: a peak-RSS sampler, per-phase timers on two clocks,
the benchmark's models, and the instrumentation that times each phase of the ES paths."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------- memory
class RSSSampler:
    """Peak resident memory per labelled phase, from /proc/self/statm sampled in a thread."""

    def __init__(self, interval: float = 0.005):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.interval = interval
        self.label = "idle"
        self.peaks: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.rss()
            if value > self.peaks[self.label]:
                self.peaks[self.label] = value
            time.sleep(self.interval)

    def phase(self, label: str) -> None:
        self.peaks[self.label] = max(self.peaks[self.label], self.rss())
        self.label = label
        self.peaks[label] = max(self.peaks[label], self.rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


MB = 2**20


# -------------------------------------------------------------------- model
def scratch_directory(prefix: str) -> Path:
    """A new temporary directory, removed when the script exits (a model a benchmark builds and saves)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def build_model(name: str, tmp: Path):
    """(model, tokenizer, description) for 'embedded', '30m', 'qwen2-0.5b' or a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from esft.settings.config import embedded_model_path

    if name in ("embedded", "30m"):
        path = embedded_model_path()
        if not (path / "config.json").exists():  # no asset (a bare checkout): its architecture, random weights
            from tiny_model import build_tiny_model

            path = build_tiny_model(tmp / "tiny", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=4)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if name == "embedded":
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, str(path)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=9,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        )
        return LlamaForCausalLM(config).eval(), tokenizer, f"Llama from config (hidden 512, 9 layers, MLP 1536), tokenizer of {path}"
    if name == "qwen2-0.5b":  # the shape of Qwen2-0.5B (494M parameters), random weights, built on the GPU if any
        from transformers import Qwen2Config, Qwen2ForCausalLM

        path = embedded_model_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        )
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(config).eval()
        return model, tokenizer, (f"Qwen2-0.5B's shape from a config (24 layers, hidden 896, vocab 151,936, tied), "
                                  f"random weights, tokenizer of {path.name}")
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), AutoTokenizer.from_pretrained(name), name


def kv_cache_bytes(model, rows: int, length: int) -> int:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rows * config.num_hidden_layers * 2 * heads * head_dim * length * next(model.parameters()).element_size()


# ------------------------------------------------------------ instrumentation
class Timings:
    """Seconds per phase on two clocks: wall (perf_counter) and this process's CPU (process_time).
    With one torch thread the CPU clock counts only our own work, so it is barely disturbed by other
    jobs on a shared machine; the wall clock is what a user waits."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class Instrumented:
    """Binds a path's implementation to the engine and executor, every phase timed (noise time is
    taken out of the phase that drew it)."""

    def __init__(self, engine, executor, timings: Timings):
        import esft.engines.transformers_engine as te
        import esft.es.lowrank as lowrank

        self.engine, self.executor, self.timings = engine, executor, timings
        for module, name in ((te, "draw_noise"), (lowrank, "lowrank_factors")):
            setattr(module, name, self.timed("noise", getattr(module, name)))
        te.decode = self.timed("generate", te.decode)
        executor.scorer = self.timed("reward", executor.scorer)
        self.current = {name: getattr(engine, name) for name in ("perturb", "restore", "update")}
        self.current_evaluate = executor.evaluate_population
        from esft.engines import population

        cls = population.LowRankPopulation
        cls.__init__ = self.timed("perturb", cls.__init__, exclude_noise=True)  # stacking the members' factors
        cls.install = self.timed("perturb", cls.install)
        cls.remove = self.timed("restore", cls.remove)

    def timed(self, label, func, exclude_noise=False):
        timings = self.timings

        def wrapper(*args, **kwargs):
            noise_before = timings.wall["noise"], timings.cpu["noise"]
            started = now()
            try:
                return func(*args, **kwargs)
            finally:
                ended = now()
                for clock, book in enumerate((timings.wall, timings.cpu)):
                    spent = ended[clock] - started[clock]
                    book[label] += spent - (book["noise"] - noise_before[clock] if exclude_noise else 0.0)

        return wrapper

    def bind(self, path: str) -> None:
        for name, method in self.current.items():
            setattr(self.engine, name, self.timed(name, method, exclude_noise=name in ("perturb", "update")))


# ----------------------------------------------------------------- machine
def cpu_description() -> str:
    """The CPU's model name and last-level cache: virtual machines of one name ran this project's decoder at
    7,100 and 14,000 tokens per CPU-second (2026-11-25, docs/benchmarks.md), with other ratios; the
    cache size tells the hosts apart."""
    import platform

    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    try:
        size = caches[-1].read_text().strip() if caches else ""
    except OSError:
        size = ""
    if size.endswith("K") and size[:-1].isdigit():
        size = f"{int(size[:-1]) / 1024:g} MiB"
    return f"{name}, last-level cache {size}" if size else name


# ------------------------------------------------------------------ ratios
SPREAD_LIMIT = 0.10
"""A ratio whose rounds stray further than this from their median is not a result (issue 23)."""


def ratio_summary(ratios: list[float]) -> dict:
    """Median and spread (min–max) of per-round ratios; `noisy` when a round strays beyond ±SPREAD_LIMIT."""
    import statistics

    middle = statistics.median(ratios)
    low, high = min(ratios), max(ratios)
    noisy = len(ratios) < 2 or high > middle * (1 + SPREAD_LIMIT) or low < middle * (1 - SPREAD_LIMIT)
    return {"median": middle, "min": low, "max": high, "rounds": len(ratios), "noisy": noisy}


def format_ratio(summary: dict, percent: bool = False) -> str:
    """'2.09× (2.01–2.15)', or 'noisy: rerun (…)' instead of a headline when the spread is too wide."""
    show = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.2f}×")
    spread = f"{show(summary['min'])}–{show(summary['max'])}, {summary['rounds']} rounds"
    if summary["noisy"]:
        return f"noisy: rerun ({spread})"
    return f"{show(summary['median'])} ({spread})"


def _steal_and_total_ticks() -> tuple[int, int] | None:
    """All CPUs' steal and total time in clock ticks so far (/proc/stat's first line); None where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields)) if len(fields) == 8 else None  # user … softirq, steal (guest is in user)


_TICKS_AT_IMPORT = _steal_and_total_ticks()  # the script's start: steal is reported since then


def load_average() -> str:
    """The 1/5/15-minute load averages, for every printed ratio (a busy machine explains a noisy one), and on
    Linux the share of CPU time the VM's host gave to others (steal) since the script started: inside a VM the
    load average cannot see the host's other tenants, whose work also slows this one's cache and memory."""
    text = "load average " + "/".join(f"{v:.2f}" for v in os.getloadavg())
    now = _steal_and_total_ticks()
    if now is not None and _TICKS_AT_IMPORT is not None and now[1] > _TICKS_AT_IMPORT[1]:
        steal = (now[0] - _TICKS_AT_IMPORT[0]) / (now[1] - _TICKS_AT_IMPORT[1])
        text += f"; host steal {steal:.1%} of CPU time since the start"
    return text


def run_self(script: str, extra: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`script` again in a fresh process with this run's own arguments (sys.argv) and then `extra`, whose
    options win (argparse keeps an option's last value): every option that shapes the work reaches the
    child without a hand-kept list that a new option could miss. `env`: the child's environment if given."""
    return subprocess.run([sys.executable, script, *sys.argv[1:], *extra], capture_output=True, text=True, env=env)


def round_in_fresh_process(script: str, round_index: int, extra: list[str]) -> dict:
    """One round of a benchmark in a fresh process: `script` with this run's arguments, `extra`, one round
    and --one-round-json; returns what that process wrote. Rounds of one process share its heap and page
    placement, so their spread misses what differs between two runs; a process per round puts it in."""
    with tempfile.TemporaryDirectory(prefix="esft-round-") as folder:
        out = Path(folder) / "round.json"
        proc = run_self(script, [*extra, "--rounds", "1", "--no-round-processes", "--one-round-json", str(out)])
        if proc.returncode != 0:
            sys.exit(f"{Path(script).name}: the process of round {round_index + 1} failed (exit {proc.returncode}):\n"
                     f"{proc.stderr[-3000:]}")
        return json.loads(out.read_text())
