"""A resumable, seeded epoch sampler: its whole state is (epoch, position)."""

from __future__ import annotations

import numpy as np


class EpochSampler:
    def __init__(self, dataset_len: int, *, seed: int, shuffle: bool = True):
        if dataset_len <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.seed, self.shuffle = dataset_len, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        # The order of epoch e depends only on (seed, e), so resuming needs no saved permutation.
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_indices(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            take = min(k - len(out), self.n - self.position)
            out.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n", self.n) != self.n:
            raise ValueError(f"sampler state is for a dataset of {state['n']} rows, this one has {self.n}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
