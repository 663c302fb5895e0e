"""The fields of ESConfig, one documented field each, in the sections of `esft train --help`
(esft.settings.config adds the GRPO (TRL) section, the defaults' post-processing and validation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from esft.engines.registry import ENGINES
from esft.es.fitness import FAILED_SAMPLES
from esft.es.shaping import REWARD_SHAPING
from esft.settings.rules import EMBEDDED_MODEL

GROUPS = ("model and engine", "ES", "data", "rewards", "evaluation", "logging and checkpoints", "scale-out",
          "algorithm and budget", "RandOpt", "GRPO (TRL)")  # RandOpt's fields: esft.settings.randopt
"""The sections of ESConfig (and of `esft train --help`), in order."""


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
class RunFields:
    """Every setting but TRL's GRPO ones (esft.settings.config.ESConfig adds those); documented in ESConfig."""

    # ---- model and engine
    model: str = _in(
        "model and engine",
        f"Hugging Face hub id or local directory of a causal LM, or a .gguf file (dequantized to float32 once, "
        f"into esft's cache; needs esft[gguf]); '{EMBEDDED_MODEL}' is the tiny Countdown model shipped inside esft.",
        default=EMBEDDED_MODEL,
    )
    dtype: str = _in("model and engine", "Model weights dtype: float32, bfloat16 or float16.", default="float32")
    device: str = _in("model and engine", "cpu, cuda, cuda:N or auto (CUDA if available).", default="auto")
    trainable: str | None = _in(
        "model and engine",
        "Regular expression; ES perturbs and updates only parameters whose name matches "
        "(re.search). Default: all parameters.",
        default=None,
    )
    max_tokens: int = _in("model and engine", "Most new tokens generated per completion.", default=64)
    mini_batch_size: int | str | None = _in(
        "model and engine",
        "Prompts per generate call: memory and speed only, results are identical. auto: about 1024 rows per "
        "call on CPU (the fastest measured; population batching brings one row per member and prompt), as "
        "many as fit in half the free memory on a GPU (esft.engines.sizing); a number; or unset for the whole "
        "batch in one call.",
        algorithms=ES_MEMBERS, default="auto",
    )
    engine: str = _in(
        "model and engine",
        "Generation engine: " + "; ".join(f"{name} ({spec.summary})" for name, spec in ENGINES.items()) + ".",
        algorithms=ES_MEMBERS, default="transformers",
    )
    lora_r: int = _in(
        "model and engine",
        "LoRA-ES: rank r of a PEFT LoRA adapter on --lora-target-modules; ES perturbs and updates only the "
        "adapter's tensors (the base weights stay untouched) and saves it as a PEFT adapter (final/) and "
        "merged into the model (final-merged/). 0 = off: full-parameter ES. Needs peft (esft[lora]).",
        default=0,
    )
    lora_alpha: float | None = _in(
        "model and engine",
        "LoRA scaling numerator: the adapter adds (lora_alpha/r)·B·A·x. Default: 2·r (the reference's r=16, 32).",
        default=None,
    )
    lora_target_modules: str | None = _in(
        "model and engine",
        "Modules the adapter covers: comma-separated module names (e.g. q_proj,v_proj) or all-linear (every "
        "linear layer of attention and MLP, not the LM head: PEFT's all-linear). Default: all-linear.",
        default=None,
    )
    lora_dropout: float = _in(
        "model and engine",
        "Must be 0: ES uses no gradients, and dropout in rollouts would only add noise to the rewards.",
        default=0.0,
    )
    lora_adapter: str | None = _in(
        "model and engine",
        "A PEFT LoRA adapter directory to start from, on --model (its rank, scaling and target modules are "
        "the adapter's own); with esft eval, the adapter to evaluate.",
        default=None,
    )
    tensor_parallel_size: int = _in("model and engine", "vLLM: GPUs (tensor-parallel ranks) per engine.", default=1)
    gpu_memory_utilization: float = _in(
        "model and engine",
        "vLLM: fraction of each GPU's memory the engine may take (weights + KV cache).", default=0.9
    )
    max_model_len: int | None = _in(
        "model and engine",
        "vLLM: longest sequence (prompt + completion) in tokens. Default: the model's own limit.",
        default=None,
    )
    vllm_cpu_gemm: str = _in(
        "model and engine",
        "vLLM on CPU only: plain (torch linear on the live weights) or repack (pack linear weights "
        "again for oneDNN after each weight change). Same results; speed: docs/benchmarks.md.",
        default="plain",
    )

    # ---- ES
    population_size: int = _in("ES", "N, perturbed members per iteration.", algorithms=ES_MEMBERS, default=30)
    sigma: float = _in("ES", "σ, the noise scale of member perturbations θ + σ·ε.", algorithms=ES_MEMBERS, default=1e-3)
    alpha: float | None = _in(
        "ES",
        "α, the step: θ += (α/N)·Σ zᵢ·εᵢ (not divided by σ, as in the paper). Default: σ/2.",
        algorithms=ES_UPDATE, default=None,
    )
    iterations: int = _in("ES", "ES iterations (updates); 0 = evaluate only. Under --algorithm grpo: optimizer "
                          "steps (TRL's max_steps).", default=20)
    batch_size: int = _in("ES", "Prompts per iteration, the same batch for every member.", algorithms=ES_UPDATE, default=32)
    noise: str = _in(
        "ES",
        "Noise scheme: iid (tensor k seeded from member seed + k), correlated (every tensor "
        "seeded alike, the paper's original scheme) or lowrank (EGGROLL-style: each matrix gets "
        "A·Bᵀ/√r of rank --rank, A and B seeded as iid; norms and biases stay frozen).",
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
    reward_shaping: str = _in(
        "ES",
        "Fitness shaping of member rewards (reward is maximized): "
        + "; ".join(f"{name}: {shaping.summary}" for name, shaping in REWARD_SHAPING.items())
        + ". per_prompt z-scores each prompt's rewards over the members, then averages per member: a prompt every "
        "member scores alike counts 0; samples a reward function failed on are left out of their prompt "
        "(--failed-samples).",
        algorithms=ES_UPDATE, default="zscore",
    )
    seed: int = _in("ES", "Run seed: member seeds and prompt batches derive from it and the iteration.", default=0)

    # ---- data
    task: str = _in(
        "data",
        "Task: countdown, arithmetic, times-table, conciseness, math, or your own as module:function or path/to/file.py:function "
        "(a function returning an esft Task). --reward-funcs implies a custom task.",
        default="countdown",
    )
    train_data: str | None = _in(
        "data",
        "Training data: a .json/.jsonl/.csv/.parquet file, a save_to_disk Dataset(Dict) directory, or a "
        "dataset name in the local Hugging Face cache; rows need a prompt column (text or chat messages). "
        "Countdown default: problems generated from --seed.",
        default=None,
    )
    eval_data: str | None = _in(
        "data",
        "Evaluation data (same formats as --train-data); every split is reported separately. Countdown "
        "default: --eval-size generated held-out problems never used for training.",
        default=None,
    )
    difficulty: str = _in("data", "Countdown generator setting: easy, medium or paper.", default="easy")
    prompt_format: str = _in(
        "data",
        "How a built-in task (countdown, arithmetic, times-table, conciseness) asks its question: raw (its plain text: Countdown's "
        "is the paper's prompt), chat (the question in a user turn of the tokenizer's chat template; Countdown's reply "
        "continued from 'Let me solve this step by step.\n<think>'), or auto: chat when the tokenizer has a chat "
        "template, else raw (said in one line). Your own data keeps its prompts.", default="auto")
    train_size: int = _in("data", "Generated training problems (when --train-data is not given).", default=1000)
    eval_size: int | None = _in(
        "data",
        "Evaluation rows per split: the first N rows of every eval split of --eval-data (after --eval-rows), "
        "or the number of generated held-out problems when --eval-data is not given. Default: every row of "
        "--eval-data; 500 generated problems.",
        default=None,
    )

    # ---- rewards
    reward_funcs: str | None = _in(
        "rewards",
        "Reward functions for a task made of --train-data/--eval-data alone: module:function or "
        "path/to/file.py:function, comma-separated; TRL's signature f(prompts, completions, **columns).",
        default=None,
    )
    reward_model: str | None = _in(
        "rewards",
        "Reward models scoring prompt + completion (TRL's rule: chat data through the reward model's chat "
        "template): local directories or hub ids of sequence-classification models with one output, "
        "comma-separated or the flag repeated. Loaded in the trainer process; like --reward-funcs, a task "
        "from --train-data/--eval-data (README: Reward models).",
        default=None, repeatable=True,
    )
    reward_url: str | None = _in(
        "rewards",
        "Reward services (esft serve-reward, POST /score) as reward functions: base URLs such as "
        "http://127.0.0.1:8000, comma-separated or the flag repeated; 'URL1|URL2' is one service behind "
        "several replicas (load-balanced). API key: $ESFT_REWARD_API_KEY. Like --reward-funcs, a task from "
        "--train-data/--eval-data.",
        default=None, repeatable=True,
    )
    reward_model_device: str = _in("rewards", "Device of the --reward-model models: auto (CUDA if available), cpu, "
                                   "cuda or cuda:N.", default="auto")
    reward_weights: str | None = _in(
        "rewards",
        "Comma-separated weights of the rewards in the summed reward, in this order: --reward-funcs, then "
        "--reward-model, then --reward-url; e.g. 1,0.5. Default: all 1.",
        default=None,
    )
    reward_sandbox: bool = _in(
        "rewards",
        "Run user reward functions in sandbox worker processes (timeout, memory cap, crash isolation); "
        "functions that cannot be imported by name (a script's, a notebook's, lambdas, closures) are sent "
        "by value with cloudpickle. Built-in task rewards always run in-process. A reward function that fails "
        "on every sample of an iteration stops the run (exit 2; a checkpoint to --resume from is written "
        "first), unless --reward-skip-failing names it.",
        default=True,
    )
    reward_timeout: float = _in(
        "rewards",
        "Seconds a sandboxed reward call (one function on one member's batch) may take; then its worker "
        "is killed and the batch gets --failure-reward.",
        default=10.0,
    )
    reward_memory_mb: int = _in(
        "rewards",
        "Address-space cap (RLIMIT_AS, MiB) of each reward worker process; 0 = no cap.", default=4096
    )
    reward_workers: int = _in("rewards", "Sandbox worker processes (reward functions of a batch run in parallel).", default=2)
    failure_reward: float = _in(
        "rewards",
        "Reward of a sample whose reward function failed (raised, timed out, crashed, returned NaN/inf or a "
        "non-number): its value in rewards/<fn>/mean, evaluations, GRPO, and ES updates under --failed-samples "
        "fill; also the reward of a member none of whose samples was scored (all None).", default=0.0)
    failed_samples: str = _in(
        "rewards",
        "ES: what a sample a reward function failed on counts in the update. "
        + "; ".join(f"{name}: {meaning}" for name, meaning in FAILED_SAMPLES.items())
        + ". omit kept the update closer to the failure-free one in all cases measured but one, right/wrong "
        "rewards failing mostly on wrong answers (docs/benchmarks.md).", algorithms=ES_MEMBERS, default="omit")

    # ---- evaluation
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

    # ---- logging and checkpoints
    output_dir: str = _in("logging and checkpoints", "Directory that holds run directories.", default="runs")
    run_name: str | None = _in(
        "logging and checkpoints",
        "Run directory name under --output-dir (refused if it already holds a run or another esft process "
        "uses it). Default: <task>-s<seed>-<time>-<random>, unique.", default=None
    )
    logging: str = _in("logging and checkpoints", "Metrics sink besides metrics.jsonl: tensorboard, wandb or none.", default="tensorboard")
    save_every: int = _in("logging and checkpoints", "Write checkpoint-<N>/ every this many iterations (0 = never).", default=10)
    save_total_limit: int | None = _in("logging and checkpoints", "Keep at most this many checkpoints (oldest deleted).", default=None)
    resume: str | None = _in(
        "logging and checkpoints",
        "Resume from a checkpoint-<N> directory, or from the newest checkpoint of a run directory whose "
        "files match their recorded digests (a run without a checkpoint starts again). What the run did "
        "after that iteration is moved to <run>/superseded-<time>/.",
        default=None,
    )
    progress: bool = _in("logging and checkpoints", "Show a progress bar.", default=True)

    # ---- scale-out
    executor: str = _in(
        "scale-out",
        "Where members are evaluated: local (this process, one engine) or ray (--workers Ray actors, "
        "one engine each; install esft[ray]).",
        algorithms=ES_MEMBERS, default="local",
    )
    workers: int = _in("scale-out", "Ray: number of actors, each hosting one engine.", default=1)
    ray_address: str | None = _in(
        "scale-out",
        "Ray: address of an existing cluster to join (e.g. auto, or ray://head:10001). "
        "Default: start a local Ray instance (a new one, also where `ray start` runs a cluster on this machine).",
        default=None,
    )
    ray_cpus_per_worker: float = _in("scale-out", "Ray: CPUs reserved per actor (also its torch thread count).", default=1.0)
    ray_gpus_per_worker: float = _in(
        "scale-out",
        "Ray: GPUs reserved per actor (for vLLM: --tensor-parallel-size). Default 0.", default=0.0
    )

    # ---- algorithm and budget (README "GRPO baseline")
    algorithm: str = _in("algorithm and budget", "es (Evolution Strategies: this package's loop), grpo (TRL's GRPOTrainer on the same model, task, reward "
        "sandbox, evaluation, run directory and metrics; pip install 'esft[grpo]'; settings: 'GRPO (TRL)') or "
        "randopt (N perturbations scored once on a validation split, the best K voting; settings: 'RandOpt').",
        default="es",
    )
    budget_completions: int | None = _in(
        "algorithm and budget",
        "Stop training once this many completions were generated for training (evaluation excluded; "
        "budget/completions in metrics.jsonl); the final evaluation and final/ still happen. Default: no limit.",
        default=None,
    )
    budget_tokens: int | None = _in(
        "algorithm and budget",
        "Stop training once this many tokens were generated for training (evaluation excluded; budget/tokens); "
        "the final evaluation and final/ still happen. Default: no limit.",
        default=None,
    )

    # ---- issue 21: the vLLM population as LoRA adapters (esft.engines.vllm_adapters)
    vllm_max_loras: int | None = _in(
        "model and engine",
        "vLLM with --noise lowrank: every member of an iteration is a LoRA adapter of one engine and all "
        "members x prompts go to ONE generate call; this many adapters run per scheduler step (vLLM's "
        "max_loras). Default: the population size (all members at once), at most 64. Full-rank noise: "
        "members run one at a time (each holds its own full weights).",
        default=None,
    )

    # ---- reward faults (issue 25): fields added after the sections above keep their order
    reward_url_deadline: float = _in(
        "rewards",
        "Seconds a --reward-url call keeps retrying a service that does not answer (refused connection, timeout, "
        "408/429/5xx), pausing 0.5 s, 1 s, 2 s, ... (at most 10 s) between tries: enough to ride out a restart. "
        "Then that call's samples fail, which stops the run (see --reward-skip-failing).",
        default=60.0,
    )
    reward_skip_failing: str | None = _in(
        "rewards",
        "Reward functions (names as in rewards/<name>/mean, e.g. remote:127.0.0.1:8000; comma-separated or "
        "repeated) that an iteration may train without when they fail on every sample of it; each such iteration "
        "says so. Default: any reward function that fails on every sample of an iteration stops the run before "
        "its update (exit 2; a checkpoint to --resume from is written first).",
        repeatable=True,
        default=None,
    )

    # ---- issue 26: what a run directory may hand on (README "Security")
    trust_run_code: bool = _in(
        "logging and checkpoints",
        "Take the code, data files and reward services a resumed run's or an evaluated checkpoint's settings "
        "name (--task module:function, --reward-funcs, --train-data, --eval-data, --reward-url) without naming "
        "them again, and say in one line what was taken. Without it, they are taken only when given on the "
        "command line or in --config; a directory is data, and its settings never import code, read your files "
        "or send them (and $ESFT_REWARD_API_KEY) to a service silently. Never inherited from a run's settings.",
        default=False,
    )

    # ---- issue 20: data slices, prompts from any column, other reward conventions (kept together here)
    train_rows: str | None = _in(
        "data",
        "Rows of the training data to train on, as a Python slice START:STOP (0-based, STOP excluded; e.g. "
        "0:200 for the paper's countdown.json, whose rows 200: are its evaluation set). Default: every row.",
        default=None,
    )
    eval_rows: str | None = _in(
        "data",
        "Rows of every eval split to evaluate on, as START:STOP (e.g. 200: with --eval-data countdown.json). "
        "Default: every row (see also --eval-size).",
        default=None,
    )
    prompt_column: str | None = _in(
        "data",
        "The column holding the prompt, for data without a 'prompt' column (e.g. context for ES-at-Scale's "
        "Countdown DatasetDicts, problem for its math ones): text, or chat messages. Data given with "
        "--reward-funcs/--reward-model/--reward-url or as ESTrainer datasets.",
        default=None,
    )
    prompt_template: str | None = _in(
        "data",
        "Build every row's prompt from its columns with this str.format template, e.g. 'Q: {problem}\\nA:' "
        "(\\n in a flag is a newline). Same data as --prompt-column, which it replaces.",
        default=None,
    )
    target_column: str | None = _in(
        "rewards",
        "The column passed as the target of per-sample reward functions: ES-at-Scale's reward(model_output, "
        "target) and verl's compute_score(data_source, solution_str, ground_truth, extra_info). Default: target, "
        "else answer, else ground_truth, else solution (the first column the data has).",
        default=None,
    )
