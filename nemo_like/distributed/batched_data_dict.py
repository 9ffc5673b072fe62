"""BatchedDataDict: a dict of per-sample columns that shards by batch and re-joins.

Every value is either a ``torch.Tensor`` whose dim 0 is the batch or a ``list`` whose length is the
batch. Keeping the type this narrow is what lets sharding, slicing and concatenation be generic: any
other object (a scalar, a string, a dict) has no batch dimension to cut, so it is rejected up front
with an error naming the key instead of silently being broadcast or dropped later on a worker.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["BatchedDataDict"]


def _check_value(key: Any, value: Any) -> None:
    if not isinstance(key, str):
        raise TypeError(f"BatchedDataDict keys must be str, got {type(key).__name__} key {key!r}")
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise TypeError(
                f"BatchedDataDict value for key {key!r} is a 0-d tensor; values need a batch "
                "dimension (dim 0). Use a 1-D tensor of length batch_size instead."
            )
        return
    if isinstance(value, list):
        return
    raise TypeError(
        f"BatchedDataDict value for key {key!r} has type {type(value).__name__}; only torch.Tensor "
        "(dim 0 = batch) or list (len = batch) are allowed"
    )


def _check_positive_int(name: str, value: Any) -> int:
    # bool is an int subclass; True as a shard count is almost certainly a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class BatchedDataDict(dict):
    """A ``dict[str, Tensor | list]`` whose values share a batch dimension.

    Subscript it for annotations (``BatchedDataDict[DatumSpec]``); at runtime it is a plain dict
    subclass, so it pickles through Ray and works wherever a dict is expected.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    # --- validation on every write path (dict's C methods bypass __setitem__) ---------------
    def __setitem__(self, key: str, value: Any) -> None:
        _check_value(key, value)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    # --- size -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The batch size shared by all values (0 for an empty dict)."""
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            detail = ", ".join(f"{k!r}: {n}" for k, n in sizes.items())
            raise ValueError(f"BatchedDataDict values disagree on batch size ({detail})")
        return distinct.pop() if distinct else 0

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> BatchedDataDict:
        """Concatenate batches along dim 0.

        Tensors with 2+ dims whose dim 1 differs across batches (e.g. sequences generated to
        different lengths on different workers) are right-padded along dim 1 to the longest, with
        ``pad_value_dict.get(key, 0)``. Lists are concatenated.
        """
        if isinstance(batches, Mapping) or not isinstance(batches, Sequence) or len(batches) == 0:
            raise ValueError("from_batches needs a non-empty list of batches")
        pad_value_dict = dict(pad_value_dict or {})
        batches = [b if isinstance(b, BatchedDataDict) else cls(b) for b in batches]
        keys = list(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(keys):
                raise ValueError(
                    f"from_batches: batch {i} has keys {sorted(b.keys())} but batch 0 has {sorted(keys)}"
                )
        out = cls()
        for key in keys:
            values = [b[key] for b in batches]
            if all(isinstance(v, list) for v in values):
                out[key] = [item for v in values for item in v]
            elif all(isinstance(v, torch.Tensor) for v in values):
                out[key] = _cat_padded(key, values, pad_value_dict.get(key, 0))
            else:
                kinds = [type(v).__name__ for v in values]
                raise TypeError(f"from_batches: key {key!r} mixes tensors and lists across batches: {kinds}")
        return out

    # --- slicing / selection ----------------------------------------------------------------
    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Samples ``start:end`` (tensor values are views, not copies)."""
        size = self.size
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size):
            raise ValueError(f"slice({start!r}, {end!r}) is out of range for batch size {size}")
        return type(self)({k: v[start:end] for k, v in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """Samples at ``indices`` in that order (repeats allowed). A bool tensor acts as a mask."""
        size = self.size
        if isinstance(indices, torch.Tensor):
            if indices.dtype == torch.bool:
                if indices.shape != (size,):
                    raise ValueError(f"bool mask has shape {tuple(indices.shape)}, expected ({size},)")
                indices = indices.nonzero().flatten()
            if indices.dim() != 1 or indices.is_floating_point():
                raise ValueError(f"indices tensor must be 1-D integer, got {indices.dtype} of shape {tuple(indices.shape)}")
            idx_list = [int(i) for i in indices.tolist()]
        else:
            idx_list = list(indices)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in idx_list):
                raise ValueError(f"indices must be ints, got {idx_list!r}")
        bad = [i for i in idx_list if not 0 <= i < size]
        if bad:
            raise ValueError(f"indices {bad[:10]} out of range for batch size {size}")
        out = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[torch.tensor(idx_list, dtype=torch.long, device=v.device)]
            else:
                out[k] = [v[i] for i in idx_list]
        return out

    def shard_by_batch_size(self, shards: int, batch_size: int | None = None) -> list[BatchedDataDict]:
        """Split into ``shards`` equal parts, shard i for worker i.

        Without ``batch_size``: contiguous pieces. With ``batch_size``: the data is cut into
        consecutive global batches of ``batch_size`` and *each* global batch is split contiguously
        over the shards; shard i is the concatenation of every batch's piece i. That way, when a
        worker later steps through its shard ``batch_size // shards`` samples at a time, all workers
        are always working on the same global batch (one optimizer step each).
        """
        _check_positive_int("shards", shards)
        size = self.size
        if batch_size is None:
            if size % shards:
                raise ValueError(f"batch size {size} is not divisible by the number of shards {shards}")
            per = size // shards
            return [self.slice(i * per, (i + 1) * per) for i in range(shards)]
        _check_positive_int("batch_size", batch_size)
        if size % batch_size:
            raise ValueError(f"batch size {size} is not divisible by batch_size {batch_size}")
        if batch_size % shards:
            raise ValueError(f"batch_size {batch_size} is not divisible by the number of shards {shards}")
        per = batch_size // shards
        chunks = range(0, size, batch_size)
        return [
            self.select_indices([c + i * per + j for c in chunks for j in range(per)]) for i in range(shards)
        ]

    def repeat_interleave(self, n: int) -> BatchedDataDict:
        """Each sample repeated ``n`` times in place: [a, b] -> [a, a, b, b].

        List items are deep-copied: GRPO repeats each prompt's message_log and then appends a
        different generation to every copy, so the copies must not share the inner lists/dicts.
        """
        _check_positive_int("n", n)
        out = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(n, dim=0)
            else:
                out[k] = [_copy.deepcopy(item) for item in v for _ in range(n)]
        return out

    def make_microbatch_iterator(self, mb_size: int) -> Iterator[BatchedDataDict]:
        """Yield consecutive slices of ``mb_size`` samples; the last one may be smaller."""
        _check_positive_int("mb_size", mb_size)
        size = self.size
        return (self.slice(s, min(s + mb_size, size)) for s in range(0, size, mb_size))

    def make_length_sorted_microbatch_iterator(
        self, mb_size: int, *, length_key: str = "input_lengths", seq_key: str = "input_ids"
    ) -> Iterator[tuple[list[int], BatchedDataDict]]:
        """Yield ``(indices, micro_batch)``: samples sorted by ``length_key`` (longest first), each
        micro-batch's per-token tensors (2-D or more, as wide as ``seq_key``) cut to its own longest
        sample. A forward pass costs its padded width: in a batch that mixes short and long samples
        (a math answer beside a multi-turn tool episode), the short ones stop paying for the long.
        A batch that fits in one micro-batch comes back as given (same order, same width), so a
        one-pass computation such as the SFT bootstrap is reproduced exactly."""
        _check_positive_int("mb_size", mb_size)
        if length_key not in self or seq_key not in self:
            raise KeyError(f"length-sorted micro-batches need {length_key!r} and {seq_key!r}; have {sorted(self)}")
        if self.size <= mb_size:
            if self.size:
                yield list(range(self.size)), self
            return
        lengths = self[length_key]
        order = sorted(range(self.size), key=lambda i: -int(lengths[i]))  # stable: ties keep batch order
        for s in range(0, len(order), mb_size):
            idx = order[s : s + mb_size]
            yield idx, self.select_indices(idx).cut_width(int(lengths[idx].max()) if idx else 0, seq_key=seq_key)

    def make_token_budget_microbatch_iterator(
        self, max_tokens: int, *, length_key: str = "input_lengths", seq_key: str = "input_ids"
    ) -> Iterator[tuple[list[int], BatchedDataDict]]:
        """Like ``make_length_sorted_microbatch_iterator``, but each micro-batch holds as many samples
        as fit ``max_tokens`` computed tokens (samples x the micro-batch's longest): many short
        samples per pass, few long ones, about the same work in each. A sample longer than the
        budget is a ValueError (it could never fit)."""
        _check_positive_int("max_tokens", max_tokens)
        if length_key not in self or seq_key not in self:
            raise KeyError(f"token-budget micro-batches need {length_key!r} and {seq_key!r}; have {sorted(self)}")
        lengths = [int(n) for n in self[length_key]]
        if lengths and max(lengths) > max_tokens:
            raise ValueError(f"a sample of {max(lengths)} tokens is longer than the micro-batch token budget "
                             f"{max_tokens}")
        order = sorted(range(self.size), key=lambda i: -lengths[i])
        s = 0
        while s < len(order):
            w = max(lengths[order[s]], 1)  # the longest of this micro-batch (sorted, longest first)
            idx = order[s : s + max(1, max_tokens // w)]
            yield idx, self.select_indices(idx).cut_width(w, seq_key=seq_key)
            s += len(idx)

    def cut_width(self, width: int, *, seq_key: str = "input_ids") -> BatchedDataDict:
        """Per-token tensors (2-D or more, as wide as ``seq_key``) cut to their first ``width``
        positions, in place; returns self. Per-sample tensors and lists are left alone."""
        full = self[seq_key].shape[1]
        for k, v in list(self.items()):
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == full:
                super().__setitem__(k, v[:, :width])
        return self

    # --- misc -------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> BatchedDataDict:
        """Move every tensor to ``device`` in place (lists untouched); returns self for chaining."""
        for k, v in list(self.items()):
            if isinstance(v, torch.Tensor):
                super().__setitem__(k, v.to(device))
        return self

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` with the same values (shallow)."""
        return dict(self)

    def copy(self) -> BatchedDataDict:  # type: ignore[override]
        """Shallow copy that stays a BatchedDataDict (``dict.copy`` would return a plain dict)."""
        return type(self)(self)

    def __repr__(self) -> str:
        parts = []
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k!r}: Tensor{tuple(v.shape)} {v.dtype}")
            else:
                parts.append(f"{k!r}: list[{len(v)}]")
        return f"BatchedDataDict({{{', '.join(parts)}}})"


def _cat_padded(key: str, values: Iterable[torch.Tensor], pad_value: int | float) -> torch.Tensor:
    values = list(values)
    ndims = {v.dim() for v in values}
    if len(ndims) > 1:
        raise ValueError(f"from_batches: key {key!r} has tensors of different ranks {sorted(ndims)}")
    if values[0].dim() >= 2:
        trailing = {tuple(v.shape[2:]) for v in values}
        if len(trailing) > 1:
            raise ValueError(
                f"from_batches: key {key!r} tensors differ beyond dim 1: {[tuple(v.shape) for v in values]}"
            )
        max_len = max(v.shape[1] for v in values)
        values = [
            v
            if v.shape[1] == max_len
            else torch.cat(
                [v, v.new_full((v.shape[0], max_len - v.shape[1], *v.shape[2:]), pad_value)], dim=1
            )
            for v in values
        ]
    return torch.cat(values, dim=0)
