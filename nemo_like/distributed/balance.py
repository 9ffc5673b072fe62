"""Balancing a batch's tokens over data-parallel workers (verl's ``balance_batch``).

``shard_by_batch_size`` gives worker i the i-th contiguous piece of every global batch, so a worker
whose piece holds the long samples works while the others wait at the next collective. A permutation
inside each global batch fixes that: the samples, or whole groups of samples that share a prompt
(packing computes a group's prompt once on the worker that holds it), go to the workers by the
longest-first greedy rule (the largest unit to the least loaded worker with room left), every worker
keeping its equal count. Samples never leave their global batch, so each optimizer step sees the
same samples and, the loss being normalised by global counts, makes the same update.
"""

from __future__ import annotations

import torch

__all__ = ["balance_over_shards", "balanced_permutation", "prompt_group_size", "shard_token_imbalance"]


def balanced_permutation(lengths: torch.Tensor, shards: int, batch_size: int | None = None,
                         unit: int = 1) -> torch.Tensor:
    """Indices that reorder samples of ``lengths`` [N] (tokens each) so that ``shard_by_batch_size(shards,
    batch_size)`` gives each shard about the same tokens in every global batch (``batch_size`` None: the
    whole batch is one). ``unit`` consecutive samples move together; where a shard's share of a global
    batch is not a whole number of units, single samples move instead."""
    n = lengths.numel()
    batch_size = batch_size or n
    if shards < 1 or n % batch_size or batch_size % shards:
        raise ValueError(f"{n} samples do not make global batches of {batch_size} split over {shards} shards")
    per_shard = batch_size // shards
    if unit < 1 or per_shard % unit:
        unit = 1
    order: list[int] = []
    for start in range(0, n, batch_size):
        costs = lengths[start:start + batch_size].view(-1, unit).sum(dim=1).tolist()
        load, members = [0] * shards, [[] for _ in range(shards)]
        room = per_shard // unit
        # Longest first, to the least loaded shard with room (ties: the lower shard, then the earlier unit).
        for u in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            s = min((i for i in range(shards) if len(members[i]) < room), key=lambda i: (load[i], i))
            members[s].append(u)
            load[s] += costs[u]
        for s in range(shards):
            for u in sorted(members[s]):
                order.extend(range(start + u * unit, start + (u + 1) * unit))
    return torch.tensor(order, dtype=torch.long)


def shard_token_imbalance(lengths: torch.Tensor, shards: int, batch_size: int | None = None) -> float:
    """Mean over global batches of (the most tokens any shard gets) / (the mean per shard), for the
    samples in their current order: 1.0 is perfectly even."""
    n = lengths.numel()
    batch_size = batch_size or n
    per_shard = batch_size // shards
    ratios = []
    for start in range(0, n, batch_size):
        loads = lengths[start:start + batch_size].view(shards, per_shard).sum(dim=1).double()
        ratios.append(float(loads.max() / loads.mean().clamp(min=1e-9)))
    return sum(ratios) / len(ratios)


def prompt_group_size(input_ids: torch.Tensor, token_mask: torch.Tensor | None) -> int:
    """The length of the runs of consecutive samples sharing a prompt (the tokens before a sample's
    first loss token), when every run has the same length; else 1."""
    n = input_ids.shape[0]
    if token_mask is None or n == 0:
        return 1
    has = token_mask.bool().any(dim=1)
    first = torch.where(has, token_mask.bool().int().argmax(dim=1), torch.zeros_like(has, dtype=torch.long))
    runs, current = [], 1
    for i in range(1, n):
        p = int(first[i])
        same = p > 0 and p == int(first[i - 1]) and torch.equal(input_ids[i, :p], input_ids[i - 1, :p])
        if same:
            current += 1
        else:
            runs.append(current)
            current = 1
    runs.append(current)
    return runs[0] if len(set(runs)) == 1 else 1


def balance_over_shards(data, shards: int, batch_size: int | None = None, unit: int | None = None):
    """``data`` (a BatchedDataDict with ``input_ids``, ``input_lengths`` and, to keep prompt groups
    whole, ``token_mask``) reordered by ``balanced_permutation``, and the permutation; unchanged (and
    None) for one shard. ``unit``: rows that move together (a reward model's pair is 2); None: the
    prompt groups ``token_mask`` shows. ``data.select_indices(torch.argsort(perm))`` puts results
    back in order."""
    if shards <= 1 or "input_lengths" not in data:
        return data, None
    if unit is None:
        unit = prompt_group_size(data["input_ids"], data.get("token_mask"))
    perm = balanced_permutation(data["input_lengths"], shards, batch_size, unit)
    return data.select_indices(perm), perm
