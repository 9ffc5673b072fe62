"""GRPO on several tasks at once. `uv run examples/run_grpo_multi_env.py [--config PATH] [key=value ...]`

With no arguments it runs examples/configs/grpo_multi_env_tiny.yaml: one tiny char-level Llama,
SFT-bootstrapped locally on all three formats, trained by GRPO on math, code and tool-calling tasks,
each graded by its own Ray actor environment. Per-task accuracy is printed before and after.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from nemo_like.cli import run_cli

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_multi_env_tiny.yaml"


def main(argv: list[str]) -> int:
    from nemo_like.algorithms.grpo import accuracy_summary, grpo_train, per_task_summary, setup
    from nemo_like.utils.plotting import save_training_curves

    def run(config) -> None:
        t0 = time.perf_counter()
        trainer = setup(config)
        try:
            grpo_train(trainer)
            png = save_training_curves(trainer.history, Path(config.logger.log_dir) / "curves.png")
            print(f"[nemo_like] {accuracy_summary(trainer)}")
            for line in per_task_summary(trainer):
                print(f"[nemo_like]   {line}")
            print(f"[nemo_like] {trainer.step_count} steps, wall time {time.perf_counter() - t0:.0f} s; "
                  f"metrics: {Path(config.logger.log_dir) / 'metrics.jsonl'}; curves: {png}")
        finally:
            trainer.close()

    return run_cli(argv, DEFAULT_CONFIG, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
