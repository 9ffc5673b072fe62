"""HF `generate` run inside a policy worker on its shard of the batch."""

from __future__ import annotations

import logging

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.engine import (
    continuous_generate,
    position_limit,
    token_budgets,
    unsupported_reason,
)
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def right_to_left_padded(input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int):
    """HF decoder-only generation needs prompts flush against the generated tokens."""
    B, T = input_ids.shape
    width = int(lengths.max()) if B else 0
    left = torch.full((B, width), pad_id, dtype=input_ids.dtype)
    mask = torch.zeros((B, width), dtype=torch.long)
    for i in range(B):
        n = int(lengths[i])
        left[i, width - n :] = input_ids[i, :n]
        mask[i, width - n :] = 1
    return left, mask


@torch.no_grad()
def hf_generate(
    model,
    tokenizer,
    data: BatchedDataDict,
    cfg: GenerationConfig,
    *,
    greedy: bool,
    max_total_length: int,
    micro_batch_size: int,
    synced: bool,
    device: torch.device,
    prefix_cache: PrefixCache | None = None,
) -> BatchedDataDict:
    # synced (FSDP over several ranks): every forward runs collectives, so all ranks must run the same
    # number of forwards; the continuous engine's step count depends on each rank's own samples, and
    # `generate` already keeps ranks in lock step (synced_gpus), so it is used there.
    if cfg.engine == "continuous" and not synced:
        reason = unsupported_reason(model)
        if reason is None:
            return continuous_generate(model, tokenizer, data, cfg, greedy=greedy,
                                       max_total_length=max_total_length,
                                       slots=cfg.max_num_seqs or micro_batch_size, device=device,
                                       prefix_cache=prefix_cache)
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("policy.generation.engine=continuous: %s; using HF generate", reason)
    input_ids, lengths = data["input_ids"], data["input_lengths"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    budgets = token_budgets(lengths, cfg, max_total_length)
    # Positions past the model's table would crash models with learned absolute positions; rotary
    # ones compute positions on the fly (tokens past a sample's budget are dropped anyway).
    pos_limit = position_limit(model)
    stop_strings = cfg.stop_strings
    if "stop_strings" in data and any(s for s in data["stop_strings"]):
        # HF applies one stop-string list to the whole batch; take the union of the samples' lists.
        stop_strings = sorted({s for ss in data["stop_strings"] if ss for s in ss} | set(stop_strings or []))

    results = []
    B = input_ids.shape[0]
    # Every rank must run the same number of generate calls (FSDP collectives inside forward).
    for start in range(0, max(B, 1), micro_batch_size):
        ids = input_ids[start : start + micro_batch_size]
        lens = lengths[start : start + micro_batch_size]
        budget = budgets[start : start + micro_batch_size]
        max_new = int(budget.max()) if len(budget) else 1
        if pos_limit is not None and len(lens):
            max_new = max(1, min(max_new, pos_limit - int(lens.max())))
        left, attn = right_to_left_padded(ids, lens, pad_id)
        kwargs = dict(
            input_ids=left.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=max_new,
            do_sample=not greedy,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            return_dict_in_generate=True,
            output_logits=True,
            synced_gpus=synced,
            use_cache=True,
        )
        if not greedy:
            kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0)
        if stop_strings:
            kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
        if cfg.share_prompt_prefill and left.shape[1] > 1:
            kwargs["past_key_values"] = _shared_prefill(model, left, attn, device)
        out = model.generate(**kwargs)
        gen = out.sequences[:, left.shape[1] :]
        # Log-probs of the sampled tokens under the distribution we sampled from (temperature
        # applied), which is what the training side recomputes; top-p/top-k truncation is not.
        # One step at a time where the logits are: stacking them ([B, steps, vocab] in float32, 6 GiB
        # at batch 256 x 128 steps of a 49k vocabulary) and copying that to the host cost more than
        # the sampling itself on a GPU.
        scale = 1.0 if greedy else cfg.temperature
        lp = torch.stack([torch.gather((step.float() / scale).log_softmax(-1), 1, gen[:, t, None]).squeeze(1)
                          for t, step in enumerate(out.logits)], dim=1).cpu()
        gen = gen.cpu()
        results.append(_to_right_padded(ids, lens, gen, lp, eos_id, pad_id, tokenizer, stop_strings, budget))
    return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": pad_id})


def _shared_prefill(model, left: torch.Tensor, attn: torch.Tensor, device: torch.device):
    """A KV cache of every prompt but its last token, computed once per distinct prompt.

    GRPO repeats each prompt G times; HF `generate` would encode every copy. Here the distinct rows
    are encoded once and the cache rows copied to their repeats; `generate` then feeds only the last
    prompt token (it skips what the cache already holds), so outputs and log-probs are those of the
    plain call (same sampled tokens under the same seed, measured), with 1/G of the prefill work.
    """
    from transformers import DynamicCache

    uniq, inv = torch.unique(torch.cat([left, attn], dim=1), dim=0, return_inverse=True)
    width = left.shape[1]
    u_ids, u_attn = uniq[:, :width], uniq[:, width:]
    ids, mask = u_ids[:, :-1].to(device), u_attn[:, :-1].to(device)
    # The positions `generate` gives left-padded prompts (count of real tokens so far).
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    cache.batch_select_indices(inv.to(device))
    return cache


def _to_right_padded(ids, lens, gen, lp, eos_id, pad_id, tokenizer, stop_strings, budgets):
    """Generated rows cut at their end (EOS, stop string) or at their own token budget."""
    B, G = gen.shape
    budgets = budgets.clamp(max=G)
    gen_lens = budgets.clone()
    truncated = torch.ones(B, dtype=torch.bool)
    for i in range(B):
        row = gen[i, : int(budgets[i])]
        hits = (row == eos_id).nonzero()
        if len(hits):
            gen_lens[i] = int(hits[0]) + 1
            truncated[i] = False
        elif stop_strings:
            # HF stops at a stop string and pads the rest; the sample ended on purpose.
            text_end = _stop_string_end(row, pad_id, tokenizer, stop_strings)
            if text_end is not None:
                gen_lens[i] = text_end
                truncated[i] = False
    total = lens + gen_lens
    width = int(total.max())
    out_ids = torch.full((B, width), pad_id, dtype=torch.long)
    out_lp = torch.zeros((B, width), dtype=torch.float32)
    for i in range(B):
        n, g = int(lens[i]), int(gen_lens[i])
        out_ids[i, :n] = ids[i, :n]
        out_ids[i, n : n + g] = gen[i, :g]
        out_lp[i, n : n + g] = lp[i, :g]
    return BatchedDataDict(
        output_ids=out_ids,
        logprobs=out_lp,
        generation_lengths=gen_lens,
        unpadded_sequence_lengths=total,
        truncated=truncated,
    )


def _stop_string_end(tokens, pad_id, tokenizer, stop_strings) -> int | None:
    """Number of generated tokens up to the first token that completes a stop string, if any.

    Whether a prefix's text holds a stop string only turns from no to yes as the prefix grows, so a
    binary search finds the first such prefix in O(log n) decodes, not one decode per token. "Holds"
    rather than "ends with": HF also stops when a stop string ends inside a token.
    """
    toks = tokens.tolist()
    n = toks.index(pad_id) if pad_id in toks else len(toks)  # HF pads what follows a stop

    def holds(k: int) -> bool:
        text = tokenizer.decode(toks[:k], skip_special_tokens=False)
        return any(s in text for s in stop_strings)

    if n == 0 or not holds(n):
        return None
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
