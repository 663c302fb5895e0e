"""Every setting of a run, defined once: the fields of `Fields` (ESConfig's, esft.settings.config), one documented
field each, ordered by concept in the sections of `esft train --help` (GROUPS), each saying which --algorithm it
applies to. Which settings belong to one algorithm (ES_ONLY, GRPO_ONLY, RANDOPT_OWN, RANDOPT_UNUSED) is derived
from them here; their validation is esft.settings.rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from esft.engines.registry import ENGINES
from esft.es.fitness import FAILED_SAMPLES
from esft.es.shaping import REWARD_SHAPING
from esft.es.step_rules import STEP_RULES
from esft.es.strategies import STRATEGIES

EMBEDDED_MODEL = "embedded"
"""--model's name for the tiny Countdown model shipped inside esft."""

GROUPS = ("model", "generation", "ES", "task and rewards", "evaluation", "run", "executor", "GRPO (TRL)", "RandOpt")
"""The sections of the settings (and of `esft train --help`), in order."""

ALGORITHMS = ("es", "grpo", "randopt")
"""--algorithm's choices. Every field says which of them it applies to (`algorithms`, in its metadata):
a setting changed for an algorithm it does not apply to is refused (esft.settings.rules), and
`esft report` shows it as n/a there; ES_ONLY, GRPO_ONLY, RANDOPT_OWN and RANDOPT_UNUSED are derived."""
ES_MEMBERS = ("es", "randopt")
"""Settings of ES's members (their noise, how they are evaluated and scored): RandOpt's members are ES's."""
ES_UPDATE = ("es",)
"""Settings of the ES update and its schedule: RandOpt has no update, GRPO its own optimizer."""
OWN = {"GRPO (TRL)": ("grpo",), "RandOpt": ("randopt",)}
"""The sections whose every field applies to one algorithm."""


def _in(group: str, text: str, repeatable: bool = False, algorithms: tuple[str, ...] | None = None, **kwargs) -> Any:
    """A documented field of a GROUPS section that applies to `algorithms` (default: its section's
    algorithm, else all); a `repeatable` flag may be given several times, its values joined with commas (esft.cli)."""
    assert group in GROUPS, group
    algorithms = algorithms or OWN.get(group, ALGORITHMS)
    assert set(algorithms) <= set(ALGORITHMS), algorithms
    return field(metadata={"help": text, "group": group, "repeatable": repeatable, "algorithms": algorithms}, **kwargs)


@dataclass
class Fields:
    """Every setting of a run (esft.settings.config.ESConfig adds the defaults' post-processing and validation);
    the comment above each section says what it holds."""

    # ---- model: the model and what of it ES trains (LoRA-ES: an adapter instead of every weight)
    model: str = _in(
        "model",
        f"Hugging Face hub id or local directory of a causal LM, or a .gguf file (dequantized to float32 once, "
        f"into esft's cache; needs esft[gguf]); '{EMBEDDED_MODEL}' is the tiny Countdown model shipped inside esft.",
        default=EMBEDDED_MODEL,
    )
    dtype: str = _in("model", "Model weights dtype: float32, bfloat16 or float16.", default="float32")
    master_weights: str = _in(
        "model",
        "Where the weights' truth lives (the transformers engine): float32 keeps a float32 master of every trainable "
        "tensor beside the model (4 bytes per parameter; the live weights are it rounded to nearest); none keeps "
        "only the weights themselves: a float32 model is then the same run bit for bit without the copy, a "
        "bfloat16/float16 one takes each update with seeded stochastic rounding (small steps survive on average, "
        "es/update_survival says how much; esft.es.rounding). auto: none for float32 weights, else float32 when "
        "the master fits in memory and none (said in one line) when it does not. vLLM keeps a float32 master.",
        algorithms=ES_MEMBERS, default="auto",
    )
    device: str = _in("model", "cpu, cuda, cuda:N or auto (CUDA if available).", default="auto")
    trainable: str | None = _in(
        "model",
        "Regular expression; ES perturbs and updates only parameters whose name matches "
        "(re.search). Default: all parameters.",
        default=None,
    )
    lora_r: int = _in(
        "model",
        "LoRA-ES: rank r of a PEFT LoRA adapter on --lora-target-modules; ES perturbs and updates only the "
        "adapter's tensors (the base weights stay untouched) and saves it as a PEFT adapter (final/) and "
        "merged into the model (final-merged/). 0 = off: full-parameter ES. Needs peft (esft[lora]).",
        default=0,
    )
    lora_alpha: float | None = _in(
        "model",
        "LoRA scaling numerator: the adapter adds (lora_alpha/r)·B·A·x. Default: 2·r (the reference's r=16, 32).",
        default=None,
    )
    lora_target_modules: str | None = _in(
        "model",
        "Modules the adapter covers: comma-separated module names (e.g. q_proj,v_proj) or all-linear (every "
        "linear layer of attention and MLP, not the LM head: PEFT's all-linear). Default: all-linear.",
        default=None,
    )
    lora_dropout: float = _in(
        "model",
        "Must be 0: ES uses no gradients, and dropout in rollouts would only add noise to the rewards.",
        default=0.0,
    )
    lora_adapter: str | None = _in(
        "model",
        "A PEFT LoRA adapter directory to start from, on --model (its rank, scaling and target modules are "
        "the adapter's own); with esft eval, the adapter to evaluate.",
        default=None,
    )

    # ---- generation: the engine that holds the weights and writes completions (vLLM's own settings last)
    engine: str = _in(
        "generation",
        "Generation engine: " + "; ".join(f"{name} ({spec.summary})" for name, spec in ENGINES.items()) + ".",
        algorithms=ES_MEMBERS, default="transformers",
    )
    max_tokens: int = _in("generation", "Most new tokens generated per completion.", default=64)
    mini_batch_size: int | str | None = _in(
        "generation",
        "Prompts per generate call: memory and speed only, results are identical. auto: about 1024 rows per "
        "call on CPU (the fastest measured; population batching brings one row per member and prompt), as "
        "many as fit in half the free memory on a GPU (esft.engines.sizing); a number; or unset for the whole "
        "batch in one call.",
        algorithms=ES_MEMBERS, default="auto",
    )
    tensor_parallel_size: int = _in("generation", "vLLM: GPUs (tensor-parallel ranks) per engine.", default=1)
    gpu_memory_utilization: float = _in(
        "generation",
        "vLLM: fraction of each GPU's memory the engine may take (weights + KV cache).", default=0.9
    )
    max_model_len: int | None = _in(
        "generation",
        "vLLM: longest sequence (prompt + completion) in tokens. Default: the model's own limit.",
        default=None,
    )
    vllm_cpu_gemm: str = _in(
        "generation",
        "vLLM on CPU only: plain (torch linear on the live weights) or repack (pack linear weights "
        "again for oneDNN after each weight change). Same results; speed: docs/benchmarks.md.",
        default="plain",
    )
    vllm_max_loras: int | None = _in(
        "generation",
        "vLLM with --noise lowrank: every member of an iteration is a LoRA adapter of one engine and all "
        "members x prompts go to ONE generate call; this many adapters run per scheduler step (vLLM's "
        "max_loras). Default: the population size (all members at once), at most 64. Full-rank noise: "
        "members run one at a time (each holds its own full weights).",
        default=None,
    )

    # ---- ES: the members (strategy, N, σ, noise, how they are evaluated), their fitness and the update
    strategy: str = _in(
        "ES", "The ES strategy, how members are asked for and their fitness becomes the update (esft.es.strategies): "
        + "; ".join(f"{name}: {strategy.summary}" for name, strategy in STRATEGIES.items()) + ".",
        algorithms=ES_MEMBERS, default="paper")
    antithetic: bool | None = _in(
        "ES", "The same as --strategy antithetic: the spelling of commands and configs written before --strategy "
        "(read, never written: a run's config.yaml records the strategy).", algorithms=ES_MEMBERS, default=None)
    population_size: int = _in("ES", "N, perturbed members per iteration.", algorithms=ES_MEMBERS, default=30)
    sigma: float | str = _in(
        "ES", "σ, the noise scale of member perturbations θ + σ·ε; or auto: before the first iteration, esft "
        "sigma-scan's ladder and rule with its default members and prompts (esft.loop.sigma_ladder) pick it on this "
        "run's model, data and reward, said in one line (α its default, see --alpha, unless given); a ladder with no usable σ "
        "stops the run with its verdict. config.yaml records the σ chosen.", algorithms=ES_MEMBERS, default=1e-3)
    noise: str = _in(
        "ES",
        "Noise scheme: iid (tensor k seeded from member seed + k), iid_matrices (iid on matrices only: norms and "
        "biases stay frozen), correlated (every tensor seeded alike, the paper's original scheme) or lowrank "
        "(EGGROLL-style: each matrix gets A·Bᵀ/√r of rank --rank, A and B seeded as iid; norms and biases stay "
        "frozen).",
        algorithms=ES_MEMBERS, default="iid",
    )
    rank: int = _in("ES", "Rank r of --noise lowrank perturbations σ·A·Bᵀ/√r.", algorithms=ES_MEMBERS, default=1)
    population_batching: bool | str = _in(
        "ES",
        "Evaluate members together in batched generate calls (the transformers engine; with --executor ray "
        "each actor batches an equal share). --noise lowrank: the unperturbed weights' matmuls are shared "
        "and each member's low-rank term is added to its rows. iid/correlated: each member's rows use its "
        "own weights, saving calls, not arithmetic: members per call are as many as bring ~1024 rows on CPU "
        "(from free memory on a GPU) with all prompts each and fit in a quarter of free memory; one per call "
        "when a member's prompts already fill a call. Same completions as one member at a time, faster. "
        "auto: on for the transformers engine when the model passes the batched path's check (else one "
        "member at a time, said in one line), and for --engine vllm with --noise lowrank or LoRA-ES (members "
        "as LoRA adapters); --population-batching insists (a model that fails is an "
        "error); --no-population-batching: one member at a time.",
        algorithms=ES_MEMBERS, default="auto",
    )
    rollout_temperature: float | None = _in(
        "ES", "Sampling temperature of training rollouts. ES: unset or 0 generates members' completions greedily "
        "(the paper); > 0 samples them with common random numbers: on a prompt every member draws the same sampling "
        "noise (seeded by the run seed, the iteration and the prompt's text: esft.engines.decoding.CommonNoise; on vLLM "
        "a per-request seed), so members' rewards differ only by their perturbations. GRPO: TRL's temperature, 1.0 "
        "when unset. --temperature stays the evaluation's, greedy by default, for both algorithms.",
        algorithms=("es", "grpo"), default=None)
    batch_size: int = _in("ES", "B, prompts per iteration (with --prompt-groups G: split into G slices of B/G).",
                          algorithms=ES_UPDATE, default=32)
    prompt_groups: int = _in(
        "ES", "G: the members in G equal groups and the batch in G equal slices, group g scored on slice g only "
        "(esft.es.groups): N·B/G completions per iteration, each prompt answered by N/G members, a member's fitness "
        "compared with its group's. 1: every member on every prompt (the paper). Shape fitness within the group "
        "with --reward-shaping per_prompt_centered (per_prompt needs every member on the same prompts); N and B "
        "must be multiples of G (N/G even for a mirrored strategy). Groups are evaluated one after another.",
        algorithms=ES_UPDATE, default=1)
    prompt_candidates: int = _in(
        "ES", "K: each iteration the unperturbed model answers K·B candidate prompts greedily (the next K·B rows of "
        "the shuffled train set) and --prompt-choice picks the batch's B by its rewards on them: prompts it already "
        "answers right teach little once it answers most. The K·B completions count in budget/completions and "
        "budget/tokens; metrics.jsonl's selection/candidate_reward and selection/batch_reward are the mean rewards "
        "of the candidates and of the batch. 1: the next B rows, unscreened (the paper).",
        algorithms=ES_UPDATE, default=1)
    prompt_choice: str = _in(
        "ES", "With --prompt-candidates K > 1, which B candidates are the batch (esft.es.batches.PROMPT_CHOICES): "
        "lowest, the B the model scores lowest; extremes, half of them (rounded up) the lowest and the rest the "
        "highest, so a batch always holds prompts it answers right, on which members that break the answer lose "
        "(where it misses most prompts, a batch of only missed ones often ties every member).",
        algorithms=ES_UPDATE, default="lowest")
    reward_shaping: str = _in(
        "ES",
        "Fitness shaping of member rewards (reward is maximized): "
        + "; ".join(f"{name}: {shaping.summary}" for name, shaping in REWARD_SHAPING.items())
        + ". per_prompt z-scores each prompt's rewards over the members, then averages per member: a prompt every "
        "member scores alike counts 0; samples a reward function failed on are left out of their prompt "
        "(--failed-samples).",
        algorithms=ES_UPDATE, default="zscore",
    )
    failed_samples: str = _in(
        "ES",
        "ES: what a sample a reward function failed on counts in the update. "
        + "; ".join(f"{name}: {meaning}" for name, meaning in FAILED_SAMPLES.items())
        + ". omit kept the update closer to the failure-free one in all cases measured but one, right/wrong "
        "rewards failing mostly on wrong answers (docs/benchmarks.md).", algorithms=ES_MEMBERS, default="omit")
    alpha: float | None = _in(
        "ES",
        "α, the step: θ += (α/N)·Σ zᵢ·εᵢ (not divided by σ, as in the paper; --step-rule sqrt_n: α/√N). Default: "
        "σ/2 (the paper's); under --step-rule sqrt_n σ/(2√8), the paper's default step at N = 8, at every N.",
        algorithms=ES_UPDATE, default=None,
    )
    step_rule: str = _in(
        "ES", "How the step divides by the population (esft.es.step_rules): "
        + "; ".join(f"{name}: {text}" for name, text in STEP_RULES.items()) + ". sgd only (adam normalizes its step).",
        algorithms=ES_UPDATE, default="paper")
    optimizer: str = _in(
        "ES", "How the ES gradient estimate g = (1/N)·Σ zᵢ·εᵢ moves the weights: sgd (the paper: θ += α·g) or adam "
        "(torch.optim.Adam's step on g with learning rate α, maximizing: θ += α·m̂/(√v̂ + --adam-eps); float32 moments "
        "beside the master, tensor by tensor: 8 extra bytes per trainable parameter, saved in checkpoints as "
        "optimizer/optimizer.safetensors). Typical --alpha for adam is far below the paper's (every weight moves by about α per "
        "step). With --noise lowrank adam steps on each matrix's dense update. Not for --algorithm grpo (TRL's AdamW).",
        algorithms=ES_UPDATE, default="sgd")
    adam_betas: str = _in("ES", "Adam's β₁,β₂ (two numbers in [0, 1), comma-separated); with --algorithm grpo, TRL's "
                          "adam_beta1, adam_beta2.", default="0.9,0.999")
    adam_eps: float = _in("ES", "Adam's ε, added to √v̂; with --algorithm grpo, TRL's adam_epsilon.", default=1e-8)
    weight_decay: float = _in(
        "ES", "Decoupled weight decay (AdamW-style): θ ← θ·(1 − α·wd) before each step, with either optimizer (sgd: "
        "then θ += α·g; adam: torch.optim.AdamW's step). 0: none (the paper). With --algorithm grpo, TRL's "
        "weight_decay.", algorithms=("es", "grpo"), default=0.0)
    sigma_schedule: str = _in(
        "ES", "σ per iteration: constant, or linear / cosine from --sigma down to a final fraction of it "
        "(e.g. cosine:0.1; default fraction 0.1), over --iterations. Logged as es/sigma.", algorithms=ES_UPDATE, default="constant")
    alpha_schedule: str = _in(
        "ES", "α per iteration, as --sigma-schedule (e.g. linear:0.0 decays to 0). Logged as es/alpha.",
        algorithms=ES_UPDATE, default="constant")

    # ---- task and rewards: the task, its data and the reward functions that score completions
    task: str = _in(
        "task and rewards",
        "Task: countdown, arithmetic, times-table, word-problems, conciseness, math, or your own as module:function or path/to/file.py:function "
        "(a function returning an esft Task). --reward-funcs implies a custom task.",
        default="countdown",
    )
    train_data: str | None = _in(
        "task and rewards",
        "Training data: a .json/.jsonl/.csv/.parquet file, a save_to_disk Dataset(Dict) directory, or a "
        "dataset name in the local Hugging Face cache; rows need a prompt column (text or chat messages). "
        "Countdown default: problems generated from --seed.",
        default=None,
    )
    eval_data: str | None = _in(
        "task and rewards",
        "Evaluation data (same formats as --train-data); every split is reported separately. Countdown "
        "default: --eval-size generated held-out problems never used for training.",
        default=None,
    )
    train_rows: str | None = _in(
        "task and rewards",
        "Rows of the training data to train on, as a Python slice START:STOP (0-based, STOP excluded; e.g. "
        "0:200 for the paper's countdown.json, whose rows 200: are its evaluation set). Default: every row.",
        default=None,
    )
    eval_rows: str | None = _in(
        "task and rewards",
        "Rows of every eval split to evaluate on, as START:STOP (e.g. 200: with --eval-data countdown.json). "
        "Default: every row (see also --eval-size).",
        default=None,
    )
    prompt_column: str | None = _in(
        "task and rewards",
        "The column holding the prompt, for data without a 'prompt' column (e.g. context for ES-at-Scale's "
        "Countdown DatasetDicts, problem for its math ones): text, or chat messages. Data given with "
        "--reward-funcs/--reward-model/--reward-url or as ESTrainer datasets.",
        default=None,
    )
    prompt_template: str | None = _in(
        "task and rewards",
        "Build every row's prompt from its columns with this str.format template, e.g. 'Q: {problem}\\nA:' "
        "(\\n in a flag is a newline). Same data as --prompt-column, which it replaces.",
        default=None,
    )
    prompt_format: str = _in(
        "task and rewards",
        "How a built-in task (countdown, arithmetic, times-table, word-problems, conciseness) asks its question: raw (its plain text: Countdown's "
        "is the paper's prompt), chat (the question in a user turn of the tokenizer's chat template; Countdown's reply "
        "continued from 'Let me solve this step by step.\n<think>'), or auto: chat when the tokenizer has a chat "
        "template, else raw (said in one line). Your own data keeps its prompts.", default="auto")
    difficulty: str = _in("task and rewards", "Countdown generator setting: easy, medium or paper.", default="easy")
    train_size: int = _in("task and rewards", "Generated training problems (when --train-data is not given).", default=1000)
    reward_funcs: str | None = _in(
        "task and rewards",
        "Reward functions for a task made of --train-data/--eval-data alone: module:function or "
        "path/to/file.py:function, comma-separated; TRL's signature f(prompts, completions, **columns).",
        default=None,
    )
    reward_model: str | None = _in(
        "task and rewards",
        "Reward models scoring prompt + completion (TRL's rule: chat data through the reward model's chat "
        "template): local directories or hub ids of sequence-classification models with one output, "
        "comma-separated or the flag repeated. Loaded in the trainer process; like --reward-funcs, a task "
        "from --train-data/--eval-data (README: Reward models).",
        default=None, repeatable=True,
    )
    reward_url: str | None = _in(
        "task and rewards",
        "Reward services (esft serve-reward, POST /score) as reward functions: base URLs such as "
        "http://127.0.0.1:8000, comma-separated or the flag repeated; 'URL1|URL2' is one service behind "
        "several replicas (load-balanced). API key: $ESFT_REWARD_API_KEY. Like --reward-funcs, a task from "
        "--train-data/--eval-data.",
        default=None, repeatable=True,
    )
    reward_weights: str | None = _in(
        "task and rewards",
        "Comma-separated weights of the rewards in the summed reward, in this order: --reward-funcs, then "
        "--reward-model, then --reward-url; e.g. 1,0.5. Default: all 1.",
        default=None,
    )
    target_column: str | None = _in(
        "task and rewards",
        "The column passed as the target of per-sample reward functions: ES-at-Scale's reward(model_output, "
        "target) and verl's compute_score(data_source, solution_str, ground_truth, extra_info). Default: target, "
        "else answer, else ground_truth, else solution (the first column the data has).",
        default=None,
    )
    reward_model_device: str = _in("task and rewards", "Device of the --reward-model models: auto (CUDA if available), cpu, "
                                   "cuda or cuda:N.", default="auto")
    reward_sandbox: bool = _in(
        "task and rewards",
        "Run user reward functions in sandbox worker processes (timeout, memory cap, crash isolation); "
        "functions that cannot be imported by name (a script's, a notebook's, lambdas, closures) are sent "
        "by value with cloudpickle. Built-in task rewards always run in-process. A reward function that fails "
        "on every sample of an iteration stops the run (exit 2; a checkpoint to --resume from is written "
        "first), unless --reward-skip-failing names it.",
        default=True,
    )
    reward_timeout: float = _in(
        "task and rewards",
        "Seconds a sandboxed reward call (one function on one member's batch) may take; then its worker "
        "is killed and the batch gets --failure-reward.",
        default=10.0,
    )
    reward_memory_mb: int = _in(
        "task and rewards",
        "Address-space cap (RLIMIT_AS, MiB) of each reward worker process; 0 = no cap.", default=4096
    )
    reward_workers: int = _in("task and rewards", "Sandbox worker processes (reward functions of a batch run in parallel).", default=2)
    reward_url_deadline: float = _in(
        "task and rewards",
        "Seconds a --reward-url call keeps retrying a service that does not answer (refused connection, timeout, "
        "408/429/5xx), pausing 0.5 s, 1 s, 2 s, ... (at most 10 s) between tries: enough to ride out a restart. "
        "Then that call's samples fail, which stops the run (see --reward-skip-failing).",
        default=60.0,
    )
    reward_skip_failing: str | None = _in(
        "task and rewards",
        "Reward functions (names as in rewards/<name>/mean, e.g. remote:127.0.0.1:8000; comma-separated or "
        "repeated) that an iteration may train without when they fail on every sample of it; each such iteration "
        "says so. Default: any reward function that fails on every sample of an iteration stops the run before "
        "its update (exit 2; a checkpoint to --resume from is written first).",
        repeatable=True,
        default=None,
    )
    failure_reward: float = _in(
        "task and rewards",
        "Reward of a sample whose reward function failed (raised, timed out, crashed, returned NaN/inf or a "
        "non-number): its value in rewards/<fn>/mean, evaluations, GRPO, and ES updates under --failed-samples "
        "fill; also the reward of a member none of whose samples was scored (all None).", default=0.0)

    # ---- evaluation: held-out evaluation: how many rows, how often, how sampled
    eval_size: int | None = _in(
        "evaluation",
        "Evaluation rows per split: the first N rows of every eval split of --eval-data (after --eval-rows), "
        "or the number of generated held-out problems when --eval-data is not given. Default: every row of "
        "--eval-data; 500 generated problems.",
        default=None,
    )
    eval_every: int = _in(
        "evaluation",
        "Evaluate every this many iterations (0 = only before training and at the end).", algorithms=("es", "grpo"), default=0
    )
    eval_batch_size: int = _in("evaluation", "Prompts per generate call during evaluation.", default=128)
    eval_samples: int = _in(
        "evaluation",
        "Completions sampled per eval prompt (K): reports pass@k (unbiased estimator) and mean@K; needs "
        "--temperature > 0 when K > 1.",
        default=1,
    )
    temperature: float = _in("evaluation", "Evaluation sampling temperature, both algorithms; 0 = greedy (the paper's "
                             "default). GRPO's rollouts: --rollout-temperature.", default=0.0)
    top_p: float = _in("evaluation", "Evaluation nucleus-sampling top-p (with --temperature > 0).", default=1.0)
    base_model: str | None = _in(
        "evaluation",
        "Reference model of the KL(fine-tuned || base) that tasks such as conciseness report, loaded on "
        "the model's device in its dtype. Default: --model itself (during training: the weights before training).",
        default=None,
    )

    # ---- run: the algorithm, its length and budget, the run directory, its logs, checkpoints and resume
    algorithm: str = _in("run", "es (Evolution Strategies: this package's loop), grpo (TRL's GRPOTrainer on the same model, task, reward "
        "sandbox, evaluation, run directory and metrics; pip install 'esft[grpo]'; settings: 'GRPO (TRL)') or "
        "randopt (N perturbations scored once on a validation split, the best K voting; settings: 'RandOpt').",
        default="es",
    )
    iterations: int = _in("run", "ES iterations (updates); 0 = evaluate only. Under --algorithm grpo: optimizer "
                          "steps (TRL's max_steps).", default=20)
    seed: int = _in("run", "Run seed: member seeds and prompt batches derive from it and the iteration.", default=0)
    budget_completions: int | None = _in(
        "run",
        "Stop training once this many completions were generated for training (evaluation excluded; "
        "budget/completions in metrics.jsonl); the final evaluation and final/ still happen. Default: no limit.",
        default=None,
    )
    budget_tokens: int | None = _in(
        "run",
        "Stop training once this many tokens were generated for training (evaluation excluded; budget/tokens); "
        "the final evaluation and final/ still happen. Default: no limit.",
        default=None,
    )
    output_dir: str = _in("run", "Directory that holds run directories.", default="runs")
    run_name: str | None = _in(
        "run",
        "Run directory name under --output-dir (refused if it already holds a run or another esft process "
        "uses it). Default: <task>-s<seed>-<time>-<random>, unique.", default=None
    )
    logging: str = _in("run", "Metrics sink besides metrics.jsonl: tensorboard, wandb or none.", default="tensorboard")
    save_every: int = _in("run", "Write checkpoint-<N>/ every this many iterations (0 = never).", default=10)
    save_total_limit: int | None = _in("run", "Keep at most this many checkpoints (oldest deleted).", default=None)
    resume: str | None = _in(
        "run",
        "Resume from a checkpoint-<N> directory, or from the newest checkpoint of a run directory whose "
        "files match their recorded digests (a run without a checkpoint starts again). What the run did "
        "after that iteration is moved to <run>/superseded-<time>/.",
        default=None,
    )
    trust_run_code: bool = _in(
        "run",
        "Take the code, data files and reward services a resumed run's or an evaluated checkpoint's settings "
        "name (--task module:function, --reward-funcs, --train-data, --eval-data, --reward-url) without naming "
        "them again, and say in one line what was taken. Without it, they are taken only when given on the "
        "command line or in --config; a directory is data, and its settings never import code, read your files "
        "or send them (and $ESFT_REWARD_API_KEY) to a service silently. Never inherited from a run's settings.",
        default=False,
    )
    progress: bool = _in("run", "Show a progress bar.", default=True)

    # ---- executor: where members are evaluated: this process or Ray actors
    executor: str = _in(
        "executor",
        "Where members are evaluated: local (this process, one engine) or ray (--workers Ray actors, "
        "one engine each; install esft[ray]).",
        algorithms=ES_MEMBERS, default="local",
    )
    workers: int = _in("executor", "Ray: number of actors, each hosting one engine.", default=1)
    ray_address: str | None = _in(
        "executor",
        "Ray: address of an existing cluster to join (e.g. auto, or ray://head:10001). "
        "Default: start a local Ray instance (a new one, also where `ray start` runs a cluster on this machine).",
        default=None,
    )
    ray_cpus_per_worker: float = _in("executor", "Ray: CPUs reserved per actor (also its torch thread count).", default=1.0)
    ray_gpus_per_worker: float = _in(
        "executor",
        "Ray: GPUs reserved per actor (for vLLM: --tensor-parallel-size). Default 0.", default=0.0
    )

    # ---- GRPO (TRL): --algorithm grpo: TRL's GRPOConfig names and defaults (README "GRPO baseline")
    learning_rate: float = _in("GRPO (TRL)", "AdamW's initial learning rate, decaying linearly to 0 over --iterations "
                               "(TRL's default schedule).", default=1e-6)
    num_generations: int = _in("GRPO (TRL)", "Completions sampled per prompt: the group whose rewards are normalised "
                               "into advantages.", default=8)
    per_device_train_batch_size: int = _in(
        "GRPO (TRL)", "Completions per micro-batch (prompts x --num-generations); times --gradient-accumulation-steps "
        "it must be a multiple of --num-generations.", default=8)
    gradient_accumulation_steps: int = _in("GRPO (TRL)", "Micro-batches per optimizer step.", default=1)
    beta: float = _in("GRPO (TRL)", "KL coefficient against the initial model (0: no reference model).", default=0.0)
    loss_type: str = _in("GRPO (TRL)", "grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo or vespo (TRL's loss "
                         "formulations).", default="dapo")
    scale_rewards: str = _in("GRPO (TRL)", "Advantage scaling: group (std within each prompt's group), batch or none.",
                             default="group")
    epsilon: float = _in("GRPO (TRL)", "Clipping range of the importance ratio.", default=0.2)
    num_iterations: int = _in("GRPO (TRL)", "TRL's mu: optimizer steps on each generation batch (not --iterations, "
                              "which counts all optimizer steps).", default=1)
    max_grad_norm: float = _in("GRPO (TRL)", "Gradient clipping norm.", default=1.0)
    gradient_checkpointing: bool = _in("GRPO (TRL)", "Recompute activations in the backward pass: less memory, "
                                       "slower (TRL's default; --no-gradient-checkpointing for small models).",
                                       default=True)

    # ---- RandOpt: --algorithm randopt: N members scored once, the best K kept
    randopt_top_k: int = _in(
        "RandOpt", "K: the members with the best validation reward that are kept; held-out answers are their "
        "majority vote (where the task extracts an answer: countdown, arithmetic, times-table, math), else the best member's. Must be "
        "<= --population-size. Neural Thickets (arXiv 2603.12228) keep K = 5 to 10. `esft eval --model RUN_DIR "
        "--randopt-top-k K` votes with the best K of that run's scored members (nothing is scored again).", default=5)
    validation_size: int = _in(
        "RandOpt", "Training rows drawn once (seeded by --seed) as the validation split that scores every member "
        "(greedy, one completion per row) and gates the consolidation: N members cost N x this many completions.",
        default=64)
    randopt_consolidate: bool = _in(
        "RandOpt", "Fold the K kept perturbations into one model, θ + σ·Σ wᵢ·εᵢ with softmax weights of the "
        "members' z-scored validation rewards (CoRP, arXiv 2605.31494), exported as final/ if it beats the base "
        "model on the validation split; else (or --no-randopt-consolidate) final/ is the best single member.",
        default=True)


def applies(f: dataclasses.Field, algorithm: str) -> bool:
    """Whether field `f` applies to --algorithm `algorithm` (its metadata's `algorithms`)."""
    return algorithm in f.metadata.get("algorithms", (algorithm,))


def only_for(*algorithms: str) -> tuple[str, ...]:
    """The settings that apply to exactly these algorithms."""
    return tuple(f.name for f in dataclasses.fields(Fields) if set(f.metadata["algorithms"]) == set(algorithms))


DEFAULTS = {f.name: f.default for f in dataclasses.fields(Fields)}
"""Every setting's default (α's, None, follows σ in ESConfig: esft.es.step_rules.default_alpha)."""
ES_ONLY = tuple(f.name for f in dataclasses.fields(Fields) if applies(f, "es") and not applies(f, "grpo"))
"""Settings of the ES loop (its members and its update) that --algorithm grpo has no use for: refused there."""
GRPO_ONLY = only_for("grpo")
"""The "GRPO (TRL)" settings (TRL's names), meaningless to --algorithm es and randopt."""
RANDOPT_OWN = only_for("randopt")
"""The settings only --algorithm randopt uses."""
RANDOPT_UNUSED = only_for("es") + only_for("es", "grpo")
"""ES settings of the update and its schedule, which RandOpt (no update) has no use for: refused, not ignored."""
