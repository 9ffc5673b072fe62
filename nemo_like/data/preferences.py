"""Preference pairs for reward-model training: files, checks, tokenization, and a math recipe.

A pair file is JSONL, one pair a line, either plain text::

    {"prompt": "12+34=", "chosen": "\\\\boxed{46}", "rejected": "\\\\boxed{45}"}

or chat messages (the prompt's turns, and the assistant turn(s) of each side)::

    {"prompt": [{"role": "user", "content": "12+34="}],
     "chosen": [{"role": "assistant", "content": "\\\\boxed{46}"}], "rejected": [...]}

A plain-text prompt is one user turn and a plain-text side one assistant turn. Each side is rendered
with the tokenizer's chat template after the prompt. A missing or empty side, a line that is not a
JSON object, and a pair given twice are errors naming the file and line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_like.data.errors import DataError
from nemo_like.data.jsonl import jsonl_rows
from nemo_like.data.processors import render_chat, tokenize_text
from nemo_like.environments.math_environment import verify_math_answer

__all__ = ["PreferencePair", "load_preference_pairs", "math_preference_pairs", "tokenize_pairs"]

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class PreferencePair:
    prompt: tuple  # the prompt's messages, as ((role, content), ...)
    chosen: tuple  # the chosen side's messages
    rejected: tuple

    def messages(self, side: str) -> Messages:
        return [{"role": r, "content": c} for r, c in (*self.prompt, *getattr(self, side))]


def _as_turns(value: Any, default_role: str, where: str, key: str) -> tuple:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: '{key}' is empty")
        return ((default_role, value),)
    if isinstance(value, list) and value:
        turns = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: '{key}'[{i}] is not a message with string 'role' and 'content'")
            turns.append((m["role"], m["content"]))
        if not any(c.strip() for _, c in turns):
            raise DataError(f"{where}: '{key}' has only empty messages")
        return tuple(turns)
    if value is None or value == [] or value == "":
        raise DataError(f"{where}: '{key}' is missing or empty")
    raise DataError(f"{where}: '{key}' must be a string or a list of messages, got {type(value).__name__}")


def parse_pair(row: Any, where: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with prompt, chosen and rejected, got {type(row).__name__}")
    for key in ("prompt", "chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: no '{key}' (a pair needs prompt, chosen and rejected; has {sorted(row)})")
    return PreferencePair(_as_turns(row["prompt"], "user", where, "prompt"),
                          _as_turns(row["chosen"], "assistant", where, "chosen"),
                          _as_turns(row["rejected"], "assistant", where, "rejected"))


def load_preference_pairs(path: str | Path) -> list[PreferencePair]:
    """The pairs of a JSONL file, every line checked (DataError naming file and line)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such preference file")
    pairs: list[PreferencePair] = []
    first_line: dict[PreferencePair, int] = {}
    for lineno, row in jsonl_rows(p):
        where = f"{p}:{lineno}"
        pair = parse_pair(row, where)
        if pair.chosen == pair.rejected:
            raise DataError(f"{where}: 'chosen' and 'rejected' are the same")
        if pair in first_line:
            raise DataError(f"{where}: the same pair as line {first_line[pair]}")
        first_line[pair] = lineno
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{p}: no preference pairs")
    return pairs


def _near_miss(answer: int, rng: random.Random) -> int:
    """A plausible wrong sum: off by one or ten, or two digits swapped."""
    options = [answer + 1, answer - 1, answer + 10, answer - 10]
    s = str(answer)
    if len(s) >= 2 and s[-1] != s[-2]:
        options.append(int(s[:-2] + s[-1] + s[-2]))
    return rng.choice([o for o in options if o >= 0 and o != answer])


def _far_miss(answer: int, rng: random.Random, high: int) -> int:
    """Any other number from 0 to ``high``."""
    wrong = answer
    while wrong == answer:
        wrong = rng.randint(0, high)
    return wrong


# What a malformed answer is made of: characters that are not digits (a policy gaming a reward model
# trained on numbers only was seen to fill the box with brackets and letters, docs/performance.md).
_NOT_DIGITS = "()[]<>!?;:'\"_|&%$#@~^IOoSlZzBxe"


def _malformed(answer: int, rng: random.Random) -> str:
    """The right answer made unreadable: a digit replaced or a character added (both non-digits), the
    box emptied, or the number given without its box; always one the math verifier scores 0 (a
    character it would read past, such as a trailing period, is drawn again)."""
    s = str(answer)
    for _ in range(20):
        kind = rng.randrange(4)
        if kind == 0:
            i = rng.randrange(len(s))
            out = f"\\boxed{{{s[:i] + rng.choice(_NOT_DIGITS) + s[i + 1:]}}}"
        elif kind == 1:
            i = rng.randrange(len(s) + 1)
            out = f"\\boxed{{{s[:i] + rng.choice(_NOT_DIGITS) + s[i:]}}}"
        else:
            out = "\\boxed{}" if kind == 2 else s
        if verify_math_answer(out, s) == 0.0:
            return out
    return "\\boxed{}"


def math_preference_pairs(problems: list[dict[str, Any]], seed: int = 0, wrong: str = "far",
                          malformed: float = 0.0) -> list[PreferencePair]:
    """One pair per arithmetic problem (``problem``, ``expected_answer``): the right answer in the
    task's ``\\boxed{}`` format against a wrong one. ``wrong="far"``: any other number up to twice
    the largest answer; ``"near"``: a near miss (off by one or ten, two digits swapped), which a
    model can only tell apart by checking the sum digit by digit. ``malformed``: the share of pairs
    (drawn at random) whose rejected side is the right answer made unreadable instead (a non-digit in
    or added to it, an empty box, no box): what the task's verifier scores 0 however close it looks."""
    if wrong not in ("far", "near"):
        raise ValueError(f"wrong must be 'far' or 'near', got {wrong!r}")
    if not 0.0 <= malformed <= 1.0:
        raise ValueError(f"malformed must be a share between 0 and 1, got {malformed!r}")
    rng = random.Random(seed)
    high = 2 * max((int(r["expected_answer"]) for r in problems), default=1) + 1
    pairs = []
    for row in problems:
        answer = int(row["expected_answer"])
        if malformed and rng.random() < malformed:
            rejected = _malformed(answer, rng)
        else:
            wrong_answer = _near_miss(answer, rng) if wrong == "near" else _far_miss(answer, rng, high)
            rejected = f"\\boxed{{{wrong_answer}}}"
        pairs.append(PreferencePair((("user", row["problem"]),), (("assistant", f"\\boxed{{{answer}}}"),),
                                    (("assistant", rejected),)))
    return pairs


def tokenize_pairs(pairs: list[PreferencePair], tokenizer: Any, max_length: int) -> dict[str, torch.Tensor]:
    """``input_ids`` [2P, T] (chosen at even rows, rejected at odd) right-padded, and ``input_lengths``
    [2P]. A side longer than ``max_length`` tokens keeps its first ``max_length`` (counted in
    ``truncated`` [P], bool)."""
    seqs, truncated = [], []
    for pair in pairs:
        cut = False
        for side in ("chosen", "rejected"):
            ids = tokenize_text(tokenizer, render_chat(tokenizer, pair.messages(side), add_generation_prompt=False))
            cut |= len(ids) > max_length
            seqs.append(ids[:max_length])
        truncated.append(cut)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return {"input_ids": ids, "input_lengths": torch.tensor([len(s) for s in seqs]),
            "truncated": torch.tensor(truncated)}
