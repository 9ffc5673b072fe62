"""Sequence packing for the training and log-prob passes.

A right-padded batch pays for its widest sample in every row. Packing lays samples end to end in
rows of a bounded length instead, each with its own position ids and attention confined to itself
by a block-diagonal causal mask, so the tokens computed are (nearly) the tokens that exist.

GRPO adds a second saving: the G completions of one prompt share that prompt token for token. With
``share_prefix`` a group is laid out as ``prompt, completion_1, ..., completion_G`` in one row,
each completion attending to the prompt and to itself (a tree mask), with positions continuing from
the prompt's end. Every completion token sees exactly the keys and values it would see unpacked, so
the log-probs and the gradient are the same computation; the prompt is computed once, not G times.

Log-probs come back in the caller's ``[B, T]`` layout (``logprobs[i, t] = log p(x_t | x_<t)``,
position 0 is 0), so losses never see the packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.selected_logits import can_select, try_selected

# Attention implementations that honour a custom 4-D mask (HF passes a 4-D mask through untouched).
MASK_ATTENTION = ("sdpa", "eager")


@dataclass
class _Unit:
    """What must stay in one row: a sample, or a shared prompt with the completions that follow it."""

    prefix_len: int  # 0: no shared prefix; the unit is one whole sample
    members: list[int]  # sample indices
    size: int  # tokens it occupies in a row


@dataclass
class PackedBatch:
    """Rows ready for one forward pass, and where each sample's predictions are in them."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    unit_ids: torch.Tensor  # [R, L] which unit a position belongs to (-1: padding)
    segment_ids: torch.Tensor  # [R, L] 0: a unit's shared prefix (or whole sample), k >= 1: its k-th completion
    sample_idx: list[int]  # the samples in these rows, in the order of the [b, T] outputs
    src_row: torch.Tensor  # [b, T] row of the logits that predict token t of sample i
    src_col: torch.Tensor  # [b, T] column of those logits
    targets: torch.Tensor  # [b, T] token t of sample i (0 where invalid)
    valid: torch.Tensor  # [b, T] True for 1 <= t < length
    width: int  # T: the widest of these samples

    @property
    def tokens_computed(self) -> int:
        return self.input_ids.numel()

    @property
    def tokens_real(self) -> int:
        return int((self.unit_ids >= 0).sum())

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, L, L]: query j sees key k of the same unit at or before j, if k is the shared
        prefix or k is in j's own segment. Padding sees itself only (no all-masked softmax rows)."""
        u, s = self.unit_ids, self.segment_ids
        L = u.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=u.device).tril()
        same_unit = (u[:, :, None] == u[:, None, :]) & (u[:, :, None] >= 0)
        same_seg = (s[:, None, :] == 0) | (s[:, :, None] == s[:, None, :])
        eye = torch.eye(L, dtype=torch.bool, device=u.device)
        mask = ((same_unit & same_seg & causal) | eye)[:, None]
        if attn_implementation == "sdpa":
            return mask
        if attn_implementation == "eager":  # HF's eager attention adds the mask to the scores
            return torch.zeros(mask.shape, dtype=dtype, device=u.device).masked_fill(~mask, torch.finfo(dtype).min)
        raise ValueError(f"attention implementation {attn_implementation!r} cannot take a packed mask "
                         f"(supported: {', '.join(MASK_ATTENTION)})")

    def to(self, device: torch.device) -> PackedBatch:
        for k in ("input_ids", "position_ids", "unit_ids", "segment_ids", "src_row", "src_col", "targets", "valid"):
            setattr(self, k, getattr(self, k).to(device))
        return self


def shared_prefix_lengths(input_ids: torch.Tensor, token_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Tokens before each sample's first loss token (its prompt); 0 where it has none to share."""
    has = token_mask.bool().any(dim=1)
    first = token_mask.bool().float().argmax(dim=1)
    return torch.where(has & (first < lengths), first, torch.zeros_like(first))


def _prefix_groups(input_ids: torch.Tensor, lengths: list[int], prefix_lens: list[int] | None
                   ) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """The samples that share no prompt, and (prompt length, members) for each prompt shared token
    for token. Independent of the row length, so a search over row lengths groups once."""
    if prefix_lens is None:
        return list(range(len(lengths))), []
    groups: dict[tuple[int, ...], list[int]] = {}
    alone: list[int] = []
    for i, (n, p) in enumerate(zip(lengths, prefix_lens)):
        if 0 < p < n:
            groups.setdefault(tuple(input_ids[i, :p].tolist()), []).append(i)
        else:
            alone.append(i)
    return alone, [(len(key), members) for key, members in groups.items()]


def _units(lengths: list[int], alone: list[int], groups: list[tuple[int, list[int]]], row_length: int) -> list[_Unit]:
    units = [_Unit(0, [i], lengths[i]) for i in alone]

    def close(p: int, members: list[int], size: int) -> None:
        # A prompt shared by nobody is just a sample.
        units.append(_Unit(p, members, size) if len(members) > 1 else _Unit(0, members, lengths[members[0]]))

    for p, members in groups:
        # A group longer than a row is split into sub-groups, each with its own copy of the prompt.
        cur: list[int] = []
        size = p
        for i in members:
            extra = lengths[i] - p
            if cur and size + extra > row_length:
                close(p, cur, size)
                cur, size = [], p
            cur.append(i)
            size += extra
        close(p, cur, size)
    return units


def _first_fit(units: list[_Unit], row_length: int) -> list[list[_Unit]]:
    """First-fit decreasing of units into rows of at most ``row_length`` tokens."""
    units = sorted(units, key=lambda u: -u.size)
    rows: list[list[_Unit]] = []
    free: list[int] = []
    for u in units:
        for r, room in enumerate(free):
            if u.size <= room:
                rows[r].append(u)
                free[r] -= u.size
                break
        else:
            rows.append([u])
            free.append(row_length - u.size)
    return rows


def _checked_lengths(lengths: torch.Tensor, row_length: int) -> list[int]:
    lens = [int(n) for n in lengths]
    if lens and max(lens) > row_length:
        raise ValueError(f"a sample of {max(lens)} tokens does not fit a packed row of {row_length} tokens "
                         "(policy.sequence_packing.max_tokens_per_microbatch / row_length must be at least "
                         "policy.max_total_sequence_length)")
    return lens


def _grouped(input_ids: torch.Tensor, lengths: torch.Tensor, row_length: int, prefix_lens: torch.Tensor | None
             ) -> tuple[list[int], list[int], list[tuple[int, list[int]]]]:
    """The lengths (checked against ``row_length``) and ``_prefix_groups``' samples alone and groups."""
    lens = _checked_lengths(lengths, row_length)
    return lens, *_prefix_groups(input_ids, lens, None if prefix_lens is None else [int(p) for p in prefix_lens])


def plan_rows(input_ids: torch.Tensor, lengths: torch.Tensor, row_length: int,
              prefix_lens: torch.Tensor | None = None) -> list[list[_Unit]]:
    """First-fit decreasing of units into rows of at most ``row_length`` tokens."""
    lens, alone, groups = _grouped(input_ids, lengths, row_length, prefix_lens)
    return _first_fit(_units(lens, alone, groups, row_length), row_length)


def group_rows(rows: list[list[_Unit]], max_tokens: int) -> list[list[list[_Unit]]]:
    """Consecutive rows (longest first) into micro-batches of at most ``max_tokens`` computed tokens
    (rows x the widest row); a row is never split."""
    sized = sorted(rows, key=lambda r: -sum(u.size for u in r))
    out: list[list[list[_Unit]]] = []
    for row in sized:
        if out and (len(out[-1]) + 1) * sum(u.size for u in out[-1][0]) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


# What a masked attention position costs against a projection multiply-add, per token and key.
# Fitted on the multi-env default's training batches (tiny model, CPU, SDPA with a bool mask): rows
# of 160 / 320 / 640 tokens took about 1.49 / 1.38 / 1.72 s per step on one thread; this weight
# ranks them so. (Past a few hundred keys the score matrices leave the cache and the cost grows
# faster than the linear model says: a smaller weight would pick rows that are too long.)
ATTENTION_MAC_WEIGHT = 0.5


def attention_cost_ratio(model_config) -> float:
    """Cost of one attended key position per token, as a fraction of a token's projections (per
    layer): ``ATTENTION_MAC_WEIGHT * 2 * heads * head_dim / (q,k,v,o + MLP multiply-adds)``. 0.0 when the config
    does not say (the row length is then the longest allowed, as before)."""
    try:
        d = int(model_config.hidden_size)
        heads = int(model_config.num_attention_heads)
        kv = int(getattr(model_config, "num_key_value_heads", None) or heads)
        hd = int(getattr(model_config, "head_dim", None) or d // heads)
        ffn = int(model_config.intermediate_size)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    linear = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ffn  # q, o; k, v; gated MLP
    return ATTENTION_MAC_WEIGHT * 2 * heads * hd / max(linear, 1)


def packing_cost(groups: list[list[list[_Unit]]], ratio: float) -> float:
    """Estimated compute of micro-batches of rows: each row is as wide as its micro-batch's widest,
    and every position pays its projections plus attention over the whole row (``ratio`` per key)."""
    cost = 0.0
    for rows in groups:
        w = max(sum(u.size for u in r) for r in rows)
        cost += len(rows) * w * (1.0 + ratio * w)
    return cost


def plan_rows_auto(input_ids: torch.Tensor, lengths: torch.Tensor, max_row_length: int, max_tokens: int,
                   ratio: float, prefix_lens: torch.Tensor | None = None) -> list[list[_Unit]]:
    """The rows of the row length (from the longest sample up to ``max_row_length``) whose micro-
    batches cost least by ``packing_cost``. Long rows waste little padding but pay attention over
    the whole row (no varlen kernel on CPU); with ``ratio`` 0 this is the longest row."""
    longest = max(int(n) for n in lengths)
    if ratio <= 0 or longest >= max_row_length:
        return plan_rows(input_ids, lengths, max_row_length, prefix_lens)
    lens, alone, groups = _grouped(input_ids, lengths, max_row_length, prefix_lens)
    step = max(16, (max_row_length - longest) // 12)
    candidates = sorted({*range(longest, max_row_length, step), max_row_length})
    best, best_cost = None, float("inf")
    for n in candidates:
        rows = _first_fit(_units(lens, alone, groups, n), n)
        cost = packing_cost(group_rows(rows, max_tokens), ratio)
        if cost < best_cost:
            best, best_cost = rows, cost
    return best


def build_packed(input_ids: torch.Tensor, lengths: torch.Tensor, rows: list[list[_Unit]]) -> PackedBatch:
    """Lay ``rows`` out as tensors; ``input_ids`` is the caller's right-padded [B, T] batch."""
    W = max(sum(u.size for u in r) for r in rows)
    R = len(rows)
    lens = [int(n) for n in lengths]
    sample_idx = [i for r in rows for u in r for i in u.members]
    local = {i: k for k, i in enumerate(sample_idx)}
    T = max(lens[i] for i in sample_idx)
    # Index lists built with range() and scattered in one go: a few tensor ops per batch rather than
    # several per sample (this runs on the driver and the worker every step).
    at: list[int] = []  # flat position (r * W + column) of each laid-out token
    smp: list[int] = []  # ... its sample and column in input_ids
    col: list[int] = []
    pos: list[int] = []  # its position id, unit and segment
    uid: list[int] = []
    seg: list[int] = []
    dst: list[int] = []  # flat [b, T] index of each predicted token t >= 1 ...
    s_row: list[int] = []  # ... and the row and column of the logits that predict it
    s_col: list[int] = []
    n_unit = 0
    for r, row in enumerate(rows):
        c = 0
        for u in row:
            p = u.prefix_len
            prefix_at = c
            if p:
                at.extend(range(r * W + c, r * W + c + p))
                smp.extend([u.members[0]] * p)
                col.extend(range(p))
                pos.extend(range(p))
                uid.extend([n_unit] * p)
                seg.extend([0] * p)
                c += p
            for k, i in enumerate(u.members, start=1):
                n = lens[i]
                m = n - p
                at.extend(range(r * W + c, r * W + c + m))
                smp.extend([i] * m)
                col.extend(range(p, n))
                pos.extend(range(p, n))
                uid.extend([n_unit] * m)
                seg.extend([k if p else 0] * m)
                # Token t is predicted at the position of token t-1: in the prefix, or in its own part.
                dst.extend(range(local[i] * T + 1, local[i] * T + n))
                s_row.extend([r] * (n - 1))
                s_col.extend(range(prefix_at, prefix_at + p))
                s_col.extend(range(c, c + n - 1 - p))
                c += m
            n_unit += 1
    at_t = torch.tensor(at, dtype=torch.long)
    ids = torch.zeros(R * W, dtype=input_ids.dtype)
    ids[at_t] = input_ids[torch.tensor(smp, dtype=torch.long), torch.tensor(col, dtype=torch.long)]
    position = torch.zeros(R * W, dtype=torch.long)
    position[at_t] = torch.tensor(pos, dtype=torch.long)
    unit = torch.full((R * W,), -1, dtype=torch.long)
    unit[at_t] = torch.tensor(uid, dtype=torch.long)
    segment = torch.zeros(R * W, dtype=torch.long)
    segment[at_t] = torch.tensor(seg, dtype=torch.long)
    b = len(sample_idx)
    dst_t = torch.tensor(dst, dtype=torch.long)
    src_row = torch.zeros(b * T, dtype=torch.long)
    src_row[dst_t] = torch.tensor(s_row, dtype=torch.long)
    src_col = torch.zeros(b * T, dtype=torch.long)
    src_col[dst_t] = torch.tensor(s_col, dtype=torch.long)
    sub = input_ids[sample_idx, :T]
    valid = torch.arange(T)[None, :].expand(b, T) < lengths[sample_idx][:, None]
    valid[:, 0] = False
    targets = torch.where(valid, sub, torch.zeros_like(sub))
    return PackedBatch(ids.view(R, W), position.view(R, W), unit.view(R, W), segment.view(R, W), sample_idx,
                       src_row.view(b, T), src_col.view(b, T), targets, valid, T)


def packed_token_logprobs(model, packed: PackedBatch, temperature: float,
                          topk: int | torch.Tensor | None = None, need: torch.Tensor | None = None):
    """[b, T] log-probs of each sample's tokens (0 at position 0 and past its length), computed from
    the packed rows in one forward pass. ``topk`` and ``need`` as ``hf_worker.token_logprobs``'s."""
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    dtype = next(model.parameters()).dtype
    mask = packed.attention_mask(impl, dtype)
    if need is not None and can_select(model):
        need = (need[:, : packed.width].to(packed.valid.device) != 0) & packed.valid
        if need.any():
            flat_pos = packed.src_row * packed.input_ids.shape[1] + packed.src_col
            out = try_selected(model, {"input_ids": packed.input_ids, "attention_mask": mask,
                                       "position_ids": packed.position_ids}, flat_pos, packed.targets, need,
                               temperature, topk)
            if out is not None:
                return out
    logits = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                   use_cache=False).logits
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # One logsumexp per packed position (a shared prompt's once), then a gather per sample token.
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits[packed.src_row, packed.src_col, packed.targets] - lse[packed.src_row, packed.src_col]
    lp = torch.where(packed.valid, picked, torch.zeros_like(picked))
    if topk is None:
        return lp
    valid = packed.valid[..., None]
    at = lse[packed.src_row, packed.src_col][..., None]
    if isinstance(topk, int):
        vals, ids = logits.topk(topk, dim=-1)
        ids, vals = ids[packed.src_row, packed.src_col], vals[packed.src_row, packed.src_col] - at
        return lp, torch.where(valid, ids, torch.zeros_like(ids)), torch.where(valid, vals, torch.zeros_like(vals))
    ids = topk.to(logits.device)
    got = logits[packed.src_row[..., None], packed.src_col[..., None], ids] - at
    return lp, torch.where(valid, got, torch.zeros_like(got))


def require_mask_attention(model, key: str) -> None:
    """Packing needs an attention implementation that takes the packed 4-D mask; ValueError naming ``key``."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in MASK_ATTENTION:
        raise ValueError(f"{key}: the model's attention implementation {impl!r} cannot "
                         f"confine packed sequences here (supported: {', '.join(MASK_ATTENTION)}); load it with "
                         "attn_implementation='sdpa' or turn packing off")


def check_packing_supported(model) -> None:
    """Refuse packing on a model whose attention ignores the packed mask: its log-probs would be
    silently wrong. Checked by construction (the attention implementation) and by a probe: two
    short sequences packed must give the log-probs they give one by one."""
    require_mask_attention(model, "policy.sequence_packing.enabled")
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6), generator=g)
    lengths = torch.tensor([6, 4])
    prefix = torch.tensor([2, 2])
    ids[1, :2] = ids[0, :2]  # a shared two-token prompt
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = build_packed(ids, lengths, plan_rows(ids, lengths, 16, prefix)).to(device)
            got = packed_token_logprobs(model, packed, 1.0).cpu()
            ref = torch.zeros_like(got)
            for k, i in enumerate(packed.sample_idx):
                n = int(lengths[i])
                x = ids[i : i + 1, :n].to(device)
                lg = model(input_ids=x, use_cache=False).logits.float()[0, :-1]
                ref[k, 1:n] = (lg.log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]).cpu()
    finally:
        model.train(was_training)
    err = float((got - ref).abs().max())
    if not err < 1e-4:  # float32 (the probe runs on the fp32 master weights, before sharding)
        raise ValueError(f"policy.sequence_packing.enabled: this model's attention does not confine packed "
                         f"sequences (packed log-probs differ from unpacked by {err:.3g}); turn packing off")


class MicroBatch:
    """Samples ``idx`` of a batch as one forward pass: right-padded (``packed`` None) or packed rows."""

    def __init__(self, idx: list[int], data: BatchedDataDict, packed: PackedBatch | None):
        self.idx, self.data, self.packed = idx, data, packed
        lengths = data["input_lengths"]
        self.tokens_real = packed.tokens_real if packed else int(lengths.sum())
        self.tokens_computed = packed.tokens_computed if packed else int(lengths.numel() * data["input_ids"].shape[1])
        self.sample_tokens = int(lengths.sum())


def _packed_groups(data: BatchedDataDict, cfg: PolicyConfig, attention_ratio: float) -> list[list[list[_Unit]]]:
    """Packing's plan: the rows of each micro-batch."""
    sp = cfg.sequence_packing
    ids, lengths = data["input_ids"], data["input_lengths"]
    prefix = (shared_prefix_lengths(ids, data["token_mask"], lengths)
              if sp.share_prompt_prefix and "token_mask" in data else None)
    if sp.row_length is None:
        rows = plan_rows_auto(ids, lengths, cfg.packing_row_length, sp.max_tokens_per_microbatch,
                              attention_ratio, prefix)
    else:
        rows = plan_rows(ids, lengths, sp.row_length, prefix)
    return group_rows(rows, sp.max_tokens_per_microbatch)


def count_microbatches(data: BatchedDataDict, cfg: PolicyConfig, mb_size: int, attention_ratio: float = 0.0) -> int:
    """``len(plan_microbatches(...))`` without laying the micro-batches out: for a caller that only
    needs to know how the worker will cut the batch."""
    if cfg.sequence_packing.enabled:
        return len(_packed_groups(data, cfg, attention_ratio))
    return len(plan_microbatches(data, cfg, mb_size, attention_ratio))


def plan_microbatches(data: BatchedDataDict, cfg: PolicyConfig, mb_size: int,
                      attention_ratio: float = 0.0) -> list[MicroBatch]:
    """How a batch is cut into forward passes: packed rows under a token budget, right-padded
    micro-batches under a token budget (dynamic batching), or ``mb_size`` samples sorted by length.
    ``attention_ratio`` (``attention_cost_ratio`` of the model) lets packing choose its row length."""
    sp, db = cfg.sequence_packing, cfg.dynamic_batching
    if sp.enabled:
        ids, lengths = data["input_ids"], data["input_lengths"]
        out = []
        for group in _packed_groups(data, cfg, attention_ratio):
            packed = build_packed(ids, lengths, group)
            mb = data.select_indices(packed.sample_idx).cut_width(packed.width)
            out.append(MicroBatch(packed.sample_idx, mb, packed))
        return out
    if db.enabled:
        return [MicroBatch(idx, mb, None) for idx, mb in data.make_token_budget_microbatch_iterator(
            db.max_tokens_per_microbatch)]
    return [MicroBatch(idx, mb, None) for idx, mb in data.make_length_sorted_microbatch_iterator(mb_size)]
