"""Prefix caching for the continuous engine: the next turn of an episode reuses its KV cache.

A multi-turn episode's next prompt is its last prompt, the tokens generated for it, and the
environment's observation. Prefilling it from scratch recomputes every earlier token (on the
multi-env default's tool episodes, ~90 of a second turn's ~110 prompt tokens). When a request ends,
the engine puts the KV of the tokens it holds (the prompt and all generated tokens but the last
sampled one) in this cache, keyed by those tokens; a later prompt that starts with a cached key
prefills only the rest on top of it. Exact-prefix matches only, so the result is what a full
prefill computes (up to float rounding of the different shapes).

KV depends on the weights: ``sync(model)`` empties the cache when any parameter was written since
(an optimizer step, a checkpoint load, a refit: each bumps the tensors' version counters). The cache
holds at most ``max_tokens`` tokens, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, tokens, dim]


def make_prefix_cache(policy_config) -> PrefixCache | None:
    """The prefix cache a worker keeps for its model (None: off, or the engine is not continuous)."""
    g = policy_config.generation
    tokens = g.prefix_cache_tokens
    if tokens is None:  # a batch's worth of full rows
        tokens = (g.max_num_seqs or policy_config.generation_batch_size) * policy_config.max_total_sequence_length
    return PrefixCache(tokens) if tokens and g.engine == "continuous" else None


def weights_fingerprint(model) -> tuple:
    """Changes whenever a parameter is written in place (PyTorch counts writes per tensor)."""
    out = []
    for p in model.parameters():
        local = p._local_tensor if hasattr(p, "_local_tensor") else p  # an FSDP2 DTensor's own shard
        out.append((id(p), local._version))
    return tuple(out)


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.lengths: dict[int, int] = {}  # key length -> entries of that length
        self.tokens = 0
        self._fingerprint: tuple | None = None
        self.hits = self.hit_tokens = self.lookups = 0

    def sync(self, model) -> None:
        fp = weights_fingerprint(model)
        if fp != self._fingerprint:
            self.clear()
            self._fingerprint = fp

    def clear(self) -> None:
        self.entries.clear()
        self.lengths.clear()
        self.tokens = 0

    def put(self, key: tuple[int, ...], kv: KV) -> None:
        n = len(key)
        if not n or n > self.max_tokens or key in self.entries:
            return
        while self.tokens + n > self.max_tokens:
            self._drop(next(iter(self.entries)))
        self.entries[key] = kv
        self.lengths[n] = self.lengths.get(n, 0) + 1
        self.tokens += n

    def take(self, ids: list[int]) -> tuple[int, KV] | None:
        """The longest cached strict prefix of ``ids`` (at least one token is left to prefill), removed
        from the cache (the next turn puts back a longer one); None if there is none."""
        self.lookups += 1
        for n in sorted((n for n in self.lengths if n < len(ids)), reverse=True):
            key = tuple(ids[:n])
            if key in self.entries:
                kv = self.entries[key]
                self._drop(key)
                self.hits += 1
                self.hit_tokens += n
                return n, kv
        return None

    def _drop(self, key: tuple[int, ...]) -> None:
        del self.entries[key]
        n = len(key)
        self.tokens -= n
        self.lengths[n] -= 1
        if not self.lengths[n]:
            del self.lengths[n]


def cached_prefill_inputs(new_cache, kvs: list[KV], cached: torch.Tensor, suffixes: list[torch.Tensor],
                          pad_id: int, device: torch.device):
    """A batch cache holding each row's cached KV (left padded to the longest), and the rows' uncached
    suffixes (left padded too): (cache, ids [k, S], positions [k, S], mask [k, P + S])."""
    k = len(kvs)
    P, S = int(cached.max()), max(len(s) for s in suffixes)
    cache = new_cache()
    for layer in range(len(kvs[0])):
        k0, v0 = kvs[0][layer]
        keys = k0.new_zeros((k, k0.shape[0], P, k0.shape[2]))
        values = v0.new_zeros((k, v0.shape[0], P, v0.shape[2]))
        for j, kv in enumerate(kvs):
            n = kv[layer][0].shape[1]
            keys[j, :, P - n :], values[j, :, P - n :] = kv[layer]
        cache.update(keys, values, layer)
    ids = torch.full((k, S), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((k, P + S), dtype=torch.bool, device=device)
    pos = torch.zeros((k, S), dtype=torch.long, device=device)
    for j, suf in enumerate(suffixes):
        n, c = len(suf), int(cached[j])
        ids[j, S - n :] = suf
        mask[j, P - c : P] = True
        mask[j, P + S - n :] = True
        pos[j, S - n :] = torch.arange(c, c + n, device=device)
    return cache, ids, pos, mask
