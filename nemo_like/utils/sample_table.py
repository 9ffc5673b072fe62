"""A validation's samples as a table, for the loggers that show tables: wandb (a ``wandb.Table``) and
TensorBoard (a markdown table in its Text tab). One row per sample, its step first, then the sample
rows' own fields (task, problem, prompt, completion, reward, ground truth, ...) in the order they
first appear."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_like.utils.jsonl_files import json_safe

# The tag / key a validation's table is logged under in TensorBoard and wandb.
VAL_SAMPLES_TAG = "val/samples"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "str" if isinstance(value, str) else "other"


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, allow_nan=False)


def sample_table(rows: Sequence[Mapping[str, Any]], step: int) -> tuple[list[str], list[list[Any]]]:
    """``(columns, data)``: ``step`` and every field of ``rows``, one list per row; a field a row lacks
    is None. A column whose values are not all numbers, all bools or all text (a ground truth that is
    a number in one row and a list in another) holds every value as text (JSON), since a wandb table
    refuses a column of mixed types; a value JSON cannot hold is made plain first (NaN as None)."""
    columns: list[str] = ["step"]
    for row in rows:
        columns += [str(k) for k in row if str(k) not in columns]
    cells = [[int(step)] + [json_safe(row.get(c)) for c in columns[1:]] for row in rows]
    for j in range(1, len(columns)):
        kinds = {_kind(r[j]) for r in cells if r[j] is not None}
        if len(kinds) > 1 or kinds == {"other"}:
            for r in cells:
                r[j] = None if r[j] is None else _as_text(r[j])
    return columns, cells


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isfinite(value):
        text = f"{value:.4g}"
    else:
        text = str(value)
    # Literal text in a cell: HTML and markdown characters escaped, a line break as <br> (a newline
    # would end the table row), a pipe escaped (it would end the cell).
    text = html.escape(text, quote=False)
    for ch in "\\`*_[]|#":
        text = text.replace(ch, "\\" + ch)
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(columns: Sequence[str], data: Sequence[Sequence[Any]]) -> str:
    """A markdown table of ``sample_table``'s result, as TensorBoard's Text tab renders it."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)
