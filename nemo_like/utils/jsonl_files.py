"""The JSONL files of a run's log folder (metrics.jsonl, samples.jsonl): opening one for appending after
a crash, rewriting one atomically, the name an earlier run's file is set aside under, values made
JSON-safe, and reading metrics back."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METRICS_FILENAME", "aside_name", "json_safe", "open_jsonl_for_append", "read_metrics_jsonl",
           "replace_lines"]

METRICS_FILENAME = "metrics.jsonl"


def open_jsonl_for_append(path: Path):
    """``path`` opened for appending lines."""
    # A crash can leave a half-written last line; appending after it would glue the next
    # record onto garbage, so cut the file back to its last complete line first.
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb+") as f:
            data = f.read()
            if not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                warnings.warn(
                    f"{path}: dropping a truncated last line ({len(data) - keep} bytes) left by an "
                    "interrupted run before appending",
                    stacklevel=3,
                )
                f.truncate(keep)
    return open(path, "a", encoding="utf-8")


def replace_lines(path: Path, lines: list[str]) -> None:
    """``path`` holding ``lines``, atomically: a temp file written and synced, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def aside_name(path: Path, n: int) -> Path:
    """``<stem>.prev<n><suffix>`` beside ``path``."""
    return path.with_name(f"{path.stem}.prev{n}{path.suffix}")


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: non-finite floats as null, numpy and torch
    scalars as numbers, tensors and arrays as lists, tuples as lists, keys as strings, anything else
    that is not a JSON type as its ``str``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic | np.ndarray) or hasattr(value, "tolist"):
        try:
            return json_safe(value.tolist())
        except Exception:  # a tolist that does not give plain values: fall through to str
            pass
    return str(value)


def read_metrics_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file (one JSON object per line; blank lines ignored)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILENAME
    if not path.exists():
        raise FileNotFoundError(f"metrics file not found: {path}")
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line: {e.msg}") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records
