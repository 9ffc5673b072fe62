"""Decode steps of fixed shapes for the continuous engine (`policy.generation.decode_mode`), so that a
step can be compiled once and replayed as a CUDA graph.

The dynamic step (engine.py) hands the model exactly its live rows and the columns in use, so every
step has a new shape and runs eagerly: on a GPU it is bound by Python and kernel launches (one decode
forward of SmolLM2-135M cost 63-81 ms whatever the batch on an H100: docs/performance.md). Here a step
has one of a few shapes, as vLLM's and SGLang's captured decode steps do:

- the live rows are padded up to a bucket (powers of two up to the slots): rows past the live ones
  compute and are thrown away;
- attention runs over every column of the cache under a 4-D mask of each row's valid columns (the
  padding rows see only the column written now: no all-masked softmax);
- the new keys and values are written at a column held in a device tensor (``index_copy_``), not at a
  Python int that would be baked into a trace;
- the KV buffers belong to the model's decoder and outlive a `generate` call, with their columns
  rounded up to ``COLUMN_STEP``: a later call with other lengths reuses them and what was compiled.

Modes: "static" runs those steps eagerly (the reference the others are tested against), "compiled"
under ``torch.compile`` (inductor's fused kernels), "graphs" under ``torch.compile(mode=
"reduce-overhead")``: each shape's step replayed as one CUDA graph (on a CPU, the same as "compiled").
Prefill stays dynamic: it runs once per admission, not once per token.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from nemo_like.models.generation.slots import slot_cache

DECODE_MODES = ("dynamic", "static", "compiled", "graphs")
COLUMN_STEP = 256
_COMPILE_MODE = {"compiled": None, "graphs": "reduce-overhead"}
MASK_IMPLS = ("sdpa", "eager")

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_buckets(slots: int) -> list[int]:
    """The row counts a step may have: powers of two below ``slots``, and ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def static_decoder(model, mode: str) -> StaticDecoder | None:
    """The model's decoder for ``mode`` (kept per model, with its buffers and compiled steps); None for
    "dynamic". ValueError naming the key when the model's attention cannot take a 4-D mask."""
    if mode == "dynamic":
        return None
    if mode not in DECODE_MODES:
        raise ValueError(f"policy.generation.decode_mode={mode!r}: expected one of {', '.join(DECODE_MODES)}")
    # Per model and mode: an engine of another mode on the same model (a benchmark's interleaved runs)
    # must not throw away this mode's buffers, and with them its compiled traces.
    by_mode = _DECODERS.setdefault(model, {})
    if mode not in by_mode:
        by_mode[mode] = StaticDecoder(model, mode)
    return by_mode[mode]


class StaticDecoder:
    def __init__(self, model, mode: str):
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if impl not in MASK_IMPLS:
            raise ValueError(f"policy.generation.decode_mode={mode!r} needs attention that takes a 4-D mask "
                             f"({', '.join(MASK_IMPLS)}); the model's is {impl!r}: load it with "
                             "attn_implementation='sdpa' or set decode_mode: dynamic")
        # No reference to the model itself: the decoders are kept per model in a WeakKeyDictionary,
        # whose values must not keep their keys alive. Each step is handed the model.
        self.config, self.mode, self.impl = model.config, mode, impl
        self.dtype = next(model.parameters()).dtype
        fwd = inspect.signature(model.forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in fwd else {}
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._owner: weakref.ref | None = None  # the Slots using the kept buffers now
        self._cache: Any = None
        self._write_at: torch.Tensor | None = None
        self.steps = 0
        self.shapes: set[tuple[int, int]] = set()  # (rows, columns) stepped so far
        if mode in _COMPILE_MODE:
            # A new shape recompiles once with dynamic sizes, but new buffers (a grown cache: static
            # addresses) are traced anew; past dynamo's default limit of 8 it would quietly run eagerly.
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._fn = torch.compile(self._forward, mode=_COMPILE_MODE[mode], dynamic=None)
        else:
            self._fn = self._forward

    def cache_for(self, likes: list[torch.Tensor], rows: int, columns: int, owner) -> Any:
        """A slot cache of at least ``rows`` x ``columns`` (rounded up to ``COLUMN_STEP``) shaped like
        ``likes`` (one [*, heads, *, dim] tensor per layer): the kept buffers when they are as large and
        no other engine on this model is using them, else new ones as large as both, kept from then on
        (training and validation batches of different sizes share one set, and one set of traces)."""
        columns = -(-columns // COLUMN_STEP) * COLUMN_STEP
        holder = self._owner() if self._owner is not None else None
        # Busy: another engine holds rows in them now (an idle one takes them back when it admits again).
        busy = holder is not None and holder is not owner and holder.n > 0
        kept = self._buffers
        same = kept is not None and len(kept) == len(likes) and all(
            (k.shape[1], k.shape[3], k.dtype, k.device) == (x.shape[1], x.shape[3], x.dtype, x.device)
            for (k, _), x in zip(kept, likes))
        if same and not busy:
            if kept[0][0].shape[0] >= rows and kept[0][0].shape[2] >= columns:
                self._owner = weakref.ref(owner)
                return self._cache
            rows, columns = max(rows, kept[0][0].shape[0]), max(columns, kept[0][0].shape[2])
        buffers = [tuple(x.new_zeros((rows, x.shape[1], columns, x.shape[3])) for _ in range(2)) for x in likes]
        cache = slot_cache(self.config, buffers)
        if busy:  # a second engine at once (rare): its own buffers, not kept
            return cache
        if self.mode in _COMPILE_MODE:  # CUDA graphs write into these in place: their addresses must not move
            for k, v in buffers:
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
        self._buffers, self._cache, self._owner = buffers, cache, weakref.ref(owner)
        return cache

    def step(self, model, s, n: int) -> torch.Tensor:
        """One decode step of ``model`` over the first ``n`` rows of ``s`` (a `slots.Slots` whose column
        ``s.length`` is marked valid for them): their next-token logits [n, V]."""
        L, C = s.length, s.columns
        B = bucket(n, row_buckets(s.valid.shape[0]))  # the buffers' rows: the same buckets on every call
        if self._write_at is None or self._write_at.device != s.valid.device:
            self._write_at = torch.zeros(1, dtype=torch.long, device=s.valid.device)
            if self.mode in _COMPILE_MODE:
                torch._dynamo.mark_static_address(self._write_at)
        self._write_at.fill_(L)
        for layer in s.cache.layers:
            layer.write_at = self._write_at
        mask = s.valid[:B, :C].clone()
        mask[n:] = False
        mask[:, L] = True  # the padding rows' only column: no all-masked softmax
        if self.mode == "graphs":  # a new iteration: the last replay's outputs (cloned) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        self.steps += 1
        self.shapes.add((B, C))
        try:
            logits = self._fn(model, s.cache, s.last[:B, None].clone(), s.pos[:B, None].clone(), mask[:, None, None])
        finally:
            for layer in s.cache.layers:
                layer.write_at = None
        return logits[:n].clone()  # a CUDA graph's output is overwritten by its next replay

    def _forward(self, model, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.impl == "eager":  # HF's eager attention adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, **self._keep)
        return out.logits[:, -1]
