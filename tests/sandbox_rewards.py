"""Reward functions that misbehave in every way the sandbox must survive (imported by workers).

Each one misbehaves only for completions containing "BAD", so a batch mixes good and bad samples;
good samples score len(completion).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time


def _good(completions):
    return [float(len(c)) for c in completions]


def length_reward(prompts, completions, **kwargs):
    return _good(completions)


def raises_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        raise RuntimeError("boom on a BAD completion")
    return _good(completions)


def hangs_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        time.sleep(3600)
    return _good(completions)


def busy_loops_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        while True:
            pass
    return _good(completions)


def exits_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        os._exit(3)
    return _good(completions)


def segfaults_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return _good(completions)


def hogs_memory_on_bad(prompts, completions, **kwargs):
    if any("BAD" in c for c in completions):
        hoard = []
        while True:  # 64 MiB at a time until the worker's RLIMIT_AS stops it
            hoard.append(bytearray(64 * 1024 * 1024))
    return _good(completions)


def non_numbers_on_bad(prompts, completions, **kwargs):
    return ["not a number" if "BAD" in c else float(len(c)) for c in completions]


def nan_and_none(prompts, completions, **kwargs):
    """NaN for "BAD", None (no score) for "SKIP", else the length."""
    return [float("nan") if "BAD" in c else None if "SKIP" in c else float(len(c)) for c in completions]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def pid_reward(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def misbehaves_on_prompt(prompts, completions, **kwargs):
    """Exits for a "CRASH" prompt, hangs for a "HANG" prompt, else len(prompt) + 2."""
    if any("CRASH" in p for p in prompts):
        os._exit(1)
    if any("HANG" in p for p in prompts):
        time.sleep(3600)
    return [float(len(p) + 2) for p in prompts]


# TRL-style reward functions (TRL's documented conventions: keyword call, completions only + **kwargs;
# conversational completions are [{"role": "assistant", "content": ...}]).
def trl_reward_len(completions, **kwargs):
    return [-abs(5 - len(completion)) for completion in completions]


def trl_conversational_format(completions, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if content.startswith("<think>") else 0.0 for content in contents]


def trl_uses_prompts_and_column(prompts, completions, solution, **kwargs):
    return [float(len(solution_) + len(prompt[-1]["content"] if isinstance(prompt, list) else prompt))
            for prompt, solution_ in zip(prompts, solution)]


def slow_grade(completion, golds):
    time.sleep(3600)


def token_count(completions, completion_ids, **kwargs):
    """TRL passes the generated token ids as `completion_ids`: one reward per token generated."""
    assert len(completion_ids) == len(completions)
    return [float(len(ids)) for ids in completion_ids]


def returns_nothing(prompts, completions, **kwargs):
    return []


def forks_then_scores(prompts, completions, **kwargs):
    """Calls os.fork(): two processes return from here. With a `pidfile` column the child writes its
    pid there and never returns (it must die with its worker's process group)."""
    pid = os.fork()
    if pid == 0 and kwargs.get("pidfile"):
        with open(kwargs["pidfile"][0], "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(3600)
    return _good(completions)


def kills_its_forkserver(prompts, completions, **kwargs):
    """SIGTERM to the worker's parent: the multiprocessing forkserver."""
    import signal

    os.kill(os.getppid(), signal.SIGTERM)
    return _good(completions)


def detaches_two_sleepers(prompts, completions, **kwargs):
    """A child that calls setsid itself, and a daemon-style one (setsid in a shell that exits at once).
    test_reward_containment's; here, so that its worker imports it in milliseconds rather than with the test
    module's torch and transformers (seconds, counted against the call's 5 s timeout)."""
    folder = os.environ["SLEEPER_DIR"]
    direct = subprocess.Popen(["setsid", "sleep", "120"])
    with open(os.path.join(folder, "pids"), "a") as handle:
        handle.write(f"{direct.pid}\n")
    subprocess.run(["sh", "-c", f"setsid sleep 120 & echo $! >> {folder}/pids"], check=True)
    if os.environ.get("SLEEPER_HANG"):
        time.sleep(60)
    return [1.0] * len(completions)
