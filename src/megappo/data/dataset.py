"""Prompt datasets in verl's parquet schema, tokenized with the model's chat template.

Schema (one row per prompt): ``data_source`` (str), ``prompt`` (list of {role, content}),
``ability`` (str, optional), ``reward_model`` ({style, ground_truth}), ``extra_info`` (optional).
Every problem names the file, the row and the field.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["DataError", "PromptItem", "PromptDataset", "read_rows", "tokenize_prompt"]


class DataError(ValueError):
    """Bad prompt data: names the file, row and field."""


@dataclass
class PromptItem:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    ability: str = ""
    origin: str = ""          # "file:row", for error messages
    truncated: bool = False
    raw_chat: Optional[list] = None   # the prompt's chat messages, with data.return_raw_chat


def read_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    p = os.path.expanduser(path)
    if os.path.isdir(p):
        raise DataError(f"{path}: is a directory, expected a parquet file")
    if not os.path.isfile(p):
        raise DataError(f"{path}: file not found")
    if os.path.getsize(p) == 0:
        raise DataError(f"{path}: the file is empty (0 bytes), expected a parquet file")
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a non-parquet file
        raise DataError(f"{path}: cannot read as parquet: {type(e).__name__}: {e}") from None
    if table.num_rows == 0:
        raise DataError(f"{path}: the file has no rows")
    try:
        return table.to_pylist()
    except UnicodeDecodeError as e:  # a string column holding bytes that are not UTF-8
        row, column = _find_bad_utf8(table)
        where = f"{path}, row {row}" if row is not None else path
        what = f"field '{column}'" if column is not None else "a text field"
        raise DataError(f"{where}: {what} is not valid UTF-8 text ({e.reason} at byte {e.start}); "
                        "re-encode the data as UTF-8") from None


def _find_bad_utf8(table) -> tuple[Optional[int], Optional[str]]:
    """(row, column) of the first value that does not decode as UTF-8 (only called on failure)."""
    for name in table.column_names:
        col = table.column(name)
        try:
            col.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        block = 1024
        for start in range(0, len(col), block):
            part = col.slice(start, block)
            try:
                part.to_pylist()
                continue
            except UnicodeDecodeError:
                pass
            for i in range(len(part)):
                try:
                    part.slice(i, 1).to_pylist()
                except UnicodeDecodeError:
                    return start + i, name
        return None, name  # pragma: no cover - the column failed as a whole but no single row did
    return None, None  # pragma: no cover


def _kind(v: Any) -> str:
    if isinstance(v, (bytes, bytearray)):
        try:
            bytes(v).decode("utf-8")
            return "bytes (a binary column; expected a string column)"
        except UnicodeDecodeError:
            return "bytes that are not valid UTF-8 text"
    return type(v).__name__


def _check_row(row: dict, where: str, prompt_key: str) -> None:
    for key in ("data_source", prompt_key, "reward_model"):
        if key not in row:
            raise DataError(f"{where}: missing column '{key}' (verl schema: data_source, {prompt_key}, reward_model)")
        if row[key] is None:
            raise DataError(f"{where}: field '{key}' is null")
    if not isinstance(row["data_source"], str):
        raise DataError(f"{where}: field 'data_source' must be a string, got {_kind(row['data_source'])}")
    msgs = row[prompt_key]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field '{prompt_key}' must be a non-empty list of chat messages "
                        f"[{{'role': str, 'content': str}}, ...], got {_kind(msgs)} {msgs!r:.80}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise DataError(f"{where}: field '{prompt_key}[{j}]' must be {{'role': str, 'content': str}}, "
                            f"got {_kind(m)} {m!r:.80}")
        for sub in ("role", "content"):
            if not isinstance(m.get(sub), str):
                got = "nothing (missing or null)" if m.get(sub) is None else _kind(m[sub])
                raise DataError(f"{where}: field '{prompt_key}[{j}].{sub}' must be a string "
                                f"(messages are {{'role': str, 'content': str}}), got {got}")
    rm = row["reward_model"]
    if not isinstance(rm, dict):
        raise DataError(f"{where}: field 'reward_model' must be a mapping {{'style': ..., 'ground_truth': ...}}, "
                        f"got {_kind(rm)}")
    gt = rm.get("ground_truth")
    if gt is None:
        raise DataError(f"{where}: field 'reward_model.ground_truth' is missing")
    # dicts pass: custom reward functions (code tests, multi-part answers) take structured truths.
    if not isinstance(gt, (str, int, float, list, dict)) or isinstance(gt, (bytes, bytearray)):
        raise DataError(f"{where}: field 'reward_model.ground_truth' must be a string, a number, a list or a mapping, "
                        f"got {_kind(gt)} {gt!r:.80}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info' must be a mapping or null, got {_kind(extra)}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise DataError(f"{where}: field 'ability' must be a string or null, got {_kind(ability)}")


def tokenize_prompt(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None,
                    chat_template_kwargs: Optional[dict] = None) -> list[int]:
    """The prompt as the chat template renders it; with ``tools`` (OpenAI function schemas) the
    template describes them to the model, as verl's agent loop renders multi-turn prompts.
    ``chat_template_kwargs``: data.apply_chat_template_kwargs (e.g. Qwen3's enable_thinking)."""
    kw = dict(chat_template_kwargs or {}, **({} if tools is None else {"tools": tools}))
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]


SANITY_ROWS = 64          # rows per file the tokenizer checks look at: a wrong tokenizer is systematic
MAX_CHARS_PER_TOKEN = 24  # real tokenizers give ~2-6 characters of text per token
MAX_UNK_SHARE = 0.5


def _check_tokenization(tokenizer, messages: list[dict], ids: list[int], where: str,
                        chat_template_kwargs: Optional[dict] = None) -> None:
    """Catch a tokenizer that does not fit the data: text that becomes (almost) no tokens beyond
    the chat template's, or mostly unknown tokens. transformers may load a folder with another
    tokenizer class than its tokenizer.json describes (e.g. Qwen2Tokenizer with its byte-level
    pre-tokenizer over a word-level vocabulary), and training then sees only template tokens."""
    text = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
    chars = sum(len(t.strip()) for t in text)
    if chars < 8:
        return
    blank = tokenize_prompt(tokenizer, [dict(m, content="") for m in messages], chat_template_kwargs=chat_template_kwargs)
    content = len(ids) - len(blank)
    name = type(tokenizer).__name__
    if content * MAX_CHARS_PER_TOKEN < chars:
        raise DataError(f"{where}: {chars} characters of prompt text became {max(content, 0)} tokens beyond the chat "
                        f"template's {len(blank)} with the tokenizer loaded ({name}); it does not fit this data or "
                        "this model folder (check tokenizer_config.json's tokenizer_class and tokenizer.json)")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and content > 0:
        share = (sum(1 for i in ids if i == unk) - sum(1 for i in blank if i == unk)) / content
        if share > MAX_UNK_SHARE:
            raise DataError(f"{where}: {share:.0%} of the prompt's tokens are the unknown token with the tokenizer "
                            f"loaded ({name}); it does not fit this data or this model folder (check "
                            "tokenizer_config.json's tokenizer_class and tokenizer.json)")


class PromptDataset:
    """All rows of the given files, in order, tokenized (with ``tools``: the tool schemas the chat
    template describes, multi-turn rollouts; ``chat_template_kwargs``: the template's other
    arguments); overlong prompts filtered or truncated. ``max_samples`` > 0 keeps that many rows
    as verl's dataset does: with ``shuffle`` numpy's ``default_rng(seed).choice`` (in its order),
    else the first rows.
    The first rows of each file also check that the tokenizer fits the text (_check_tokenization)."""

    def __init__(self, files, tokenizer, *, max_prompt_length: int, prompt_key: str = "prompt",
                 filter_overlong_prompts: bool = False, truncation: str = "error", return_raw_chat: bool = False,
                 tools: Optional[list[dict]] = None, chat_template_kwargs: Optional[dict] = None,
                 max_samples: int = -1, shuffle: bool = False, seed: Optional[int] = None):
        if truncation not in ("error", "left", "right", "middle"):
            raise ValueError(f"data.truncation must be error, left, right or middle, got {truncation!r}")
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise DataError("no data files given")
        self.items: list[PromptItem] = []
        self.num_filtered = 0
        self.num_truncated = 0
        rows = [(path, r, row) for path in files for r, row in enumerate(read_rows(path))]
        if 0 < max_samples < len(rows):   # verl's choice of rows: before the overlong filter
            import numpy as np

            keep = (np.random.default_rng(*(() if seed is None else (seed,))).choice(len(rows), size=max_samples,
                                                                                  replace=False)
                    if shuffle else np.arange(max_samples))
            rows = [rows[int(i)] for i in keep]
        checked: dict = {}
        for path, r, row in rows:
            where = f"{path}, row {r}"
            _check_row(row, where, prompt_key)
            ids = tokenize_prompt(tokenizer, row[prompt_key], tools, chat_template_kwargs)
            checked[path] = checked.get(path, 0) + 1
            if checked[path] <= SANITY_ROWS:   # the first rows of each file that are used
                _check_tokenization(tokenizer, row[prompt_key], ids, where, chat_template_kwargs)
            truncated = False
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length="
                                    f"{max_prompt_length} (set data.filter_overlong_prompts=true or "
                                    "data.truncation=left|right|middle)")
                ids = _truncate(ids, max_prompt_length, truncation)
                truncated = True
                self.num_truncated += 1
            self.items.append(PromptItem(ids, row["data_source"], row["reward_model"]["ground_truth"],
                                         row.get("extra_info") or {}, row.get("ability") or "", f"{path}:{r}",
                                         truncated,
                                         [dict(m) for m in row[prompt_key]] if return_raw_chat else None))
        if not self.items:
            raise DataError(f"{', '.join(files)}: no prompts left after filtering ({self.num_filtered} longer than "
                            f"data.max_prompt_length={max_prompt_length})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def _truncate(ids: list[int], n: int, how: str) -> list[int]:
    if how == "left":
        return ids[-n:]
    if how == "right":
        return ids[:n]
    head = n // 2
    return ids[:head] + ids[len(ids) - (n - head):]
