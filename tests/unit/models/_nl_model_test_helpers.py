"""Prompt batches for the model tests: token ids right-padded into ``input_ids`` / ``input_lengths``."""

from __future__ import annotations

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict


def padded_batch(token_lists: list[list[int]], pad_id: int) -> BatchedDataDict:
    lens = torch.tensor([len(t) for t in token_lists])
    ids = torch.full((len(token_lists), int(lens.max())), pad_id)
    for i, t in enumerate(token_lists):
        ids[i, : len(t)] = torch.tensor(t)
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def tokenized(tok, texts: list[str]) -> BatchedDataDict:
    """Each text's plain token ids."""
    return padded_batch([tok(t, add_special_tokens=False)["input_ids"] for t in texts], tok.pad_token_id)


def chat_prompts(tok, texts: list[str], G: int = 1) -> BatchedDataDict:
    """Each text as a user turn through the chat template (ready for the assistant), repeated G times."""
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in texts]
    return tokenized(tok, rendered).repeat_interleave(G)


def assert_same_generation(ref: BatchedDataDict, out: BatchedDataDict) -> None:
    """Two generations of the same prompts agree: tokens, lengths and truncation exactly, log-probs
    to float tolerance."""
    assert torch.equal(ref["output_ids"], out["output_ids"])
    assert torch.equal(ref["generation_lengths"], out["generation_lengths"])
    assert torch.equal(ref["unpadded_sequence_lengths"], out["unpadded_sequence_lengths"])
    assert torch.equal(ref["truncated"], out["truncated"])
    torch.testing.assert_close(ref["logprobs"], out["logprobs"], atol=1e-4, rtol=0)
