"""A slow CartPole for the gym functional tests (a module beside the tests: importable in Ray actors)."""

from __future__ import annotations

import time

from nemo_like.gym.step_env import GymnasiumEnvironment


class SlowCartPole(GymnasiumEnvironment):
    """CartPole-v1 with a 2 ms wait per step, so an update lasts long enough to kill a collector in it."""

    def __init__(self, max_episode_steps: int | None = None, **kwargs) -> None:
        super().__init__("CartPole-v1", max_episode_steps=max_episode_steps, **kwargs)

    def step(self, action: int):
        time.sleep(0.002)
        return super().step(action)
