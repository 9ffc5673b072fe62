"""docs/reference/config.md is generated from the schema and kept current: a test fails when it is stale,
and every key has a help text (the comment above its field in the source)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, Field

from nemo_like.config_reference import field_help

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "config.md"


def _generated() -> str:
    # In a fresh process: registrations other tests made in this one must not leak into the page; and
    # without $NEMO_LIKE_CACHE (CI sets it), which the cache dir's default would show.
    env = {k: v for k, v in os.environ.items() if k != "NEMO_LIKE_CACHE"}
    return subprocess.run([sys.executable, "-m", "nemo_like.config_reference"], capture_output=True, text=True,
                          check=True, cwd=ROOT, timeout=120, env=env).stdout


def test_the_committed_page_is_what_the_schema_gives():
    assert PAGE.read_text() == _generated(), \
        "docs/reference/config.md is stale: uv run python -m nemo_like.config_reference > docs/reference/config.md"


def test_every_key_has_a_type_a_default_and_help_text():
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) > 200
    bare = [row.split(" | ")[0] for row in rows if row.rstrip().endswith("|  |") and "(section)" not in row]
    assert not bare, f"keys without help text (add a comment above the field): {bare}"
    for key in ("`grpo.advantage_estimator`", "`loss_fn.policy_loss`", "`policy.generation.backend`", "`imports`"):
        assert any(row.startswith(f"| {key} |") for row in rows), key


class _Example(BaseModel):
    # Comment lines above a field
    # are its help, joined.
    a: int = 1
    b: str = "x"  # or the comment at its end
    c: float = 0.5
    d: int = Field(0, description="a description wins")  # over a comment
    d2: int = 0


def test_field_help_reads_comments_above_and_beside_fields():
    helps = field_help(_Example)
    assert helps["a"] == "Comment lines above a field are its help, joined."
    assert helps["b"] == "or the comment at its end"
    assert helps["d"] == "a description wins"
    assert "c" not in helps and "d2" not in helps
