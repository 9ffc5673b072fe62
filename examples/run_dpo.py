"""DPO. `uv run examples/run_dpo.py [--config PATH] [key=value ...]`

With no arguments it runs DPO on the tiny math work (examples/configs/dpo_math_tiny.yaml): the
default's bootstrapped char-level base model, on pairs of the right and a wrong boxed answer to the
same addition, then prints the held-out pair accuracy and the greedy accuracy on 500 held-out
problems before -> after (with McNemar's test, the line a GRPO run ends with), and saves the policy as
an HF folder. The policy's workers are placed as a GRPO run's are; the plan is printed first.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.algorithms.dpo import accuracy_line, load_dpo_config, train_dpo
from nemo_like.algorithms.trainer_base import steps_trained
from nemo_like.cli import run_cli

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "dpo_math_tiny.yaml"


def run(config) -> int:
    r = train_dpo(config)
    first, last = r["first"], r["last"]
    per_step = r["seconds_per_step"]
    speed = f" ({sum(per_step) / len(per_step):.2f} s/step)" if per_step else ""
    print(f"[nemo_like] held-out pair accuracy {first['val/pair_accuracy']:.1%} -> {last['val/pair_accuracy']:.1%} "
          f"({r['val_pairs']} pairs), reward margin {first['val/reward_margin']:.3f} -> "
          f"{last['val/reward_margin']:.3f}; " + steps_trained(r["resumed_at"], r["steps"]) + f" on {r['train_pairs']} pairs in "
          f"{r['seconds']:.0f} s{speed}; saved to {r['output_dir']}")
    if r["truncated_pairs"]:
        print(f"[nemo_like] {r['truncated_pairs']} pairs had a side cut to data.max_length tokens")
    print(f"[nemo_like] {accuracy_line(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:], DEFAULT_CONFIG, run, loader=load_dpo_config))
