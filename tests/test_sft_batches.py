"""SFT batch making: length grouping keeps every sample exactly once and pads far less."""

from __future__ import annotations

import random

from nemo_like.algorithms.sft import _batches
from nemo_like.data.sampler import EpochSampler


def test_group_by_length_serves_each_sample_once_in_similar_length_batches():
    rng = random.Random(0)
    data = [{"id": i, "length": rng.choice([30, 60, 110]) + rng.randrange(5)} for i in range(64)]
    plain = _batches(data, EpochSampler(64, seed=1), 8, False, random.Random(1))
    grouped = _batches(data, EpochSampler(64, seed=1), 8, True, random.Random(1))
    plain_batches = [next(plain) for _ in range(8)]
    grouped_batches = [next(grouped) for _ in range(8)]
    for batches in (plain_batches, grouped_batches):
        assert sorted(d["id"] for b in batches for d in b) == list(range(64))  # one epoch, nothing lost
        assert all(len(b) == 8 for b in batches)

    def padded_tokens(batches):
        return sum(len(b) * max(d["length"] for d in b) for b in batches)

    assert padded_tokens(grouped_batches) < 0.8 * padded_tokens(plain_batches)
    # batches are served in shuffled order, not shortest first
    maxima = [max(d["length"] for d in b) for b in grouped_batches]
    assert maxima != sorted(maxima)
