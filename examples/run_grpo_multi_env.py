"""GRPO on several tasks at once. `uv run examples/run_grpo_multi_env.py [--config PATH] [key=value ...]`

With no arguments it runs examples/configs/grpo_multi_env_tiny.yaml: one tiny char-level Llama,
SFT-bootstrapped locally on all three formats, trained by GRPO on math, code and tool-calling tasks,
each graded by its own Ray actor environment. Per-task accuracy is printed before and after.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.cli import run_cli, run_grpo

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_multi_env_tiny.yaml"


def main(argv: list[str]) -> int:
    return run_cli(argv, DEFAULT_CONFIG, run_grpo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
