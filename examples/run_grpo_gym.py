"""Trajectory-level GRPO for an agent on a step environment.
`uv run examples/run_grpo_gym.py [--config PATH] [key=value ...]`

With no arguments it runs examples/configs/grpo_cartpole.yaml: an MLP actor trained on gymnasium's
CartPole-v1 by group-relative REINFORCE on whole trajectories (K episodes from one reset seed form a
group; no value function), with Ray-actor collectors, until the greedy return over 20 held-out seeds
reaches 475. Other configs: grpo_acrobot.yaml, grpo_catch.yaml (image observations, CNN).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_like.cli import run_cli, run_grpo_gym
from nemo_like.gym.config import load_gym_config

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_cartpole.yaml"


def main(argv: list[str]) -> int:
    return run_cli(argv, DEFAULT_CONFIG, run_grpo_gym, loader=load_gym_config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
