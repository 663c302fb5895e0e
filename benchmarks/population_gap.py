"""Where the batched path's gap to the limit goes (issue 23): the hooks' cost against the stragglers', per phase.

On one transformers engine, rounds alternating the three, this process's CPU clock (one torch thread):
  limit       plain batched greedy generation of population × batch rows (each prompt once per member,
              member-major), natural lengths: throughput.py's limit;
  population  the batched-lowrank path's generation: every member in one call, low-rank hooks (the hooks'
              construction included);
  replay      the plain model through the same decoder and the same calls, each row forced to end where that
              row of the population ended (EOS forbidden before its length, forced at it): the population's
              row schedule (the same steps, the same drops of finished rows) without the hooks.
population/replay is the hooks' share; replay/limit is the share of the population's lengths (960 distinct
completions end later than 32 prompts' identical copies: more decoding steps with few rows, more drops),
which no exact path removes. For each side it prints the model-forward seconds per phase: the prompt pass
(prefill), decoding steps with all of a call's rows, steps after drops; the rest of a call is the decoder's
own work (argmax, dropping rows, the cache) and, for the population, building its factors. Each round
runs the three --repeats times, alternating, and sums them; ratios are medians over rounds with their
spread (throughput_tools.ratio_summary).

    OMP_NUM_THREADS=1 python benchmarks/population_gap.py                        # demo, 32 prompts
    OMP_NUM_THREADS=1 python benchmarks/population_gap.py --batch 200 --rows 1020
    OMP_NUM_THREADS=1 python benchmarks/population_gap.py --model 30m --max-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from throughput_tools import (build_model, cpu_description, format_ratio, load_average, ratio_summary,  # noqa: E402
                              scratch_directory)

PHASES = ("prefill", "all rows", "after drops", "rest")


class ForwardClock:
    """CPU seconds of the model's forward calls by phase; in `forcing` mode it also makes each running row end
    at its target length (the replay): EOS is forbidden before it and forced at it."""

    def __init__(self, model, eos_ids: list[int]):
        self.eos = torch.tensor(eos_ids)
        vocab = model.get_output_embeddings().out_features
        self.eos_columns = torch.isin(torch.arange(vocab), self.eos)  # built once: not inside the replay's timing
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.forwards = 0
        self.targets: list[torch.Tensor] | None = None  # per call, each row's length (None: not forcing)
        self.call, self.step, self.rows, self.active = -1, 0, 0, None
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def reset(self, targets=None) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.targets, self.call, self.active, self.forwards = targets, -1, None, 0

    def on_rows(self, active: torch.Tensor, _rows_per_member: int = 0) -> None:
        if self.active is None or len(active) >= len(self.active):  # a new generate call starts with all its rows
            self.call, self.step, self.rows = self.call + 1, 0, len(active)
        self.active = active

    def _before(self, module, args):
        self._started = time.process_time()

    def _after(self, module, args, output):
        spent = time.process_time() - self._started
        rows = output.logits.shape[0]
        phase = "prefill" if self.step == 0 else "all rows" if rows == self.rows else "after drops"
        self.seconds[phase] += spent
        self.forwards += 1
        if self.targets is not None:
            lengths = self.targets[self.call][self.active]  # this step makes token number step + 1
            logits = output.logits[:, -1]
            logits[(lengths > self.step + 1)[:, None] & self.eos_columns] = float("-inf")
            ending = lengths == self.step + 1
            logits[ending] = float("-inf")
            logits[ending, int(self.eos[0])] = 0.0
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded' (the demo), '30m' or a model directory")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="prompts per iteration")
    parser.add_argument("--rows", type=int, default=960, help="rows per generate call (limit and population alike)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each side per round, summed")
    parser.add_argument("--sigma", type=float, default=0.001)
    parser.add_argument("--json", default=None, help="also write the rounds here")
    args = parser.parse_args()
    if args.rows < args.population:  # a population call holds every member's copy of at least one prompt
        parser.error(f"--rows {args.rows} is fewer than --population {args.population}: each call holds one row "
                     "per member for every prompt it takes")
    torch.set_num_threads(1)
    from esft.allocator import steady_allocator
    from esft.engines.population import check_population_batching, generate_population
    from esft.engines.transformers_engine import TransformersEngine
    from esft.es.strategies.base import ESState
    from esft.es.strategies.paper import STRATEGY as PAPER
    from esft.es.batches import prompt_batch
    from esft.tasks.countdown_task import make_countdown_task

    allocator = steady_allocator()
    model, tokenizer, description = build_model(args.model, scratch_directory("esft-gap-"))
    engine = TransformersEngine(model, tokenizer, noise="lowrank", rank=1, max_tokens=args.max_tokens)
    prompts = prompt_batch(make_countdown_task(seed=0, difficulty="easy").train_dataset, 0, args.batch, 0).prompts
    seeds = PAPER.ask(ESState(0, 0), args.population)
    per_call = max(1, args.rows // args.population)  # prompts per population call
    check_population_batching(engine)
    engine.generate(prompts[:1])  # warm-up
    clock = ForwardClock(model, list(engine.eos_token_ids))

    def population():
        clock.reset()
        started = time.process_time()
        members = generate_population(engine, prompts, seeds, args.sigma, mini_batch_size=per_call)
        return time.process_time() - started, members

    def limit():
        clock.reset()
        started = time.process_time()
        tokens = sum(engine.generate(prompts * args.population, mini_batch_size=args.rows).num_tokens)
        return time.process_time() - started, tokens

    def replay(targets):
        clock.reset(targets)
        started = time.process_time()
        rows = [row for chunk in original(prompts, per_call, copies=args.population, on_rows=clock.on_rows) for row in chunk]
        return time.process_time() - started, rows

    original = engine.generated_chunks  # the population's and the limit's calls report their rows to the clock

    def reported(*a, on_rows=None, **k):
        def both(active, n):
            clock.on_rows(active, n)
            if on_rows is not None:
                on_rows(active, n)
        return original(*a, on_rows=both, **k)

    engine.generated_chunks = reported
    rounds = []
    for number in range(args.rounds):
        record = {"population": 0.0, "limit": 0.0, "replay": 0.0,
                  "phases": {side: dict.fromkeys(PHASES, 0.0) for side in ("population", "limit", "replay")}}
        for _ in range(args.repeats):  # the three alternate: a slow spell hits all of them alike
            pop_seconds, members = population()
            measured = [("population", pop_seconds, dict(clock.seconds))]
            forwards = {"population": clock.forwards}
            record["tokens"] = sum(sum(m.num_tokens) for m in members)
            targets = []  # each call's rows (member-major), the population's lengths
            for start in range(0, len(prompts), per_call):
                size = min(per_call, len(prompts) - start)
                targets.append(torch.tensor([m.num_tokens[start + p] for m in members for p in range(size)]))
            limit_seconds, record["limit_tokens"] = limit()
            measured.append(("limit", limit_seconds, dict(clock.seconds)))
            replay_seconds, replay_rows = replay(targets)
            measured.append(("replay", replay_seconds, dict(clock.seconds)))
            forwards["replay"] = clock.forwards
            record["forwards"] = forwards  # the same steps: the replay ran the population's schedule
            if [len(row) for row in replay_rows] != [int(n) for call in targets for n in call]:
                raise SystemExit("the replay did not follow the population's lengths")
            for side, seconds, phases in measured:
                phases["rest"] = seconds - sum(phases.values())
                record[side] += seconds
                for phase, value in phases.items():
                    record["phases"][side][phase] += value
        rounds.append(record)
        print(f"round {number + 1}/{args.rounds}: population {record['population']:.2f} s, limit {record['limit']:.2f} s, "
              f"replay {record['replay']:.2f} s over {args.repeats} repeats ({load_average()})", flush=True)

    def ratio(of):
        return ratio_summary([of(r) for r in rounds])

    total = ratio(lambda r: (r["tokens"] / r["population"]) / (r["limit_tokens"] / r["limit"]))  # same repeats
    hooks = ratio(lambda r: r["replay"] / r["population"])
    lengths = ratio(lambda r: (r["tokens"] / r["replay"]) / (r["limit_tokens"] / r["limit"]))
    print(f"\nmodel: {description}; population {args.population} × {args.batch} prompts, {args.rows} rows per call, "
          f"up to {args.max_tokens} tokens; {allocator}")
    print(f"population tokens {rounds[0]['tokens']:,}, limit tokens {rounds[0]['limit_tokens']:,} (natural lengths)")
    print(f"population / limit (tokens per CPU-second): {format_ratio(total, percent=True)}")
    print(f"  = hooks (replay seconds / population seconds): {format_ratio(hooks, percent=True)}")
    print(f"  × lengths (replay / limit, tokens per CPU-second): {format_ratio(lengths, percent=True)}")
    print(f"\nmedian CPU seconds per phase (one generation: a round's sum over its {args.repeats} repeats / {args.repeats}) "
          "| population | replay | limit | population − replay")
    for phase in PHASES:
        values = {side: statistics.median(r["phases"][side][phase] for r in rounds) / args.repeats
                  for side in ("population", "replay", "limit")}
        print(f"  {phase:<11} | {values['population']:.3f} | {values['replay']:.3f} | {values['limit']:.3f} | "
              f"{values['population'] - values['replay']:+.3f}")
    print(f"\nmachine: {cpu_description()}, torch {torch.__version__}, {load_average()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "population/limit": total,
                                               "hooks": hooks, "lengths": lengths}, indent=1))


if __name__ == "__main__":
    main()
