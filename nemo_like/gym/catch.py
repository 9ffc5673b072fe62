"""Catch: a tiny image-observation game (bsuite's classic), written here so the CNN trunk has a task
that needs no compiler, no ROMs and no download.

A ball starts in the top row of a ``rows x columns`` board, in a column chosen by the reset seed, and
falls one row per step; the paddle sits in the bottom row and moves left, stays or moves right
(actions 0, 1, 2). When the ball reaches the bottom row the episode ends with reward +1 if the paddle
is under it, else -1. The observation is the board as a float image ``[1, rows, columns]`` (ball and
paddle are 1.0); with ``with_vector=True`` it is ``{"image": ..., "vector": [paddle column, time]}``
(both scaled to [0, 1]), the image-plus-vector case of the CNN trunk.

A random policy catches about one ball in ``columns``; a learned one catches all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nemo_like.gym.step_env import ObsSpec, StepEnvironment

__all__ = ["CatchEnvironment"]


class CatchEnvironment(StepEnvironment):
    def __init__(self, rows: int = 10, columns: int = 5, with_vector: bool = False,
                 max_episode_steps: int | None = None) -> None:
        if rows < 3 or columns < 2:
            raise ValueError(f"Catch needs rows >= 3 and columns >= 2, got rows={rows}, columns={columns}")
        self.rows, self.columns, self.with_vector = int(rows), int(columns), bool(with_vector)
        self.max_episode_steps = max_episode_steps
        self._ball = (0, 0)
        self._paddle = 0
        self._t = 0
        self._done = True

    def spec(self) -> ObsSpec:
        return ObsSpec(num_actions=3, vector_dim=2 if self.with_vector else 0,
                       image_shape=(1, self.rows, self.columns))

    def _obs(self) -> Any:
        board = np.zeros((1, self.rows, self.columns), dtype=np.float32)
        board[0, self._ball[0], self._ball[1]] = 1.0
        board[0, self.rows - 1, self._paddle] = 1.0
        if not self.with_vector:
            return board
        vector = np.array([self._paddle / (self.columns - 1), self._t / (self.rows - 1)], dtype=np.float32)
        return {"image": board, "vector": vector}

    def reset(self, seed: int) -> Any:
        rng = np.random.default_rng(int(seed))
        self._ball = (0, int(rng.integers(self.columns)))
        self._paddle = self.columns // 2
        self._t = 0
        self._done = False
        return self._obs()

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        if self._done:
            raise RuntimeError("Catch: step() after the episode ended; call reset(seed) first")
        if action not in (0, 1, 2):
            raise ValueError(f"Catch: action must be 0 (left), 1 (stay) or 2 (right), got {action!r}")
        self._paddle = min(max(self._paddle + int(action) - 1, 0), self.columns - 1)
        self._ball = (self._ball[0] + 1, self._ball[1])
        self._t += 1
        terminated = self._ball[0] == self.rows - 1
        reward = (1.0 if self._ball[1] == self._paddle else -1.0) if terminated else 0.0
        truncated = not terminated and self.max_episode_steps is not None and self._t >= self.max_episode_steps
        self._done = terminated or truncated
        return self._obs(), reward, terminated, truncated, {}
