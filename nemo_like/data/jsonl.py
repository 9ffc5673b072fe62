"""Reading JSON Lines files the one way every data file is read: each line's own number in errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nemo_like.data.errors import DataError

__all__ = ["jsonl_rows"]


def jsonl_rows(path: str | Path, opener: Callable[..., Any] = open) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of ``path``. DataError ``<path>:<line>: invalid
    JSON (...)`` for a line that is not JSON, ``<path>: not UTF-8 text`` for bytes that are not text.
    ``opener``: ``gzip.open`` for a compressed file."""
    # newline="\n": lines as JSON Lines defines them (a stray "\r" inside a line is not a line break).
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    # Parsed without the line ending, so that error columns point into the line itself.
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
                yield lineno, value
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e})") from None
