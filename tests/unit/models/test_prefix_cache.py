"""Prefix caching: a next turn prefilled on top of its episode's cached KV gives the tokens and
log-probs of a full prefill; the cache empties when the weights change and keeps to its budget."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import chat_prompts

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.engine import continuous_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.prefix_cache import PrefixCache
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

CPU = torch.device("cpu")
CFG = GenerationConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = build_char_tokenizer(tmp_path_factory.mktemp("tiny_prefix"))
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256, seed=0)
    with torch.no_grad():  # sharper weights: varied greedy text, no near ties (as in test_engine)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return tok, model.float().eval()


def _gen(model, tok, data, cache=None, slots=4, greedy=True):
    return continuous_generate(model, tok, data, CFG, greedy=greedy, max_total_length=200, slots=slots, device=CPU,
                               prefix_cache=cache)


def _next_turn(tok, first: BatchedDataDict, notes: list[str]) -> BatchedDataDict:
    """Each row's whole first turn (prompt and generated tokens) and an observation after it."""
    rows = []
    for i, note in enumerate(notes):
        n = int(first["unpadded_sequence_lengths"][i])
        obs = tok(f"<|im_end|>\n<|im_start|>tool\n{note}<|im_end|>\n<|im_start|>assistant\n",
                  add_special_tokens=False)["input_ids"]
        rows.append(torch.cat([first["output_ids"][i, :n], torch.tensor(obs)]))
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tok.pad_token_id)
    return BatchedDataDict(input_ids=ids, input_lengths=lengths)


def test_next_turns_on_cached_prefixes_equal_a_full_prefill(tiny):
    tok, model = tiny
    first = chat_prompts(tok, ["1+2=", "13+45=", "99+1=", "5+60=", "7*7=", "70-8="], 1)
    cache = PrefixCache(max_tokens=10_000)
    out1 = _gen(model, tok, first, cache)
    assert len(cache.entries) == 6 and cache.hits == 0
    nxt = _next_turn(tok, out1, ["12", "x", "3", "long note " * 3, "", "49"])
    with_cache = _gen(model, tok, nxt, cache)
    plain = _gen(model, tok, nxt)
    assert cache.hits == 6  # every second turn found its first turn
    # Each reused its prompt and all its generated tokens but the last (never fed to the model).
    assert cache.hit_tokens == int((out1["unpadded_sequence_lengths"] - 1).sum())
    assert torch.equal(with_cache["output_ids"], plain["output_ids"])
    assert torch.equal(with_cache["generation_lengths"], plain["generation_lengths"])
    torch.testing.assert_close(with_cache["logprobs"], plain["logprobs"], atol=1e-4, rtol=0)
    # A third turn, with more rows than slots, mixing cached and uncached prompts.
    mixed = BatchedDataDict.from_batches([_next_turn(tok, with_cache, ["a"] * 6), first],
                                         pad_value_dict={"input_ids": tok.pad_token_id})
    hits = cache.hits
    got, ref = _gen(model, tok, mixed, cache, slots=3), _gen(model, tok, mixed, slots=3)
    assert cache.hits - hits == 6
    assert torch.equal(got["output_ids"], ref["output_ids"])


def test_sampled_next_turn_logprobs_match_a_teacher_forced_pass(tiny):
    tok, model = tiny
    cache = PrefixCache(max_tokens=10_000)
    torch.manual_seed(0)
    out1 = _gen(model, tok, chat_prompts(tok, ["1+2=", "13+45="], 2), cache, greedy=False)
    out2 = _gen(model, tok, _next_turn(tok, out1, ["7"] * 4), cache, greedy=False)
    assert cache.hits == 4
    for i in range(4):
        n, start = int(out2["unpadded_sequence_lengths"][i]), int(out2["unpadded_sequence_lengths"][i] - out2["generation_lengths"][i])
        ids = out2["output_ids"][i : i + 1, :n]
        with torch.no_grad():
            lp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
        torch.testing.assert_close(out2["logprobs"][i, start:n], lp[start - 1 :], atol=1e-4, rtol=0)


def test_changed_weights_empty_the_cache(tiny):
    tok, model = tiny
    cache = PrefixCache(max_tokens=10_000)
    out1 = _gen(model, tok, chat_prompts(tok, ["1+2=", "5+5="], 1), cache)
    assert len(cache.entries) == 2
    w = next(model.parameters())
    with torch.no_grad():
        w.add_(0.0)  # an in-place write, as an optimizer step or a refit makes
    _gen(model, tok, _next_turn(tok, out1, ["1", "2"]), cache)
    assert cache.hits == 0  # stale KV is never reused


def test_the_budget_keeps_the_most_recent_prefixes():
    cache = PrefixCache(max_tokens=10)
    kv = [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]
    cache.put((1, 2, 3, 4), kv)
    cache.put((5, 6, 7, 8), kv)
    cache.put((9, 9, 9, 9), kv)  # 12 tokens > 10: the oldest goes
    assert list(cache.entries) == [(5, 6, 7, 8), (9, 9, 9, 9)] and cache.tokens == 8
    assert cache.take([1, 2, 3, 4, 5]) is None
    n, _ = cache.take([5, 6, 7, 8, 0])
    assert n == 4 and cache.tokens == 4 and (5, 6, 7, 8) not in cache.entries
    assert cache.take([9, 9, 9, 9]) is None  # a whole prompt cached leaves nothing to prefill: no hit
    cache.put(tuple(range(11)), kv)  # longer than the budget: not kept
    assert cache.tokens == 4
