"""The continuous engine's KV cache: rows decoding together over preallocated buffers.

Per layer [slots, heads, columns, dim], behind a `DynamicCache` whose layers write in place
(`DynamicLayer` concatenates, copying the whole cache every step). All rows write the same column each
step; a `valid` mask says which columns hold each row's real tokens, and positions are explicit (real
tokens so far), so where a row's tokens sit never shifts its positions. A finished row is replaced by
the last live row (a copy of one row); new rows are written into free rows, ending at the current
column. When the columns run out, each row's tokens are packed to the front; when a row needs more
than there are, the buffers grow.
"""

from __future__ import annotations

import functools

import torch


class _SlotLayer:
    """One layer's cache over preallocated [slots, heads, columns, dim] buffers.

    Every row writes the same column each step, so appending a token is one slice write;
    `DynamicLayer`'s torch.cat copies the whole cache every step, which measured as the largest cost of
    a decode step on the tiny model (with dropping finished rows by copying the rest)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys_buf, self.values_buf = keys, values
        self.n = 0  # rows in use: 0..n-1
        self.length = 0  # columns in use
        # Fixed-shape steps (static_decode.py): the column to write, in a device tensor, and attention
        # over all the buffer's columns of as many rows as the step has (the mask hides the rest).
        self.write_at: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.write_at is not None:
            rows = key_states.shape[0]
            keys, values = self.keys_buf[:rows], self.values_buf[:rows]
            keys.index_copy_(2, self.write_at, key_states)
            values.index_copy_(2, self.write_at, value_states)
            return keys, values
        end = self.length + key_states.shape[-2]
        self.keys_buf[: self.n, :, self.length : end] = key_states
        self.values_buf[: self.n, :, self.length : end] = value_states
        self.length = end
        return self.keys_buf[: self.n, :, :end], self.values_buf[: self.n, :, :end]


@functools.cache  # one class: a compiled step's guards check the layers' type
def _slot_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(_SlotLayer, DynamicLayer):
        """`DynamicLayer`'s interface (what the model and the mask code call) over `_SlotLayer`'s buffers."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            DynamicLayer.__init__(self)
            _SlotLayer.__init__(self, keys, values)
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        update = _SlotLayer.update

        def get_seq_length(self) -> int:
            return self.length

    return SlotLayer


class Slots:
    """The rows decoding together. Row r's real tokens sit in the columns where `valid[r]` is set (any
    columns: attention does not depend on the keys' order once the mask and positions are right), so new
    prompts are written into free rows ending at the current column, and a finished row is replaced by
    the last live row (a copy of a few rows, not of the whole cache)."""

    def __init__(self, model, rows: int, columns: int, prefill_cache, device: torch.device, storage=None):
        """``storage``: where the cache comes from when it is not made here (``static_decode.StaticDecoder``:
        buffers kept across calls, so that compiled steps stay valid)."""
        self.storage = storage
        if storage is not None:
            self.cache = storage.cache_for([layer.keys for layer in prefill_cache.layers], rows, columns, self)
            rows, columns = self.cache.layers[0].keys_buf.shape[0], self.cache.layers[0].keys_buf.shape[2]
        else:
            self.cache = slot_cache(model.config, [(_buffer(pl.keys, rows, columns), _buffer(pl.values, rows, columns))
                                            for pl in prefill_cache.layers])
        self.columns = columns
        self.valid = torch.zeros((rows, columns), dtype=torch.bool, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)  # real tokens so far
        self.req = torch.zeros(rows, dtype=torch.long, device=device)  # request of each row
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # sampled, not yet in the cache
        self.n, self.length = 0, 0

    def sync_layers(self) -> None:
        for layer in self.cache.layers:
            layer.n, layer.length = self.n, self.length

    def admit(self, req, last, pos, mask: torch.Tensor, keys: list, values: list) -> None:
        """Rows n.. get these prompts' caches ([k, heads, width, dim] each, mask [k, width]) in the
        `width` columns that end at the current column."""
        if self.storage is not None and self.n == 0:
            self._reacquire()
        k, width = mask.shape
        self.length = max(self.length, width)  # the other rows' extra columns stay invalid
        rows, cols = slice(self.n, self.n + k), slice(self.length - width, self.length)
        for layer, ks, vs in zip(self.cache.layers, keys, values):
            layer.keys_buf[rows, :, cols] = ks
            layer.values_buf[rows, :, cols] = vs
        self.valid[rows] = False
        self.valid[rows, cols] = mask
        self.req[rows], self.last[rows], self.pos[rows] = req, last, pos
        self.n += k

    def _reacquire(self) -> None:
        """Empty again: take the storage's kept cache back (another engine on the model may have used it
        while this one was idle), or the one it hands out now."""
        cache = self.storage.cache_for([layer.keys_buf for layer in self.cache.layers], self.valid.shape[0],
                                       self.columns, self)
        if cache is self.cache:
            return
        self.cache, buf = cache, cache.layers[0].keys_buf
        rows, self.columns = buf.shape[0], buf.shape[2]
        dev = self.valid.device
        self.valid = torch.zeros((rows, self.columns), dtype=torch.bool, device=dev)
        self.pos, self.req, self.last = (torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(3))
        self.length = 0

    def drop(self, done: torch.Tensor) -> None:
        """Remove the rows where `done` [n] is set, moving the last live rows into their places."""
        keep = self.n - int(done.sum())
        holes = done[:keep].nonzero().squeeze(1)
        if len(holes):
            tails = (~done[keep:]).nonzero().squeeze(1) + keep
            L = self.length
            for layer in self.cache.layers:
                layer.keys_buf[holes, :, :L] = layer.keys_buf[tails, :, :L]
                layer.values_buf[holes, :, :L] = layer.values_buf[tails, :, :L]
            for t in (self.valid, self.pos, self.req, self.last):
                t[holes] = t[tails]
        self.n = keep
        if not keep:
            self.length = 0

    def grow(self, columns: int) -> None:
        """Reallocate the buffers with ``columns`` columns (the rows' tokens stay where they are)."""
        L = self.length
        if self.storage is not None:
            old = self.cache
            self.cache = self.storage.cache_for([layer.keys_buf for layer in old.layers], self.valid.shape[0],
                                                columns, self)
            rows, columns = self.cache.layers[0].keys_buf.shape[0], self.cache.layers[0].keys_buf.shape[2]
            for o, n in zip(old.layers, self.cache.layers):  # the kept buffers may have more rows than these
                R = o.keys_buf.shape[0]
                n.keys_buf[:R, :, :L], n.values_buf[:R, :, :L] = o.keys_buf[:, :, :L], o.values_buf[:, :, :L]
            old.layers = []
            self._grow_valid(rows, columns)
            return
        for layer in self.cache.layers:
            for name in ("keys_buf", "values_buf"):
                old = getattr(layer, name)
                new = old.new_zeros((old.shape[0], old.shape[1], columns, old.shape[3]))
                new[:, :, :L] = old[:, :, :L]
                setattr(layer, name, new)
        self._grow_valid(self.valid.shape[0], columns)

    def _grow_valid(self, rows: int, columns: int) -> None:
        L, R = self.length, self.valid.shape[0]
        valid = self.valid.new_zeros((rows, columns))
        valid[:R, :L] = self.valid[:, :L]
        self.valid, self.columns = valid, columns
        for name in ("pos", "req", "last") if rows != R else ():
            grown = getattr(self, name).new_zeros(rows)
            grown[:R] = getattr(self, name)
            setattr(self, name, grown)

    def compact(self) -> None:
        """Pack each row's real tokens into the first columns (when the columns run out: the buffer
        holds a whole sample and more, so this is rare)."""
        n, L = self.n, self.length
        if not n:
            self.length = 0
            return
        valid = self.valid[:n, :L]
        count = valid.sum(1)
        width = int(count.max())
        # Each row's valid columns in order, right-aligned in `width` (stable sort: invalid ones first).
        idx = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, L - width :]
        for layer in self.cache.layers:
            for buf in (layer.keys_buf, layer.values_buf):
                h, d = buf.shape[1], buf.shape[3]
                buf[:n, :, :width] = buf[:n, :, :L].gather(2, idx[:, None, :, None].expand(n, h, width, d))
        self.valid[:n] = False
        self.valid[:n, :width] = torch.arange(width, device=valid.device)[None] >= (width - count)[:, None]
        self.length = width


def slot_cache(config, buffers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A `DynamicCache` (of a model with ``config``) whose layers write into ``buffers`` (per layer: keys,
    values [rows, heads, columns, dim])."""
    from transformers import DynamicCache

    layer_cls = _slot_layer_class()
    cache = DynamicCache(config=config)
    cache.layers = [layer_cls(k, v) for k, v in buffers]
    return cache


def _buffer(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    return like.new_zeros((rows, like.shape[1], columns, like.shape[3]))
