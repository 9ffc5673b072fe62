"""Supervised fine-tuning on chat data: `uv run examples/run_sft.py [--config PATH] [key=value ...]`

With no arguments it runs examples/configs/sft_math_tiny.yaml: the default's bootstrapped tiny model
taught a second turn of arithmetic from the chats in examples/your_data/sft_math_*.jsonl (one
{"messages": [{"role": ..., "content": ...}, ...]} object per line; an `hf:` dataset with a messages
column works too). The loss is on the assistant's tokens only, every turn; the held-out per-token NLL
(val/loss) is printed before and after, and the model is saved to output_dir as a plain HF folder.
Packing and LoRA are the policy's (policy.sequence_packing, policy.lora); running the same command
again resumes from the newest checkpoint. docs/guides/sft.md has the details.

Building the tiny base model: given a GRPO config (one with a `bootstrap:` or `grpo:` section, e.g.
`--config examples/configs/grpo_math_tiny.yaml`) it does what a GRPO run does first: builds (or finds
in the cache) the config's bootstrapped base model, with the same supervised loop, and prints its folder
and greedy held-out accuracy. run_grpo_math.py does this on first use, so that step is optional.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from nemo_like.cli import run_cli

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "sft_math_tiny.yaml"


def load(path: str, overrides: list[str]) -> Any:
    """An SFT config, or a GRPO config (its `bootstrap:` section builds the base model)."""
    from nemo_like.algorithms.sft import load_sft_config
    from nemo_like.config import load_config
    from nemo_like.config_loading import load_yaml_with_defaults

    raw = load_yaml_with_defaults(path)
    if "bootstrap" in raw or "grpo" in raw:
        return load_config(path, overrides)
    return load_sft_config(path, overrides)


def run_sft(config: Any) -> int:
    from nemo_like.algorithms.sft import train_sft
    from nemo_like.algorithms.trainer_base import steps_trained

    r = train_sft(config)
    first, last = r["first"].get("val/loss"), r["last"].get("val/loss")
    trained = steps_trained(r["resumed_at"], r["steps"])
    held_out = (f"held-out loss {first:.4f} -> {last:.4f} per assistant token ({r['val_conversations']} "
                "conversations); " if first is not None else "")
    print(f"[nemo_like] {held_out}{trained} on {r['train_conversations']} conversations in {r['seconds']:.0f} s; "
          f"saved to {r['output_dir']}")
    if r["truncated"]:
        print(f"[nemo_like] {r['truncated']} conversations were cut to data.max_length tokens "
              f"({r['no_loss']} of them kept no assistant token)")
    return 0


def build_base(config: Any) -> int:
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import ConfigError

    if config.bootstrap is None or not config.bootstrap.enabled:
        raise ConfigError("bootstrap.enabled is false: this config uses policy.model_name "
                          f"{config.policy.model_name!r} as its base model, there is nothing to build")
    t0 = time.perf_counter()
    # setup() builds (or finds) the base model, then loads it as a GRPO policy; checkpoints and resume
    # are off so this never touches a GRPO run's directories.
    config = config.model_copy(update={"checkpointing": config.checkpointing.model_copy(update={"enabled": False})})
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
    return 0


def main(argv: list[str]) -> int:
    from nemo_like.algorithms.sft import SFTConfig

    return run_cli(argv, DEFAULT_CONFIG, lambda c: run_sft(c) if isinstance(c, SFTConfig) else build_base(c),
                   loader=load)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
