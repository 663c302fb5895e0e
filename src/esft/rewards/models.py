"""Reward models as reward functions: a sequence-classification model with one logit scores
prompt + completion, as TRL's GRPOTrainer does when a reward function is a model id.

`RewardModel("path/or/hub-id")` is a TRL-style reward function (`__call__(prompts, completions,
**kwargs) -> list[float]`), trusted (it runs in the trainer process: a GPU model is loaded once, never
per sandbox worker). Text is built as TRL builds it: chat prompts (lists of messages) become
prompt + completion messages rendered with the reward model's own chat template (plain-text ChatML
when it has none); text prompts are concatenated with their completion. Texts are tokenized without
special tokens, right-padded, truncated from the left to the model's context (the end of a
completion is what it scores), and scored in batches of `batch_size`, similar lengths together.
`esft serve-reward` (esft.rewards.serve) serves the same scorer over HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from esft.chat import chatml, is_messages
from esft.engines.base import resolve_device, torch_dtype
from esft.rewards.values import TRUSTED_ATTRIBUTE
from esft.template_probe import TemplateProbeError, probe_chat_template

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?|mps"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
SAMPLE = ([{"role": "user", "content": "x"}], [{"role": "assistant", "content": "y"}])
"""The conversation the load renders through a reward model's chat template (bounded, then checked for tokens)."""


class RewardModelError(ValueError):
    """A reward model that cannot be loaded or is not a reward model; the message names it (its flag)."""


def device_problem(device: str) -> str | None:
    """Why `device` is not a device setting (None if it is one)."""
    if isinstance(device, str) and re.fullmatch(DEVICE_PATTERN, device):
        return None
    return f"must be auto, cpu, cuda or cuda:N; got {device!r}"


def reward_text(prompt: str | list, completion: str | list, tokenizer: Any) -> str:
    """The text a reward model scores for one sample (TRL's rule): messages prompt + completion through
    the tokenizer's chat template when either side is a conversation, else prompt + completion."""
    if not is_messages(prompt) and not is_messages(completion):
        return str(prompt) + str(completion)
    head = [dict(m) for m in prompt] if is_messages(prompt) else [{"role": "user", "content": str(prompt)}]
    tail = [dict(m) for m in completion] if is_messages(completion) else [{"role": "assistant", "content": str(completion)}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(head + tail, tokenize=False)
    return chatml(head + tail, add_generation_prompt=False)


class RewardModel:
    """A sequence-classification reward model (one logit) as a TRL-style reward function.

    The weights load on `load()` or the first call, on `device` ("auto": CUDA when available) in
    `dtype` ("auto": the checkpoint's dtype on a GPU, float32 on CPU). Pickling drops the loaded
    model: a copy sent to another process (a Ray actor) loads its own on first use."""

    def __init__(self, model: str, *, device: str = "auto", dtype: str = "auto", batch_size: int = 32,
                 name: str | None = None, where: str | None = None):
        self.model_id = str(model)
        self.device_name = device
        self.dtype_name = dtype
        self.batch_size = batch_size
        self.where = where or f"reward model {self.model_id!r}"
        """How errors name this model (e.g. the flag that gave it)."""
        if problem := device_problem(device):
            raise RewardModelError(f"{self.where}: device {problem}")
        if dtype not in DTYPE_NAMES:
            raise RewardModelError(f"{self.where}: dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
        self.__name__ = name or f"reward_model:{Path(self.model_id.rstrip('/')).name or self.model_id}"
        setattr(self, TRUSTED_ATTRIBUTE, True)
        self.model = self.tokenizer = self.max_length = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "model": None, "tokenizer": None}

    def load(self) -> RewardModel:
        """Load the tokenizer and weights (once); RewardModelError naming the model if it is no reward model."""
        if self.model is not None:
            return self
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # as the engines do: a run's own bar is the one that matters
        try:
            config = AutoConfig.from_pretrained(self.model_id)
            tokenizer = AutoTokenizer.from_pretrained(self.model_id)
        except (OSError, ValueError) as error:
            raise RewardModelError(f"{self.where}: cannot load it ({_first_line(error)}); give a local directory or a "
                            "hub id already in the local cache") from None
        architectures = getattr(config, "architectures", None) or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise RewardModelError(f"{self.where} is a {architectures[0]}, not a reward model: it needs a "
                            "*ForSequenceClassification model with a single output (num_labels=1)")
        if config.num_labels != 1:
            raise RewardModelError(f"{self.where} has {config.num_labels} outputs (num_labels); a reward model has one")
        if getattr(tokenizer, "chat_template", None):  # the folder's code: its rendering bounded before any is used
            try:
                probe_chat_template(lambda: reward_text(*SAMPLE, tokenizer), what="a user/assistant conversation")
            except TemplateProbeError as error:
                raise RewardModelError(f"{self.where}: its chat template {error}; fix the chat_template in its "
                                       "tokenizer_config.json (or chat_template.jinja), or use another reward model") from None
        device = resolve_device(self.device_name)
        if self.dtype_name == "auto":
            saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            dtype = saved if device.type != "cpu" and isinstance(saved, torch.dtype) else torch.float32
        else:
            dtype = torch_dtype(self.dtype_name)
        model, info = AutoModelForSequenceClassification.from_pretrained(self.model_id, dtype=dtype, output_loading_info=True)
        if info.get("missing_keys"):  # e.g. a causal LM without a trained score head: random rewards
            raise RewardModelError(f"{self.where}: weights missing from the checkpoint ({', '.join(sorted(info['missing_keys'])[:3])}); "
                            "it is not a trained reward model")
        if tokenizer.pad_token is None:  # as TRL: pad with EOS (right padding, so it never precedes the text)
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last non-pad token
        if problem := _tokens_past_rows(tokenizer, model.get_input_embeddings().num_embeddings):
            raise RewardModelError(f"{self.where}: {problem}; its tokenizer does not match its weights: save the "
                                   "tokenizer the model was trained with, or resize the model's embeddings to the "
                                   "tokenizer (model.resize_token_embeddings(len(tokenizer))) and save both")
        positions = getattr(config, "max_position_embeddings", None)
        limits = [n for n in (positions, tokenizer.model_max_length) if isinstance(n, int) and 0 < n < 1_000_000]
        self.max_length = min(limits) if limits else None
        self.tokenizer, self.model = tokenizer, model.to(device).eval()
        return self

    def info(self) -> dict[str, str]:
        """Model, dtype and device, as /health reports them (loads the model)."""
        self.load()
        return {"model": self.model_id, "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device)}

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the model scores for each sample (see reward_text)."""
        self.load()
        return [reward_text(p, c, self.tokenizer) for p, c in zip(prompts, completions, strict=True)]

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """One reward per text, scored in batches of `batch_size` (similar lengths batched together)."""
        import torch

        self.load()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        rewards = [0.0] * len(texts)
        rows = self.model.get_input_embeddings().num_embeddings  # read per call: a model may be resized after load
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            inputs = self.tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False,
                                    truncation=self.max_length is not None, max_length=self.max_length)
            if inputs["input_ids"].numel() and (top := int(inputs["input_ids"].max())) >= rows:
                # checked here, on the CPU: on a GPU the lookup would fail with a device-side assert, which
                # leaves the process's CUDA context unusable (every later request of a server would fail too)
                raise IndexError(f"token id {top} is past the model's {rows} embedding rows: its tokenizer "
                                 "does not match its weights")
            with torch.inference_mode():
                logits = self.model(**inputs.to(self.model.device)).logits[:, 0]
            for i, value in zip(chunk, logits.float().tolist()):
                rewards[i] = value
        return rewards

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """TRL's reward signature: one reward per (prompt, completion); other columns are ignored."""
        return self.score_texts(self.texts(prompts, completions))


def _tokens_past_rows(tokenizer: Any, rows: int) -> str | None:
    """What every scoring call would look up past the embedding's `rows` (None if nothing): the pad token
    (every batch of texts of different lengths is padded with it) or a token of the model's own chat
    template (in every chat sample). Found at load, before a run's first iteration or a server's first
    request; other ids past the rows (an added token in a completion) are refused per call."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id >= rows:
        return f"the pad token {tokenizer.pad_token!r} is id {tokenizer.pad_token_id}, past the model's {rows} embedding rows"
    if getattr(tokenizer, "chat_template", None):
        try:
            conversation = reward_text(*SAMPLE, tokenizer)
        except Exception:  # a template that rejects this probe (e.g. one that wants a system turn): not ours to judge here
            return None
        past = min((i for i in tokenizer(conversation, add_special_tokens=False)["input_ids"] if i >= rows), default=None)
        if past is not None:
            return (f"its chat template holds token {tokenizer.convert_ids_to_tokens(past)!r} (id {past}), past the "
                    f"model's {rows} embedding rows")
    return None


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
