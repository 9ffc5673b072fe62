"""Balancing tokens over data-parallel shards: a permutation inside each global batch, groups kept whole."""

from __future__ import annotations

import pytest
import torch

from nemo_like.distributed.balance import balanced_permutation, prompt_group_size, shard_token_imbalance
from nemo_like.distributed.batched_data_dict import BatchedDataDict


def test_long_groups_are_split_over_the_shards_within_each_global_batch():
    # Two global batches of 8 = 4 groups of 2; shard 0 would get both long groups of each batch.
    lengths = torch.tensor([50, 52, 48, 50, 5, 6, 4, 5] + [30, 30, 31, 29, 10, 10, 9, 11])
    assert shard_token_imbalance(lengths, 2, 8) > 1.5
    perm = balanced_permutation(lengths, 2, batch_size=8, unit=2)
    assert sorted(perm.tolist()) == list(range(16))
    assert set(perm[:8].tolist()) == set(range(8)) and set(perm[8:].tolist()) == set(range(8, 16))  # same batches
    pairs = perm.view(-1, 2)
    assert all(int(b) == int(a) + 1 and int(a) % 2 == 0 for a, b in pairs)  # groups stay whole, in order
    assert shard_token_imbalance(lengths[perm], 2, 8) < 1.05
    # What shard_by_batch_size then hands out: each shard one long and one short group per batch.
    shards = BatchedDataDict(input_lengths=lengths[perm]).shard_by_batch_size(2, batch_size=8)
    assert [int(s["input_lengths"].sum()) for s in shards] == [(102 + 9) + (60 + 20), (98 + 11) + (60 + 20)]


def test_units_that_do_not_fit_a_shard_move_as_single_samples_and_bad_sizes_are_refused():
    lengths = torch.tensor([9, 9, 9, 1, 1, 1])
    perm = balanced_permutation(lengths, 2, unit=3)  # 3 samples a shard: a group of 3 would fit, kept
    assert perm.tolist() == [0, 1, 2, 3, 4, 5]
    perm = balanced_permutation(lengths, 3, unit=3)  # 2 a shard: single samples, 9 + 1 each
    assert sorted(lengths[perm].view(3, 2).sum(dim=1).tolist()) == [10, 10, 10]
    with pytest.raises(ValueError, match="do not make global batches"):
        balanced_permutation(lengths, 4)


def test_prompt_groups_are_read_from_the_tokens_before_the_first_loss_token():
    ids = torch.tensor([[1, 2, 7, 0], [1, 2, 8, 8], [3, 4, 9, 0], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1]])
    assert prompt_group_size(ids, mask) == 2
    mask[3] = torch.tensor([0, 0, 0, 1])  # the last sample's prompt is longer: runs of 2, 1, 1
    assert prompt_group_size(ids, mask) == 1
    assert prompt_group_size(ids, None) == 1
