"""On-policy distillation. `uv run examples/run_distillation.py [--config PATH] [key=value ...]`

A GRPO run with a `teacher:` section: the student (the policy) samples, the frozen teacher scores each
sampled token, and the student learns from the gap (docs/guides/distillation.md). With no arguments
it runs examples/configs/distill_math_tiny.yaml: the default GRPO run's trained model, exported, is
the teacher, and the embedded base model it started from is the student. Make the teacher first:

    uv run examples/run_grpo_math.py
    uv run examples/export_model.py --checkpoint results/grpo_math_tiny/step_250 --out results/teacher_math_tiny
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.cli import run_cli, run_grpo
from nemo_like.config import ConfigError, load_config

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "distill_math_tiny.yaml"
DEFAULT_TEACHER = "results/teacher_math_tiny"


def load(path: str, overrides: list[str]):
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        if f"teacher.model_name: {DEFAULT_TEACHER}: no such model folder" not in str(e):
            raise
        raise ConfigError(f"teacher.model_name: {DEFAULT_TEACHER} does not exist yet: train and export the teacher "
                          "first (uv run examples/run_grpo_math.py, then uv run examples/export_model.py "
                          f"--checkpoint results/grpo_math_tiny/step_250 --out {DEFAULT_TEACHER}), or name your "
                          "own with teacher.model_name=...") from None


def main(argv: list[str]) -> int:
    return run_cli(argv, DEFAULT_CONFIG, run_grpo, loader=load)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
