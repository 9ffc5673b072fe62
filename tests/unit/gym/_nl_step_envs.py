"""Step environments for the collector tests: importable by path in Ray actors (a module beside the tests)."""

from __future__ import annotations

import math
import time

import numpy as np

from nemo_like.gym.step_env import ObsSpec, StepEnvironment


class CountdownEnv(StepEnvironment):
    """Observation [seed % 7, t]; the episode lasts ``1 + seed % length_mod`` steps, reward 1 per step
    (so a trajectory's length and return are known from its seed)."""

    def __init__(self, length_mod: int = 5, sleep_s: float = 0.0, fail_seed: int | None = None,
                 bad: str = "raise", max_episode_steps: int | None = None) -> None:
        self.length_mod, self.sleep_s, self.fail_seed, self.bad = length_mod, sleep_s, fail_seed, bad
        self.seed, self.t = 0, 0

    def spec(self) -> ObsSpec:
        return ObsSpec(num_actions=2, vector_dim=2)

    def _obs(self) -> np.ndarray:
        return np.array([self.seed % 7, self.t], dtype=np.float32)

    def reset(self, seed: int) -> np.ndarray:
        self.seed, self.t = int(seed), 0
        return self._obs()

    def step(self, action: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.t += 1
        if self.fail_seed is not None and self.seed == self.fail_seed and self.t == 2:
            if self.bad == "raise":
                raise RuntimeError("simulator exploded")
            if self.bad == "nan":
                return self._obs(), math.nan, False, False, {}
            if self.bad == "huge":  # finite as a Python float, inf as a float32
                return self._obs(), 1e39, False, False, {}
            if self.bad == "shape":
                return np.zeros(3, dtype=np.float32), 1.0, False, False, {}
            if self.bad == "nan_obs":
                return np.array([np.nan, 1.0], dtype=np.float32), 1.0, False, False, {}
            if self.bad == "hang":
                time.sleep(3600)
            if self.bad == "text_obs":
                return np.array(["a", "b"]), 1.0, False, False, {}
        done = self.t >= 1 + self.seed % self.length_mod
        if self.bad == "huge_sum" and self.seed == self.fail_seed:  # each in float32's range, their sum not
            return self._obs(), 3e38, done, False, {}
        return self._obs(), 1.0, done, False, {}


class InPlaceBufferEnv(CountdownEnv):
    """Hands out the same array every step, changed in place (as some simulators do)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._buf = np.zeros(2, dtype=np.float32)

    def _obs(self) -> np.ndarray:
        self._buf[:] = (self.seed % 7, self.t)
        return self._buf
