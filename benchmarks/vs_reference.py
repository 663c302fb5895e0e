"""esft against the paper's plain ES loop, side by side in one run (issue 15).

The reference is written here from the algorithm (../shared/reference/ALGORITHM.md), not copied: per
member, tensor k of `named_parameters()` gets σ·ε added in place (ε drawn from a generator seeded with
seed + k), one greedy `model.generate` over all of the iteration's prompts, the completions are
scored, and σ·ε (regenerated from the seed) is subtracted again; after the population, the update
regenerates every ε per tensor and adds (α/N)·Σ zᵢ·εᵢ. It runs on its own copy of the model.

esft's paths run one full ES iteration as the trainer does (executor.evaluate_population, tell,
update) on a TransformersEngine, all with --mini-batch-size auto:
  sequential  the paper's i.i.d. full-rank noise, one member at a time (--no-population-batching)
  default     ESConfig's defaults: i.i.d. full-rank noise, population batching auto (on for this
              model: each member's own weights, esft.engines.fullrank_population)
  preset      the demo preset (low-rank noise rank 1, population batching)
  limit       plain batched greedy generation of the same N × prompts rows by esft's decoder, no
              perturbation, no update: no exact ES path can beat it. Its column, limit / path, is each
              path's fraction of it, taken round by round like the ratio: the figure that carries from one
              host to another, where reference / path moves with the host's speed for one-member calls
              (docs/benchmarks.md, "A fresh VM, F")
Same model, prompts (Countdown, natural completion lengths: EOS ends them), population and token
budget (max new tokens). Rounds alternate the paths, --repeats times each inside a round (a slow
spell hits all alike), a round's figure their mean: on a shared VM one measurement moves ±10-15% at random,
and with 3 repeats a third of the runs were refused as noisy (6 by default; --raw-json keeps every
measurement); every measurement repeats the same work: the first iteration's seeds and prompt
batch, each path's weights reset to the starting ones after it (untimed), so rounds differ only by the
machine's noise. Each round runs in a fresh process after one untimed iteration of every path: rounds
inside one process shared its heap and page placement, so their spread missed what differs between two
runs of this script, and runs disagreed by more than their spreads (--no-round-processes: the old way).
glibc's malloc is set in every process as `esft train` sets it (esft.allocator; --default-allocator to skip).
Times are the measuring process's CPU seconds (with --threads 1 barely disturbed by other jobs) and
wall seconds, medians over rounds; the ratio
is reference / path (> 1: esft is faster), taken round by round, printed as the median with its spread
(min–max), the load average and the host's steal (CPU time the VM lost to other tenants); a spread beyond
±10% prints "noisy: rerun" instead of a ratio.
--neighbour runs another job beside it (a process copying 256 MiB arrays on the other core): it slows the
paths unequally (on machine E the batched ones 8-14%, the reference at most 4%), so what else shares the
host, unseen in a VM, moves the ratios (docs/benchmarks.md, "Heap only, and what moves ...").

    python benchmarks/vs_reference.py --model embedded --prompts 32,200          # 5 rounds
    python benchmarks/vs_reference.py --model 30m --prompts 32,200 --rounds 3
    python benchmarks/vs_reference.py --model 30m --device cuda --dtype bfloat16 --prompts 32,200  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import (build_model, cpu_description, format_ratio, load_average, ratio_summary,  # noqa: E402
                              round_in_fresh_process, scratch_directory)

from esft.allocator import steady_allocator  # noqa: E402  (what esft train sets: the same process conditions)
from esft.files import write_text_atomic  # noqa: E402


PATHS = ("reference", "sequential", "default", "preset", "limit")

# --neighbour: another job streaming through memory on the other core, until killed
NEIGHBOUR = "import numpy as n\na = n.ones(1 << 25); b = n.empty_like(a)\nwhile True: n.copyto(b, a)"


class ReferenceLoop:
    """The paper's loop, written from its description: in-place perturb, one generate, subtract."""

    def __init__(self, model, tokenizer, sigma: float, alpha: float, max_tokens: int):
        import torch

        self.initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        self.model, self.tokenizer, self.sigma, self.alpha = model.eval().requires_grad_(False), tokenizer, sigma, alpha
        self.max_tokens = max_tokens
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        tokenizer.padding_side = "left"

    def _noise(self, seed: int, index: int, param):
        import torch

        self.generator.manual_seed(seed + index)
        return torch.randn(param.shape, generator=self.generator, dtype=param.dtype, device=self.device)

    def iteration(self, seeds, prompts, rows, reward) -> list[float]:
        import numpy as np
        import torch

        params = list(self.model.named_parameters())
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        rewards = []
        with torch.no_grad():
            for seed in seeds:
                for index, (_, param) in enumerate(params):
                    param.add_(self._noise(seed, index, param), alpha=self.sigma)
                output = self.model.generate(**batch, do_sample=False, max_new_tokens=self.max_tokens,
                                             pad_token_id=self.tokenizer.pad_token_id)
                texts = self.tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
                scores = reward(prompts, texts, **{k: [r[k] for r in rows] for k in ("numbers", "target")})
                rewards.append(float(np.mean(scores)))
                for index, (_, param) in enumerate(params):
                    param.sub_(self._noise(seed, index, param), alpha=self.sigma)
            values = np.asarray(rewards)
            z = (values - values.mean()) / (values.std() + 1e-8)
            for index, (_, param) in enumerate(params):
                total = torch.zeros_like(param)
                for seed, zi in zip(seeds, z):
                    total.add_(self._noise(seed, index, param), alpha=float(zi))
                param.add_(total, alpha=self.alpha / len(seeds))
        return rewards

    def reset(self) -> None:
        self.model.load_state_dict(self.initial)


class LimitPath:
    """Plain batched generation of all N × prompts rows (no noise, no update), rows per call from --mini-batch."""

    def __init__(self, model, tokenizer, args):
        from esft.engines.transformers_engine import TransformersEngine

        self.engine = TransformersEngine(model, tokenizer, noise="iid", max_tokens=args.max_tokens,
                                         mini_batch_size=_mini_batch(args.mini_batch))

    def iteration(self, seeds, batch) -> list[float]:
        self.engine.generate(list(batch.prompts) * len(seeds))
        return []  # no rewards: the table prints "—" for its mean reward

    def reset(self) -> None:  # nothing changes its weights
        pass


class EsftPath:
    """One of esft's paths: an engine, an executor, the strategy and the update, as the trainer runs them."""

    def __init__(self, name: str, model, tokenizer, args):
        from esft.settings.config import ESConfig
        from esft.engines.population import population_batching_problem
        from esft.engines.transformers_engine import TransformersEngine
        from esft.executors import ExecutorSettings, LocalExecutor, resolve_population_batching
        from esft.rewards.runner import RewardRunner
        from esft.tasks.countdown import countdown_reward

        preset = name == "preset"
        self.engine = TransformersEngine(model, tokenizer, noise="lowrank" if preset else "iid", rank=1,
                                         max_tokens=args.max_tokens, mini_batch_size=_mini_batch(args.mini_batch))
        self.rewards = RewardRunner([countdown_reward], sandbox=False)
        settings = ESConfig(noise=self.engine.noise, population_batching=False if name == "sequential" else "auto")
        batched = resolve_population_batching(ExecutorSettings.of(settings), lambda: population_batching_problem(self.engine))
        self.executor = LocalExecutor(self.engine, self.rewards.score, population_batching=batched)
        self.sigma, self.alpha = args.sigma, args.sigma / 2
        self.initial = self.engine.master_state()

    def iteration(self, seeds, batch) -> list[float]:
        from esft.es.strategies.base import ESState
        from esft.es.strategies.paper import STRATEGY as PAPER

        members = self.executor.evaluate_population(seeds, batch, self.sigma)
        _, coefficients = PAPER.tell(ESState(0, 0), [m.reward for m in members], self.alpha)
        self.executor.update(seeds, coefficients)
        return [m.reward for m in members]

    def reset(self) -> None:
        self.engine.load_master_state(self.initial)


def refuse_unknown_paths(parser, names: list[str]) -> None:
    """Exit 2 (argparse's error) naming every path not in PATHS, before any model is built."""
    unknown = sorted(set(names) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown path(s) {', '.join(unknown)}; choose from {','.join(PATHS)}")


def build_runners(args, paths) -> tuple[dict, str]:
    """Each path on its own copy of the same model (--model, on --device in --dtype); returns them by name and
    the model's description."""
    import torch

    runners = {}
    for name in paths:
        model, tokenizer, described = build_model(args.model, scratch_directory("esft-bench-"))
        model = model.to(device=args.device, dtype=getattr(torch, args.dtype))
        if name == "reference":
            runners[name] = ReferenceLoop(model, tokenizer, args.sigma, args.sigma / 2, args.max_tokens)
        elif name == "limit":
            runners[name] = LimitPath(model, tokenizer, args)
        else:
            runners[name] = EsftPath(name, model, tokenizer, args)
    return runners, described


def measure_rounds(args, task, paths, size: int, rounds: int, warm_up: bool):
    """`rounds` rounds in this process: each path on its own copy of the model, --repeats alternating
    measurements per round of the same work (iteration 0's seeds and prompts, weights reset after each);
    with `warm_up` one untimed iteration per path first. Returns {"cpu", "wall", "faults": per path and round, a
    round's figure the mean of its repeats; "each": per path and round, every measurement's CPU seconds in order;
    "tokens": each path's mean reward; "model": the model's description}."""
    import resource

    import numpy as np
    import torch

    from esft.es.strategies.base import ESState

    from esft.es.strategies.paper import STRATEGY as PAPER
    from esft.es.batches import prompt_batch
    from esft.tasks.countdown import countdown_reward

    runners, described = build_runners(args, paths)
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    wall: dict[str, list[float]] = {name: [] for name in paths}
    faults: dict[str, list[float]] = {name: [] for name in paths}  # minor page faults: fresh memory touched
    each: dict[str, list[list[float]]] = {name: [] for name in paths}  # every measurement, for --raw-json
    tokens: dict[str, float] = {}
    seeds = PAPER.ask(ESState(0, 0), args.population)  # the same work every round
    batch = prompt_batch(task.train_dataset, 0, size, 0)

    def run(name):
        runner = runners[name]
        if name == "reference":
            return runner.iteration(seeds, batch.prompts, batch.rows, countdown_reward)
        return runner.iteration(seeds, batch)

    if warm_up:  # a fresh process's first iteration pays one-off costs (lazy imports, heap growth)
        for name in paths:
            run(name)
            runners[name].reset()
    for _ in range(rounds):
        for name in paths:
            cpu[name].append(0.0)
            wall[name].append(0.0)
            faults[name].append(0.0)
            each[name].append([])
        for _ in range(args.repeats):  # alternating inside the round too; a round's figure is their mean
            for name in paths:
                started_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started_wall, started_cpu = time.perf_counter(), time.process_time()
                rewards = run(name)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                each[name][-1].append(time.process_time() - started_cpu)
                cpu[name][-1] += each[name][-1][-1] / args.repeats
                wall[name][-1] += (time.perf_counter() - started_wall) / args.repeats
                faults[name][-1] += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - started_faults) / args.repeats
                runners[name].reset()  # untimed: the next measurement starts from the same weights
                tokens[name] = float(np.mean(rewards)) if rewards else None
    return {"cpu": cpu, "wall": wall, "faults": faults, "each": each, "tokens": tokens, "model": described}


def _mini_batch(value: str):
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, 30m or a model directory")
    parser.add_argument("--prompts", default="32,200", help="prompts per iteration, comma-separated")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; ratios are medians over them")
    parser.add_argument("--repeats", type=int, default=6,
                        help="measurements of each path per round, alternating; a round's figure is their mean (one "
                             "measurement moves ±10-15%% at random on a shared VM: with 3, a third of the runs "
                             "were refused as noisy)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default malloc thresholds (noisier: see esft.allocator)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="comma-separated, from " + ",".join(PATHS) + " (limit: plain batched generation of the "
                             "same rows; with it the table gives each path's fraction of it)")
    parser.add_argument("--mini-batch", default="auto", help="prompts per generate call of esft's paths (auto or a number)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then the ratio is of wall seconds, synchronised)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the model's weights)")
    parser.add_argument("--round-processes", action=argparse.BooleanOptionalAction, default=True,
                        help="each round in a fresh process after one untimed iteration per path (default), so the "
                             "spread includes what differs between processes (heap and page placement), as between "
                             "two runs of the script; --no-round-processes: all rounds in this process")
    parser.add_argument("--neighbour", action="store_true",
                        help="run a process copying 256 MiB arrays over and over beside the measurement (memory "
                             "bandwidth and the shared cache taken, as by another job on the machine), to see how "
                             "the ratios depend on what shares the host")
    parser.add_argument("--raw-json", default=None,
                        help="also write every measurement (CPU seconds per path, round and repeat, in order) and the "
                             "tables' figures to this JSON file, to pool runs or study the noise")
    parser.add_argument("--one-round-json", default=None, help=argparse.SUPPRESS)  # set for the per-round processes
    args = parser.parse_args()
    refuse_unknown_paths(parser, args.paths.split(","))
    if args.raw_json and not Path(args.raw_json).resolve().parent.is_dir():  # before any measuring, not after
        parser.error(f"--raw-json {args.raw_json}: its folder does not exist; create it or name a file in an existing one")

    import os

    import torch

    from esft.tasks.countdown_task import make_countdown_task

    torch.set_num_threads(args.threads)
    allocator = "allocator: the system's defaults" if args.default_allocator else steady_allocator()
    task = make_countdown_task(seed=0, difficulty="easy")
    paths = args.paths.split(",")
    if args.one_round_json:  # a per-round process: one warmed-up round, its figures to the parent as JSON
        figures = measure_rounds(args, task, paths, int(args.prompts), 1, warm_up=True)
        Path(args.one_round_json).write_text(json.dumps({**figures, "pid": os.getpid()}))
        return

    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if args.neighbour else None
    if neighbour is not None:
        print(f"a neighbour copying 256 MiB arrays: process {neighbour.pid}", file=sys.stderr, flush=True)
    try:
        _measure_and_print(args, task, paths, allocator)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def _measure_and_print(args, task, paths: list[str], allocator: str) -> None:
    """Every prompt size: its rounds (each in a fresh process unless --no-round-processes), then its table."""
    print(f"# vs_reference: model {args.model} ({args.dtype} on {args.device}), N = {args.population}, max "
          f"{args.max_tokens} new tokens, {args.threads} thread(s), {args.rounds} rounds of {args.repeats} alternating "
          f"repeats{' (each round a fresh process, warmed up)' if args.round_processes else ''}, natural completion "
          f"lengths; {allocator}; {cpu_description()}{'; a neighbour copying 256 MiB arrays' if args.neighbour else ''}")
    raw = {"command": [Path(sys.executable).name, *sys.argv], "host": cpu_description(), "sizes": {}}
    for size in (int(s) for s in args.prompts.split(",")):
        if args.round_processes:  # each round in its own process, so the spread includes what differs between runs
            figures = {key: {name: [] for name in paths} for key in ("cpu", "wall", "faults", "each")}
            for round_ in range(args.rounds):
                one = round_in_fresh_process(__file__, round_, ["--prompts", str(size)])
                for key in ("cpu", "wall", "faults", "each"):
                    for name in paths:
                        figures[key][name] += one[key][name]
                figures["tokens"], figures["model"] = one["tokens"], one["model"]
                print(f"  {size} prompts: round {round_ + 1}/{args.rounds} (process {one['pid']}): " + ", ".join(
                    f"{name} {one['cpu'][name][0]:.2f} s" for name in paths), file=sys.stderr, flush=True)
        else:
            figures = measure_rounds(args, task, paths, size, args.rounds, warm_up=False)
        _print_table(args, size, paths, figures)
        if args.raw_json:  # written after every size, whole (a half-written file is never left)
            raw["sizes"][str(size)] = figures
            write_text_atomic(Path(args.raw_json), json.dumps(raw, indent=1))


def _print_table(args, size: int, paths: list[str], figures: dict) -> None:
    """One prompt size's table: CPU and wall seconds per path, each path's ratio to the reference and (with the
    limit among the paths) its fraction of the limit, both taken round by round and summarised over rounds."""
    cpu, wall, faults = figures["cpu"], figures["wall"], figures["faults"]
    clock = wall if args.device.startswith("cuda") else cpu  # on a GPU the CPU clock says little
    print(f"\n## {size} prompts per iteration ({figures['model']}); {load_average()}")
    which = "wall" if clock is wall else "CPU"
    limit = "limit" in clock
    print(f"| path | CPU s/iteration (median, min–max) | wall s/iteration (median) | reference / path ({which}; "
          f"median of the rounds' ratios, min–max) |" + (" limit / path (fraction of the limit) |" if limit else "")
          + " mean reward | page faults per iteration (median) |")
    print("| --- " * (6 + limit) + "|")

    def per_round(top: str, name: str, percent: bool = False) -> str:  # each round's ratio: a load spike hits both
        if top not in clock or name == top:
            return "—"
        return format_ratio(ratio_summary([t / p for t, p in zip(clock[top], clock[name])]), percent=percent)

    for name in paths:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        reward = figures["tokens"][name]
        print(f"| {name} | {c:.2f} ({min(cpu[name]):.2f}–{max(cpu[name]):.2f}) | {w:.2f} | "
              f"{per_round('reference', name)} |"
              + (f" {per_round('limit', name, percent=True)} |" if limit else "")
              + f" {'—' if reward is None else f'{reward:.3f}'} | {statistics.median(faults[name]):,.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
