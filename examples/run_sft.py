"""Build the embedded default base model: `uv run examples/run_sft.py [--config PATH] [key=value ...]`

Runs the `bootstrap:` section of a GRPO config (default: examples/configs/grpo_math_tiny.yaml): a
tiny char-level Llama and tokenizer saved as a normal HF folder, then a short supervised run through
the same Policy/worker code as GRPO (NLL on the assistant answer) that teaches it the `\\boxed{N}`
answer format. The result is cached by the section's contents; `run_grpo_math.py` calls the same
code on first use, so running this first is optional. Prints the model folder and its greedy
held-out accuracy.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from nemo_like.cli import run_cli

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_tiny.yaml"


def main(argv: list[str]) -> int:
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import ConfigError

    def run(config) -> None:
        if config.bootstrap is None or not config.bootstrap.enabled:
            raise ConfigError("bootstrap.enabled is false: this config uses policy.model_name "
                              f"{config.policy.model_name!r} as its base model, there is nothing to build")
        t0 = time.perf_counter()
        # setup() builds (or finds) the base model, then loads it as a GRPO policy; checkpoints and
        # resume are off so this never touches a GRPO run's directories.
        config = config.model_copy(update={
            "checkpointing": config.checkpointing.model_copy(update={"enabled": False})})
        trainer = setup(config, resume=False)
        try:
            acc = trainer.validate().get("val/accuracy")
            print(f"[nemo_like] base model: {trainer.config.policy.model_name}")
            if acc is not None:
                print(f"[nemo_like] greedy held-out accuracy {acc:.1%} "
                      f"({int(trainer.last_val_metrics['val/num_samples'])} problems)")
            print(f"[nemo_like] wall time {time.perf_counter() - t0:.0f} s")
        finally:
            trainer.close()

    return run_cli(argv, DEFAULT_CONFIG, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
