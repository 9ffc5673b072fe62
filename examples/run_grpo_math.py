"""GRPO on math. `uv run examples/run_grpo_math.py [--config PATH] [key=value ...]`

With no arguments it runs the embedded default (examples/configs/grpo_math_tiny.yaml): a tiny
char-level Llama, built and SFT-bootstrapped locally on first use, learns 2-digit addition on CPU.
The loop is `GRPOExperiment.train()`, the same object a notebook drives step by step.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.cli import run_cli, run_grpo

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_tiny.yaml"


def main(argv: list[str]) -> int:
    return run_cli(argv, DEFAULT_CONFIG, run_grpo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
