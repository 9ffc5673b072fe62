"""Reward-model training. `uv run examples/run_rm.py [--config PATH] [key=value ...]`

With no arguments it trains a reward model on the tiny math work (examples/configs/rm_math_tiny.yaml):
the default's bootstrapped char-level base model with a scalar head, on pairs of a right and a wrong
answer to the same addition, then reports held-out pair accuracy and saves the model as an HF folder.
Its workers are placed as a GRPO run's policy workers are (cluster.num_workers, or cluster.resource_pools
with cluster.roles.policy), and the plan is printed before the model loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.algorithms.rm import load_rm_config, train_reward_model
from nemo_like.algorithms.trainer_base import steps_trained
from nemo_like.cli import run_cli

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "rm_math_tiny.yaml"


def run(config) -> int:
    r = train_reward_model(config)
    first, last = r["first"], r["last"]
    print(f"[nemo_like] held-out pair accuracy {first['val/pair_accuracy']:.1%} -> {last['val/pair_accuracy']:.1%} "
          f"({r['val_pairs']} pairs), margin {first['val/margin']:.3f} -> {last['val/margin']:.3f}; "
          + steps_trained(r["resumed_at"], r["steps"]) + f" on {r['train_pairs']} pairs in {r['seconds']:.0f} s; saved to {r['output_dir']}")
    if r["truncated_pairs"]:
        print(f"[nemo_like] {r['truncated_pairs']} pairs had a side cut to data.max_length tokens")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:], DEFAULT_CONFIG, run, loader=load_rm_config))
