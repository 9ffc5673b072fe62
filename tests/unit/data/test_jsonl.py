"""The one JSON Lines reader every data file goes through: line numbers, columns, blank lines, bytes
that are not text, and the readers that use it (preference pairs here)."""

from __future__ import annotations

import gzip

import pytest

from nemo_like.data.errors import DataError
from nemo_like.data.jsonl import jsonl_rows
from nemo_like.data.preferences import load_preference_pairs


def test_rows_keep_their_own_line_numbers(tmp_path):
    p = tmp_path / "rows.jsonl"
    # A blank line, a "\r" inside a string (not a line break in JSON Lines), CRLF endings.
    p.write_bytes(b'{"a": 1}\r\n\n{"a": "x\\ry"}\n  \n[2]\n')
    assert list(jsonl_rows(p)) == [(1, {"a": 1}), (3, {"a": "x\ry"}), (5, [2])]
    z = tmp_path / "rows.jsonl.gz"
    with gzip.open(z, "wt", encoding="utf-8") as f:
        f.write('{"a": 1}\n\n{"b": 2}\n')
    assert list(jsonl_rows(z, gzip.open)) == [(1, {"a": 1}), (3, {"b": 2})]


def test_bad_lines_and_bytes_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 1,}\n')
    with pytest.raises(DataError, match=rf"^{p}:3: invalid JSON \(Expecting property name enclosed in double "
                                        r"quotes at column 9\)$"):
        list(jsonl_rows(p))
    p.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{p}: not UTF-8 text"):
        list(jsonl_rows(p))
    # A preference file of such bytes: the same one-line error, not a UnicodeDecodeError traceback.
    with pytest.raises(DataError, match=rf"^{p}: not UTF-8 text"):
        load_preference_pairs(p)
