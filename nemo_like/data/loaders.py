"""Rows of a dataset read from a local file or from a hub dataset (``hf:``), checked as they are read
so that an error names the file and line (JSON Lines), the array item (a JSON array) or the row.

A hub dataset is ``datasets.load_dataset(name, name=subset, split=split)``: a hub id, or a local folder laid
out as a hub dataset repository (data files, optionally a README.md whose YAML header lists
``configs:`` with their ``data_files``) — the same call either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

from nemo_like.data.errors import DataError
from nemo_like.data.jsonl import jsonl_rows
from nemo_like.data.messages import conversation_problem, is_conversation

__all__ = ["LOCAL_FORMATS", "check_prompt_column", "load_hub", "load_local"]

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_hub(name: str, subset: str | None, split: str) -> datasets.Dataset:
    """Split ``split`` of subset ``subset`` (the hub's config name, e.g. gsm8k's ``main``; None: the
    dataset's only one) of the hub dataset ``name``."""
    if not name:
        raise DataError("hf:: missing dataset name after 'hf:'")
    what = f"split '{split}'" + (f" of subset '{subset}'" if subset is not None else "")
    try:
        ds = datasets.load_dataset(path=name, name=subset, split=split)
    except Exception as e:  # network, auth, unknown name/subset/split: all reported the same way
        # datasets speaks of "configs" for subsets, both when one is missing and when it is unknown.
        said = " ".join(str(e).split())  # one line: datasets spreads its advice over several
        lowered, hint = said.lower(), ""
        if "config" in lowered:
            hint = "; set the dataset's subset key to one of them (data.train.subset=NAME)"
        elif "split" in lowered:
            hint = "; set the dataset's split key to one of them (data.train.split=NAME)"
        raise DataError(f"hf:{name}: could not load {what} ({type(e).__name__}: {said}){hint}") from e
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"hf:{name}: {what} did not give a single dataset (got {type(ds).__name__})")
    return ds


def load_local(path: str, prompt_column: str) -> datasets.Dataset:
    """A local .jsonl/.json/.parquet/.csv file; JSON is checked line by line first (a malformed line or
    conversational prompt in ``prompt_column`` is named by its line number)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: file not found" if not p.exists() else f"{path}: not a regular file")
    fmt = LOCAL_FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{path}: unsupported file type '{p.suffix}' (expected one of {sorted(LOCAL_FORMATS)})"
        )
    if p.suffix.lower() == ".jsonl":
        _validate_jsonl(p, prompt_column)
    elif p.suffix.lower() == ".json":
        _validate_json(p, prompt_column)
    try:
        ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
    except Exception as e:  # e.g. inconsistent column types; datasets' own message is kept
        raise DataError(f"{path}: could not load as {fmt} ({type(e).__name__}: {e})") from e
    if len(ds) == 0:
        raise DataError(f"{path}: no rows")
    return ds


class _PromptForms:
    """Whether each row's prompt is text or a conversation: one form per dataset, every conversation
    well formed. ``where`` names the row in errors (``file:line``, ``file: item 3``, ``source: row 3``)."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.first: tuple[bool, str] | None = None  # (is a conversation, where) of the first row that has it

    def check(self, row: dict[str, Any], where: str) -> None:
        if row.get(self.column) is None:
            return  # a missing column or null prompt is reported with the other columns, by name
        value = row[self.column]
        conversation = is_conversation(value)
        if self.first is None:
            self.first = (conversation, where)
        elif conversation != self.first[0]:
            forms = ("a list of messages", "text")
            raise DataError(f"{where}: column '{self.column}' is {forms[not conversation]} here but "
                            f"{forms[not self.first[0]]} at {self.first[1]}; use one form for every row")
        if conversation and (problem := conversation_problem(value)) is not None:
            raise DataError(f"{where}: column '{self.column}' is not a valid conversation: {problem} "
                            '(expected [{"role": "system"|"user"|"assistant", "content": "..."}, ...])')


def check_prompt_column(ds: datasets.Dataset, column: str, source: str) -> bool:
    """Whether ``column`` holds conversations (lists of messages) rather than text; DataError naming the
    row when the rows mix both or a conversation is malformed."""
    if column not in ds.column_names:
        return False
    forms = _PromptForms(column)
    for i, value in enumerate(ds[column]):
        forms.check({column: value}, f"{source}: row {i}")
    return forms.first is not None and forms.first[0]


def _validate_jsonl(path: Path, prompt_column: str) -> None:
    """Check each line ourselves: datasets' JSON errors do not give the offending line number."""
    rows = 0
    forms = _PromptForms(prompt_column)
    for lineno, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        forms.check(row, f"{path}:{lineno}")
        rows += 1
    if rows == 0:
        raise DataError(f"{path}: no rows")


def _validate_json(path: Path, prompt_column: str) -> None:
    """A .json file may hold one JSON array of objects, or be JSON Lines under another name."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip().split("\n", 1)[0]
        try:
            looks_like_lines = isinstance(json.loads(first), dict)
        except json.JSONDecodeError:
            looks_like_lines = False
        if looks_like_lines:
            _validate_jsonl(path, prompt_column)
            return
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, list):
        forms = _PromptForms(prompt_column)
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise DataError(f"{path}: item {i} of the top-level array is a {type(row).__name__}, not an object")
            forms.check(row, f"{path}: item {i}")
        if not data:
            raise DataError(f"{path}: no rows")
    elif not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
