"""Batches for the model tests: token ids right-padded into ``input_ids`` / ``input_lengths``, and
GRPO training batches of shared prompts."""

from __future__ import annotations

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.policy.hf_worker import _attention_mask, token_logprobs


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


def grpo_batch(vocab: int, groups: int = 3, G: int = 4, prompt: int = 6, T: int = 22, seed: int = 0):
    """``groups`` prompts x G completions of random lengths: (ids, lengths, token_mask), the loss on
    the completion tokens."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = torch.randint(prompt + 1, T + 1, (B,), generator=g)
    for k in range(groups):
        ids[k * G : (k + 1) * G, :prompt] = ids[k * G, :prompt]
    token_mask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B):
        token_mask[i, prompt : lengths[i]] = 1
        ids[i, lengths[i]:] = 0
    return ids, lengths, token_mask


def pg_train_data(model, ids: torch.Tensor, lengths: torch.Tensor, token_mask: torch.Tensor, seed: int = 3):
    """A policy-gradient training batch over ``ids``: random advantages, the model's own log-probs as
    the reference, slightly moved as the previous ones. Returns it and the generator, for more draws."""
    B, T = ids.shape
    g = torch.Generator().manual_seed(seed)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(B),
                           advantages=torch.randn(B, generator=g))
    with torch.no_grad():
        old = token_logprobs(model, ids, _attention_mask(ids, lengths), 1.0)
    data["prev_logprobs"] = old + 0.01 * torch.randn(B, T, generator=g)
    data["generation_logprobs"] = data["prev_logprobs"]
    data["reference_policy_logprobs"] = old
    return data, g
