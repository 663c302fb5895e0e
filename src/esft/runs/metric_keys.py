"""What every key of metrics.jsonl (and TensorBoard / W&B, the same scalars at step `iteration`) means:
the source of the metrics reference page (docs/gen_reference.py), and checked against what the code
writes (tests/test_docs.py: a key a run writes without an entry here fails)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    """The key; `<split>`, `<function>`, `<label>`, `<k>` stand for one path segment each."""
    meaning: str
    """What it measures."""
    over: str
    """What it is taken over (members, samples, prompts) or summed over."""
    when: str
    """In which rows it appears."""

    def matches(self, key: str) -> bool:
        pattern = re.escape(self.key)
        pattern = re.sub(r"<k>", r"[0-9]+", pattern)
        pattern = re.sub(r"<(split|function|label)>", r"[^/]+", pattern)
        return re.fullmatch(pattern, key) is not None


TRAINING = "every training row, ES, GRPO and RandOpt (a row per chunk of scored members)"
ES_ROWS = "every ES training row"
GRPO_ROWS = "every GRPO training row (--algorithm grpo)"
RANDOPT_LAST = "the last row of an --algorithm randopt run"
EVALUATION = "rows with an evaluation: iteration 0, every --eval-every iterations, and the last"

METRICS: tuple[Metric, ...] = (
    Metric("iteration", "The iteration the row follows: 0 is the evaluation before training, N the row after the "
           "N-th update (TensorBoard's step).", "-", "every row"),
    # ---- training: the population's rewards
    Metric("reward/mean", "Mean reward. ES: of the members' rewards (a member's reward is the mean combined, weighted "
           "reward of its completions on the iteration's prompts, without those a reward function failed on unless "
           "--failed-samples fill); GRPO: of the generation batch's completions.",
           "ES: the N members; GRPO: completions", TRAINING),
    Metric("reward/std", "Standard deviation of the same rewards. 0 means every member tied: the z-scored update is "
           "zero and the weights did not move (docs: Your model, choosing σ and α).", "ES: the N members; GRPO: completions",
           TRAINING),
    Metric("reward/min", "Lowest of the same rewards.", "ES: the N members; GRPO: completions", TRAINING),
    Metric("reward/max", "Highest of the same rewards (the progress bar's `max`).", "ES: the N members; GRPO: completions",
           TRAINING),
    Metric("reward/failures", "(function, sample) values that a reward function failed to give and that took "
           "--failure-reward instead: reward/errors + reward/timeouts.", "summed over the iteration's samples and "
           "functions", TRAINING),
    Metric("reward/errors", "Reward values lost to an exception (or an invalid value) in a reward function.",
           "summed over the iteration's samples and functions", TRAINING),
    Metric("reward/timeouts", "Reward values lost to a reward call that ran past --reward-timeout.",
           "summed over the iteration's samples and functions", TRAINING),
    Metric("rewards/<function>/mean", "Mean of one reward function's own values (before --reward-weights), "
           "samples it did not score left out.", "the mean per member (ES) or batch (GRPO), then over them", TRAINING),
    Metric("rewards/<function>/failures", "Samples on which this reward function failed (error or timeout).",
           "summed over the iteration's samples", TRAINING),
    Metric("rewards/<function>/labels/<label>", "Completions that a reward function returning (label, reward) "
           "pairs labelled <label>.", "counted over the iteration's samples", "training rows where that label occurred"),
    # ---- training: generation and budget
    Metric("completions/mean_length", "Generated tokens per training completion.", "all completions of the "
           "iteration (every member's)", TRAINING),
    Metric("perf/iteration_s", "Wall-clock seconds of the iteration (generation, scoring, update).", "the iteration",
           TRAINING),
    Metric("perf/tokens_per_s", "Training tokens generated per second of the iteration (the progress bar's "
           "`tok_s`).", "the iteration", TRAINING),
    Metric("budget/completions", "Completions generated for training since the run began (--budget-completions "
           "stops at it; evaluations are not counted, --prompt-candidates' greedy answers to the candidates are).",
           "cumulative over the run, resumes included", TRAINING),
    Metric("budget/tokens", "Tokens generated for training since the run began (--budget-tokens stops at it; "
           "--prompt-candidates' included).", "cumulative over the run, resumes included", TRAINING),
    Metric("budget/seconds", "Training wall-clock seconds since the run began (evaluations excluded).",
           "cumulative over the run, resumes included", TRAINING),
    Metric("es/sigma", "σ of this iteration's perturbations (after --sigma-schedule).", "-", ES_ROWS),
    Metric("es/alpha", "α of this iteration's update (after --alpha-schedule; Adam's learning rate under "
           "--optimizer adam).", "-", ES_ROWS),
    Metric("es/tied", "1 when every member's update coefficient was zero (all members tied: the weights did not move "
           "by this iteration's rewards), else 0. The first tied iteration is said on stderr with its cause; "
           "the progress bar counts them (`tied`).", "the N members", ES_ROWS),
    Metric("es/distinct_completions", "How many different completions the members wrote for a prompt, averaged over "
           "the iteration's prompts: 1 means every member wrote the unperturbed model's text (σ too small for "
           "this model), N every member its own (N/G under --prompt-groups G).", "the batch's prompts (distinct "
           "over the members that answered each: all N, or a prompt's group)", ES_ROWS),
    Metric("es/update_ratio", "‖Δθ‖/‖θ‖ of the iteration's update over the trainable float32 master (0: the weights "
           "did not move).", "all trainable tensors", ES_ROWS + ", transformers and vLLM engines, in process or on Ray actors (not LoRA-ES on vLLM)"),
    Metric("es/update_survival", "How much of the iteration's float32 update the bfloat16/float16 weights took "
           "without a master (--master-weights none), ⟨Δθ written, Δθ⟩/‖Δθ‖²: 1 on average under stochastic "
           "rounding; near 0 would mean steps far below the weights' precision.", "all trainable tensors",
           ES_ROWS + ", the transformers engine without a master, low-precision weights"),
    Metric("selection/candidate_reward", "Mean reward of the unperturbed model's greedy answers to the iteration's "
           "K·B candidate prompts (--prompt-candidates K > 1).", "the candidates", ES_ROWS + " with --prompt-candidates"),
    Metric("selection/batch_reward", "The same mean over the B candidates --prompt-choice made the batch: below "
           "selection/candidate_reward when it picks the prompts the model misses.", "the batch's prompts",
           ES_ROWS + " with --prompt-candidates"),
    Metric("es/pairs_differ", "Fraction of ±σ pairs whose two rewards differ (a pair that ties adds nothing to "
           "the update).", "the N/2 pairs", ES_ROWS + " with --strategy antithetic"),
    # ---- training: GRPO (TRL's values for the step, as TRL logs them)
    Metric("grpo/loss", "TRL's GRPO loss of the optimizer step.", "the step's micro-batches", GRPO_ROWS),
    Metric("grpo/grad_norm", "Gradient norm before clipping (--max-grad-norm).", "the step", GRPO_ROWS),
    Metric("grpo/learning_rate", "AdamW's learning rate at the step (linear decay).", "-", GRPO_ROWS),
    Metric("grpo/kl", "TRL's KL to the reference model (logged by TRL when --beta > 0).", "the step's tokens",
           GRPO_ROWS + " with --beta > 0"),
    Metric("grpo/entropy", "Mean token entropy of the rollouts.", "the step's tokens", GRPO_ROWS),
    # ---- --algorithm randopt: a row per scored chunk of members (the ES keys above), then its selection
    Metric("randopt/kept", "K, the members kept (the best validation rewards) that vote on held-out answers.", "-",
           RANDOPT_LAST),
    Metric("randopt/best_validation", "Validation reward of the best member.", "the validation rows", RANDOPT_LAST),
    Metric("randopt/base_validation", "Validation reward of the base model (the consolidation's gate).",
           "the validation rows", RANDOPT_LAST + " with --randopt-consolidate"),
    Metric("randopt/consolidated_validation", "Validation reward of the consolidated model (the K kept "
           "perturbations folded into one).", "the validation rows", RANDOPT_LAST + " with --randopt-consolidate"),
    Metric("randopt/consolidated", "1 if final/ is the consolidated model (it beat the base on the validation rows), "
           "0 if it is the best single member.", "-", RANDOPT_LAST),
    # ---- evaluation, per eval split
    Metric("eval/<split>/reward", "Mean combined, weighted reward on the split (failed values count as "
           "--failure-reward).", "the split's samples (rows × --eval-samples)", EVALUATION),
    Metric("eval/<split>/mean_length", "Generated tokens per completion on the split.", "the split's samples",
           EVALUATION),
    Metric("eval/<split>/accuracy", "Mean of the task's accuracy function (built-in tasks: 1 for a correct answer, "
           "else 0): held-out accuracy.", "the split's samples", EVALUATION + ", tasks with an accuracy function"),
    Metric("eval/<split>/pass@<k>", "Unbiased pass@k: the chance that at least one of k of the K = --eval-samples "
           "completions of a row is correct (accuracy > 0.5), 1 − C(K−c, k)/C(K, k), for k = 1, 2, 4, … and K.",
           "the split's rows", EVALUATION + ", --eval-samples K > 1 and an accuracy function"),
    Metric("eval/<split>/mean@<k>", "The same as accuracy, named for its K samples per row.", "the split's samples",
           EVALUATION + ", --eval-samples K > 1 and an accuracy function"),
    Metric("eval/<split>/kl", "KL(current ‖ base) per generated token: the drift from the base model (--base-model, "
           "else the initial weights).", "the split's generated tokens",
           EVALUATION + ", tasks that report KL (conciseness), in-process transformers engine"),
    Metric("eval/<split>/rewards/<function>/labels/<label>", "Evaluation completions labelled <label> by a "
           "(label, reward) reward function.", "counted over the split's samples", EVALUATION),
)
"""Every key esft writes to metrics.jsonl. Values a reward function logs with TRL's `log_metric(name, value)`
are kept under the name it chose (averaged over the iteration's or split's samples; in evaluations as
`eval/<split>/<name>`): those names are the user's, documented in LOGGED_BY_REWARDS."""

SUMMARY: tuple[Metric, ...] = (
    Metric("reward/failures_total", "Reward values lost to failures (errors and timeouts) over the whole train() call; "
           "also printed at the end of the run.", "summed over every iteration's samples and functions",
           "train()'s result, when a reward function failed"),
    Metric("es/weights_moved", "1 if the weights at the end of train() differ from those it began with (master "
           "checksums), 0 if they never moved; 0 also marks the run's status and its report.", "the train() call",
           "train()'s result, ES runs that trained"),
    Metric("es/tied_iterations", "Iterations in which every member tied (no update by the rewards).",
           "the train() call", "train()'s result, ES runs that trained"),
    Metric("rewards/<function>/failures_total", "The same, for one reward function.", "summed over every iteration's "
           "samples", "train()'s result, when that function failed"),
)
"""Keys that ESTrainer.train() returns beside the last row's metrics (not written to metrics.jsonl)."""

LOGGED_BY_REWARDS = ("A reward function that calls TRL's `log_metric(name, value)` adds `name` to training rows "
                     "(its values averaged over the iteration) and `eval/<split>/name` to evaluation rows.")

PROGRESS_BAR = (
    ("reward", "reward/mean of the last iteration"),
    ("max", "reward/max of the last iteration"),
    ("tok_s", "perf/tokens_per_s of the last iteration"),
    ("tied", "iterations so far in which every member tied (no update; shown once there is one)"),
    ("waiting", "what the run waits for (a reward service that does not answer), while it waits"),
)
"""The fields of the training progress bar (stderr), after ES's or GRPO's iteration count."""


def entry_for(key: str) -> Metric | None:
    """The entry that documents `key`, None if there is none."""
    return next((metric for metric in METRICS if metric.matches(key)), None)
