"""Dataset rows from files, directories or the local `datasets` cache, checked and rendered.

Sources: JSON (a list of objects, or JSON Lines), JSONL, CSV, Parquet, a `save_to_disk` Dataset or
DatasetDict directory, or the name of a Hugging Face dataset already in the local cache (loaded
offline: nothing is downloaded). Every source becomes {split: rows}; rows are plain dicts.

Rows need a `prompt`: a string, or chat messages [{"role": ..., "content": ...}] that are rendered
with the tokenizer's chat template and generation prompt once the model is loaded (render_rows).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from esft.chat import chatml, is_messages
from esft.files import DATA_LIMIT, looks_like_path, read_regular, read_regular_text
from esft.tasks.base import PROMPT_SOURCE, Task, TaskError
from esft.rewards.usercode import describe
from esft.template_probe import TemplateProbeError, probe_chat_template

FIX = ("fix the chat_template in the model's tokenizer_config.json (or chat_template.jinja), or give text prompts "
       "(--prompt-format raw for a built-in task)")
"""The way out of a chat template that fails (esft.template_probe bounds its first rendering)."""
_FORMATS = "a .json, .jsonl, .csv or .parquet file, a save_to_disk directory, or a dataset name in the local cache"


def load_splits(source: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """{split: rows} of a data source. A file is one split named after its stem; a directory of a
    single Dataset is one split named after the directory; a DatasetDict gives its splits."""
    path = Path(source)
    if path.is_dir():
        return _load_from_disk(path)
    if path.exists():
        suffix = path.suffix.lower()
        loaders = {".json": _read_json, ".jsonl": _read_jsonl, ".csv": _read_csv, ".parquet": _read_parquet}
        if suffix not in loaders:
            raise TaskError(f"{path}: unsupported data file type {suffix or '(no suffix)'!r}; use {_FORMATS}")
        return {path.stem: loaders[suffix](path)}
    if looks_like_path(str(source)):
        raise TaskError(f"{path}: no such file or directory; pass {_FORMATS}")
    return _load_cached(str(source))


def train_split(splits: dict[str, list[dict[str, Any]]], source: Any) -> tuple[str, list[dict[str, Any]]]:
    """The training split of a source: its only split, else the one named "train"."""
    if len(splits) == 1:
        return next(iter(splits.items()))
    if "train" in splits:
        return "train", splits["train"]
    raise TaskError(f"{source}: has splits {', '.join(sorted(splits))} and none is named 'train'; "
                    "pass a source with a single split, or name the training split 'train'")


def _read_text(path: Path) -> str:
    """A data file's text, read only as a regular file of bounded size (a named pipe would hang the run)."""
    try:
        return read_regular_text(path, DATA_LIMIT, follow_links=True)
    except OSError as error:
        raise TaskError(f"{path}: cannot read it ({error.strerror}); pass a data file") from None
    except UnicodeDecodeError as error:
        raise TaskError(f"{path}: cannot read it (not UTF-8 text at byte {error.start})") from None


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON Lines in a .json file, as `datasets` accepts
            return _parse_jsonl(path, text)
        raise TaskError(f"{path}: not valid JSON (line {error.lineno}: {error.msg}); expected a list of "
                        'objects such as [{"prompt": "...", "answer": "..."}]') from None
    if not isinstance(data, list):
        raise TaskError(f"{path}: expected a JSON list of row objects, got a JSON {type(data).__name__}")
    return _objects(data, path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return _parse_jsonl(path, _read_text(path))


def _parse_jsonl(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise TaskError(f"{path}: line {number} is not valid JSON ({error.msg}); JSON Lines need one object per line") from None
    return _objects(rows, path)


def _objects(rows: list[Any], path: Path) -> list[dict[str, Any]]:
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TaskError(f"{path}: row {index} is a {type(row).__name__}, not an object of columns")
    return rows


def _read_csv(path: Path) -> list[dict[str, Any]]:
    text = _read_text(path)
    try:
        rows = [dict(row) for row in csv.DictReader(io.StringIO(text, newline=""))]
    except csv.Error as error:
        raise TaskError(f"{path}: cannot read it as CSV ({error})") from None
    for index, row in enumerate(rows):
        if None in row:
            raise TaskError(f"{path}: row {index} has more fields than the header")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq

        data = read_regular(path, DATA_LIMIT, follow_links=True)
    except ImportError:
        raise TaskError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    except OSError as error:
        raise TaskError(f"{path}: cannot read it ({error.strerror}); pass a data file") from None
    try:
        return pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise TaskError(f"{path}: cannot read it as Parquet ({error})") from None


def _load_from_disk(path: Path) -> dict[str, list[dict[str, Any]]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 - any failure means the same thing to the user
        raise TaskError(f"{path}: cannot load it as a dataset directory ({error}); pass a directory written by "
                        "Dataset.save_to_disk or DatasetDict.save_to_disk, or a data file") from None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise TaskError(f"{path}: the DatasetDict has no splits")
        return {name: loaded[name].to_list() for name in loaded}
    return {path.resolve().name: loaded.to_list()}


def _load_cached(name: str) -> dict[str, list[dict[str, Any]]]:
    """A dataset from the local Hugging Face cache, offline (HF_DATASETS_OFFLINE): never a download."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        datasets.logging.disable_progress_bar()
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity_error()
        try:
            loaded = datasets.load_dataset(name)
        finally:
            datasets.logging.set_verbosity(verbosity)
    except Exception as error:  # noqa: BLE001
        raise TaskError(f"{name}: not a file or directory, and not a dataset in the local Hugging Face cache "
                        f"({' '.join(str(error).split())[:200]}); pass {_FORMATS}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved
    if isinstance(loaded, datasets.DatasetDict):
        return {split: loaded[split].to_list() for split in loaded}
    return {name.split("/")[-1]: loaded.to_list()}


# ------------------------------------------------------------------------------ checking rows
def check_rows(rows: Iterable[Any], where: str) -> list[dict[str, Any]]:
    """Rows as dicts (from a list, a `datasets.Dataset`, ...), each with a usable `prompt`."""
    checked = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TaskError(f"{where} row {index}: expected a mapping of columns, got a {type(row).__name__}")
        row = dict(row)
        prompt = row.get(PROMPT_SOURCE, row.get("prompt"))
        if not isinstance(prompt, str) and not is_messages(prompt):
            got = f"columns {sorted(row)}" if "prompt" not in row else f"a {type(prompt).__name__}: {str(prompt)[:60]!r}"
            raise TaskError(f"{where} row {index}: needs a 'prompt' column holding a string or a list of chat messages "
                            f"[{{'role': ..., 'content': ...}}], got {got}; data with its prompt in another column: "
                            "--prompt-column COL or --prompt-template '...{COL}...' (ESConfig prompt_column, prompt_template)")
        checked.append(row)
    if not checked:
        raise TaskError(f"{where} is empty")
    return checked


def apply_template(rows: list[dict[str, Any]], template: str, where: str) -> list[dict[str, Any]]:
    """Rows without a `prompt` get `template.format(**row)`."""
    result = []
    for index, row in enumerate(rows):
        if "prompt" not in row:
            try:
                row = {**row, "prompt": template.format(**row)}
            except (KeyError, IndexError, ValueError) as error:
                raise TaskError(f"{where} row {index}: prompt template {template!r} cannot be filled ({type(error).__name__}: "
                                f"{error}); columns are {sorted(row)}") from None
        result.append(row)
    return result


def common_columns(rows: list[dict[str, Any]]) -> set[str]:
    """The columns every row has (a reward function that needs one may rely on it)."""
    return set.intersection(*(set(row) for row in rows)) - {"prompt", PROMPT_SOURCE} if rows else set()


def _row_list(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return f"row{'s' if len(indices) > 1 else ''} {shown}" + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


def check_tokenizer(tokenizer: Any) -> None:
    """TaskError when the tokenizer turns text into no tokens: what transformers loads from a model folder
    without tokenizer files (else every prompt would be reported "empty", as if the data were at fault)."""
    if tokenizer("Hello, world", add_special_tokens=False)["input_ids"]:
        return
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    if name and Path(name).is_dir():
        raise TaskError(f"{name}: the model folder has no tokenizer (no tokenizer.json, tokenizer_config.json or vocab "
                        "files), so transformers made an empty one that turns text into no tokens; save the tokenizer of "
                        f"the model it was made from into it (AutoTokenizer.from_pretrained(BASE).save_pretrained({name!r}))")
    raise TaskError(f"the tokenizer {name or type(tokenizer).__name__!r} turns text into no tokens ({len(tokenizer)} tokens "
                    "in its vocabulary); use the tokenizer the model was trained with")


def check_prompts(task: Task, tokenizer: Any, max_length: int | None, max_tokens: int,
                  embedding_rows: int | None = None, feeds_padding: bool = False) -> None:
    """TaskError naming the rows whose prompt has no token, holds a token id the model has no
    embedding row for, or is too long to leave room for `max_tokens` new tokens within the model's
    `max_length` positions; and the pad token when the engine `feeds_padding` and the model has no
    row for it: before any generation. A token past the embedding is a tokenizer that does not match
    the weights: on CPU the lookup fails mid-run, on CUDA it is a device-side assert that leaves the
    process unable to use the GPU."""
    mismatch = ("the tokenizer does not match the model's weights; use the tokenizer saved with the model, or "
                "resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save both")
    check_tokenizer(tokenizer)
    pad = tokenizer.pad_token_id
    if feeds_padding and embedding_rows is not None and pad is not None and pad >= embedding_rows:
        raise TaskError(f"the tokenizer's pad token {tokenizer.pad_token!r} is id {pad}, past the model's {embedding_rows} "
                        f"embedding rows; {mismatch}")
    sets = [(task.where(), task.train_dataset)] + [(task.where(split), rows) for split, rows in task.eval_datasets.items()]
    for where, rows in sets:
        if not rows:
            continue
        ids = tokenizer([row["prompt"] for row in rows], add_special_tokens=False)["input_ids"]
        lengths = [len(row) for row in ids]
        empty = [i for i, n in enumerate(lengths) if n == 0]
        if empty:
            raise TaskError(f"{where}: the prompt of {_row_list(empty)} is empty; every prompt needs text for the model "
                            "to continue (drop or fill those rows)")
        if embedding_rows is not None:
            past = [i for i, row in enumerate(ids) if max(row) >= embedding_rows]
            if past:
                largest = max(max(ids[i]) for i in past)
                held = "holds token id" if len(past) == 1 else "hold token ids up to"
                raise TaskError(f"{where}: the prompt{'s' if len(past) > 1 else ''} of {_row_list(past)} {held} {largest}, "
                                f"past the model's {embedding_rows} embedding rows; {mismatch}")
        too_long = [i for i, n in enumerate(lengths) if max_length is not None and n + max_tokens > max_length]
        if too_long:
            longest = max(lengths[i] for i in too_long)
            size = f"has {longest} tokens" if len(too_long) == 1 else f"have up to {longest} tokens"
            raise TaskError(f"{where}: the prompt{'s' if len(too_long) > 1 else ''} of {_row_list(too_long)} {size}, which with "
                            f"--max-tokens {max_tokens} exceed{'s' if len(too_long) == 1 else ''} the model's {max_length} "
                            "positions; shorten or drop those rows, or lower --max-tokens")


# ----------------------------------------------------------------------------- chat rendering
def render_prompt(prompt: str | list, tokenizer: Any) -> str:
    """The text the model sees. Chat messages go through the tokenizer's chat template with the
    generation prompt (or continue a final assistant message, as TRL does); a tokenizer without a
    chat template gets the plain-text ChatML rendering."""
    if isinstance(prompt, str):
        return prompt
    continue_final = prompt[-1].get("role") == "assistant"
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(
                [dict(m) for m in prompt], tokenize=False, add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
            )
        except Exception as error:  # noqa: BLE001 - the template is the model folder's code: any failure, one line
            raise TaskError(f"the tokenizer's chat template failed on a chat prompt ({describe(error)}); {FIX}") from error
    text = chatml(prompt, add_generation_prompt=not continue_final)
    return text[: -len("<|im_end|>\n")] if continue_final else text


def format_prompts(task: Task, choice: str, tokenizer: Any) -> str | None:
    """--prompt-format: a built-in task's text prompts become its chat form (task.chat_form) under `chat`,
    or under `auto` when the tokenizer has a chat template. Returns the line that says which form was used,
    None when there was no choice (a task without a chat form; auto with no chat template)."""
    if task.chat_form is None:
        return None
    template = bool(getattr(tokenizer, "chat_template", None))
    if choice == "raw" or (choice == "auto" and not template):
        return None if choice == "auto" else f"prompts: {task.name}'s raw text (--prompt-format raw)"
    for rows in (task.train_dataset, *task.eval_datasets.values()):
        for row in rows:
            if PROMPT_SOURCE not in row and isinstance(row["prompt"], str):
                row["prompt"] = task.chat_form(row)
    how = "the tokenizer's chat template" if template else "ChatML text (the tokenizer has no chat template)"
    why = "--prompt-format chat" if choice == "chat" else "--prompt-format auto; raw for the task's plain text"
    return f"prompts: {task.name}'s question in a user turn, through {how} ({why})"


def render_rows(task: Task, tokenizer: Any = None, load_tokenizer: Any = None) -> int:
    """Render every chat prompt of the task in place: `prompt` becomes the text, the messages move to
    PROMPT_SOURCE (reward functions still receive them). Without `tokenizer`, `load_tokenizer()` is
    called once if some prompt needs one. Returns how many rows were rendered."""
    count = 0
    for rows in (task.train_dataset, *task.eval_datasets.values()):
        for row in rows:
            if PROMPT_SOURCE not in row and not isinstance(row["prompt"], str):
                if tokenizer is None and load_tokenizer is not None:
                    tokenizer = load_tokenizer()
                if count == 0 and getattr(tokenizer, "chat_template", None):  # bounded in time and memory, once
                    try:
                        probe_chat_template(lambda: render_prompt(row["prompt"], tokenizer))
                    except TemplateProbeError as error:
                        raise TaskError(f"the tokenizer's chat template {error}; {FIX}") from None
                row[PROMPT_SOURCE] = row["prompt"]
                row["prompt"] = render_prompt(row[PROMPT_SOURCE], tokenizer)
                count += 1
    return count
