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
        if "epoch" not in state:
            raise ValueError("sampler state is not that of a plain epoch sampler (a task mixture's?)")
        if state.get("n", self.n) != self.n:
            raise ValueError(f"sampler state is for a dataset of {state['n']} rows, this one has {self.n}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class MixtureSampler:
    """Draws from several datasets laid end to end (``sizes``) in the proportions ``weights``,
    each dataset in its own shuffled epochs. Which dataset the t-th call's draws come from depends
    only on (seed, t), so the state to resume is the call count and the per-dataset samplers."""

    def __init__(self, sizes: list[int], weights: list[float], *, seed: int):
        if not sizes or len(sizes) != len(weights):
            raise ValueError(f"need one weight per dataset, got {len(weights)} weights for {len(sizes)} datasets")
        if any(w <= 0 for w in weights):
            raise ValueError(f"sampling weights must be > 0, got {weights}")
        self.seed, self.calls = seed, 0
        total = float(sum(weights))
        self.p = np.array([w / total for w in weights])
        self.offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self.parts = [EpochSampler(n, seed=seed + 1 + k) for k, n in enumerate(sizes)]

    @property
    def epoch(self) -> int:
        """Full passes over the dataset that has been least covered."""
        return min(s.epoch for s in self.parts)

    def next_indices(self, k: int) -> list[int]:
        which = np.random.default_rng([self.seed, self.calls]).choice(len(self.parts), size=k, p=self.p)
        self.calls += 1
        return [self.offsets[d] + self.parts[d].next_indices(1)[0] for d in which.tolist()]

    def state_dict(self) -> dict:
        return {"calls": self.calls, "seed": self.seed, "parts": [s.state_dict() for s in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("parts")
        if parts is None or len(parts) != len(self.parts):
            raise ValueError("sampler state is not that of a mixture over these datasets")
        for s, st in zip(self.parts, parts):
            s.load_state_dict(st)
        self.calls = int(state["calls"])
