"""Chat data for supervised fine-tuning: conversations read from JSON Lines or an ``hf:`` dataset, checked
row by row (an error names the file and line, or the dataset and row), and rendered through the policy's
chat template into message logs whose assistant turns, every one of them, carry the loss.

A row is one object with a list of messages (the key is ``data.messages_key``, default ``messages``)::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "12+7="},
                  {"role": "assistant", "content": "\\\\boxed{19}"}, {"role": "user", "content": "+5="},
                  {"role": "assistant", "content": "\\\\boxed{24}"}]}

Rendering matches what the policy sees at RL time: the conversation is rendered once by the chat template
and cut at the boundaries that rendering its prefixes gives (the prompt of assistant turn k is the first k
messages with the generation prompt, as GRPO renders a prompt); each piece is tokenized on its own, as a
GRPO message log is (the prompt's tokens, then the generated ones).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_like.data.errors import DataError
from nemo_like.data.jsonl import jsonl_rows
from nemo_like.data.processors import render_chat, tokenize_text

__all__ = ["SFT_ROLES", "SFTDataConfig", "SFTSourceConfig", "arithmetic_conversations", "conversation_log",
           "read_conversations", "tokenize_conversations"]

# Roles a training conversation may hold; only the assistant's turns carry loss.
SFT_ROLES = ("system", "user", "assistant", "tool")


class SFTSourceConfig(BaseModel):
    """One split of chat data: a local JSON Lines file, or ``hf:<name>`` (a hub dataset, or a local folder
    laid out as one), read with ``split`` and ``subset``."""

    model_config = ConfigDict(extra="forbid")
    # A JSON Lines file, or hf:<name> (a hub dataset, or a local folder laid out as one).
    path: str
    # hf: datasets only: the split ("train", "test", "train[:500]").
    split: str = "train"
    # hf: datasets only: the subset (the hub's config name).
    subset: str | None = None
    # Keep at most this many conversations (the first ones).
    num_samples: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _hf_only_options(self) -> SFTSourceConfig:
        if not self.path.strip():
            raise ValueError("path must not be empty")
        if self.subset is not None and not self.path.startswith("hf:"):
            raise ValueError(f"subset={self.subset!r} selects a subset of an hf: dataset, but path is {self.path!r}")
        return self


class SFTDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Training conversations: {path: file.jsonl} or {path: "hf:<name>", split: ...}; a plain string is the path.
    train: SFTSourceConfig
    # Held-out conversations for val/loss (None: no validation loss).
    validation: SFTSourceConfig | None = None
    # The column (JSONL key) holding each row's list of {"role", "content"} messages.
    messages_key: str = "messages"
    # Tokens per conversation, chat template included (None: policy.max_total_sequence_length). A longer
    # one is cut at the end and trains on what is left (counted): unlike a cut RL prompt, no kept token
    # loses any of its context.
    max_length: int | None = Field(None, gt=1)

    @field_validator("train", "validation", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


def _check_row(row: Any, key: str, where: str) -> list[dict[str, Any]]:
    """The row's messages as plain {"role", "content", ...} dicts; DataError starting with ``where``."""
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a JSON object with a '{key}' list, got {type(row).__name__}")
    if row.get(key) is None:
        raise DataError(f"{where}: no '{key}' (data.messages_key) in this row; its keys: {sorted(row)}")
    messages = row[key]
    if not isinstance(messages, (list, tuple)) or not messages:
        what = "an empty list" if isinstance(messages, (list, tuple)) else f"a {type(messages).__name__}"
        raise DataError(f"{where}: '{key}' must be a non-empty list of messages, got {what}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: message {i} is a {type(m).__name__}, not a {{\"role\", \"content\"}} object")
        role = m.get("role")
        if role not in SFT_ROLES:
            said = "has no 'role'" if role is None else f"has role {role!r}"
            raise DataError(f"{where}: message {i} {said}; expected one of {', '.join(SFT_ROLES)}")
        if not isinstance(m.get("content"), str):
            got = "no 'content'" if m.get("content") is None else f"a {type(m['content']).__name__} 'content'"
            raise DataError(f"{where}: message {i} ({role}) has {got}; it must be a string")
        # Keys a columnar format filled with None (another row's message has them) are dropped.
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message: nothing to train on (only the assistant's turns carry loss)")
    return out


def _read_jsonl(path: Path, key: str, field: str) -> list[list[dict[str, Any]]]:
    if not path.is_file():
        raise DataError(f"{path}: {'no such file' if not path.exists() else 'not a regular file'} ({field})")
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise DataError(f"{path}: expected a JSON Lines file (.jsonl), or 'hf:<dataset>' ({field})")
    out = [_check_row(row, key, f"{path}:{lineno}") for lineno, row in jsonl_rows(path)]
    if not out:
        raise DataError(f"{path}: no conversations (the file is empty) ({field})")
    return out


def read_conversations(src: SFTSourceConfig, messages_key: str, field: str = "data.train") -> list[list[dict]]:
    """Every conversation of ``src``, checked: DataError naming the file and line (or dataset and row)."""
    if src.path.startswith("hf:"):
        from nemo_like.data.loaders import load_hub  # `datasets` is slow to import: only for hub data

        ds = load_hub(src.path[3:], src.subset, src.split)
        source = f"{src.path} (split {src.split})"
        if messages_key not in ds.column_names:
            raise DataError(f"{source}: no '{messages_key}' column (data.messages_key); columns: {ds.column_names}")
        n = len(ds) if src.num_samples is None else min(len(ds), src.num_samples)
        rows = ds.select(range(n))[messages_key]
        out = [_check_row({messages_key: m}, messages_key, f"{source}: row {i}") for i, m in enumerate(rows)]
        if not out:
            raise DataError(f"{source}: no conversations ({field})")
        return out
    out = _read_jsonl(Path(src.path).expanduser(), messages_key, f"{field}.path")
    return out[:src.num_samples] if src.num_samples else out


def conversation_log(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The message log of one conversation: pieces of its rendered text (``role`` "assistant" for each
    assistant turn's tail, end-of-turn token included; the role of the last message before it otherwise)
    with their ``token_ids``. ValueError when the template does not render a conversation's prefixes as
    prefixes of it (then assistant tokens cannot be told apart)."""
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    log, pos = [], 0

    def piece(role: str, text: str) -> None:
        if text:
            log.append({"role": role, "content": text, "token_ids": tokenize_text(tokenizer, text)})

    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # The prompt as GRPO renders it (up to the generation prompt), then the turn as rendered.
        prompt = render_chat(tokenizer, messages[:k], add_generation_prompt=True) if k else ""
        turn = render_chat(tokenizer, messages[:k + 1], add_generation_prompt=False)
        if not (turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= pos):
            raise ValueError(f"the chat template does not render message {k} (assistant) as the conversation "
                             "before it (with the generation prompt) followed by the turn, so its tokens cannot be "
                             "told apart for the loss (a template that rewrites earlier turns, e.g. drops their "
                             "reasoning); set policy.chat_template to one that does not")
        piece(messages[k - 1]["role"] if k else "system", full[pos:len(prompt)])
        piece("assistant", turn[len(prompt):])
        pos = len(turn)
    piece(messages[-1]["role"], full[pos:])
    return log


def tokenize_conversations(tokenizer: Any, conversations: list[list[dict]], max_length: int,
                           source: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Datums (``message_log``, ``length``, ``loss_multiplier``) of the conversations, each cut to its
    first ``max_length`` tokens, and counts: ``truncated`` (cut) and ``no_loss`` (no assistant token left
    after the cut: kept, with loss_multiplier 0). DataError naming ``source`` and the row when the chat
    template cannot render one."""
    datums, truncated, no_loss = [], 0, 0
    for i, messages in enumerate(conversations):
        try:
            log = conversation_log(tokenizer, messages)
        except Exception as e:  # the template's own errors (jinja raise_exception, a role it refuses)
            raise DataError(f"{source}: conversation {i}: {e}") from None
        length = sum(int(m["token_ids"].numel()) for m in log)
        if length > max_length:
            truncated += 1
            budget = max_length
            for m in log:
                keep = min(budget, int(m["token_ids"].numel()))
                m["token_ids"] = m["token_ids"][:keep]
                budget -= keep
            log = [m for m in log if m["token_ids"].numel()]
            length = max_length
        has_loss = any(m["role"] == "assistant" for m in log)
        no_loss += not has_loss
        datums.append({"message_log": log, "length": length, "loss_multiplier": float(has_loss), "idx": i})
    return datums, {"truncated": truncated, "no_loss": no_loss}


def arithmetic_conversations(n: int, seed: int, split: str = "train", turns: int = 2) -> list[dict[str, Any]]:
    """``n`` rows of the tiny math work as chats: ``a+b=`` answered ``\\boxed{s}``, then ``turns - 1``
    follow-ups ``+c=`` answered with the running sum. The first turn's problem is of ``split`` (the
    arithmetic generator's train/validation partition), so held-out rows never share a first problem
    with training ones. What examples/your_data/sft_math_*.jsonl hold."""
    from nemo_like.data.datasets import arithmetic_split_of

    rng, rows = random.Random(seed), []
    while len(rows) < n:
        a, b = rng.randrange(100), rng.randrange(100)
        first = f"{a}+{b}="
        if arithmetic_split_of(first) != split:
            continue
        total, messages = a + b, [{"role": "user", "content": first},
                                  {"role": "assistant", "content": f"\\boxed{{{a + b}}}"}]
        for _ in range(turns - 1):
            c = rng.randrange(1, 10)
            total += c
            messages += [{"role": "user", "content": f"+{c}="}, {"role": "assistant", "content": f"\\boxed{{{total}}}"}]
        rows.append({"messages": messages})
    return rows

