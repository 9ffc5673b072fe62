"""Sequence packing and token-budget micro-batches: the same log-probs, loss and gradients as the
right-padded path, on the tiny char Llama and on a random model of the SmolLM2/Qwen2 shape."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import grpo_batch, pg_train_data
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.hf_worker import _attention_mask, token_logprobs
from nemo_like.models.policy.packing import (
    ATTENTION_MAC_WEIGHT,
    attention_cost_ratio,
    build_packed,
    check_packing_supported,
    count_microbatches,
    group_rows,
    packed_token_logprobs,
    packing_cost,
    plan_microbatches,
    plan_rows,
    plan_rows_auto,
    shared_prefix_lengths,
)
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


def _random_lm(arch: str, impl: str = "sdpa"):
    """A random float32 model: Qwen2-shaped, or SmolLM2-shaped (a Llama with GQA, 9 query / 3 kv
    heads, tied embeddings), both scaled down."""
    torch.manual_seed(0)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                            attn_implementation=impl)).float()
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=72, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                        attn_implementation=impl)).float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_pack")
    tok = build_char_tokenizer(d)
    return build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64, seed=0).float()


def _models():
    return [("qwen2-sdpa", _random_lm("qwen2", "sdpa")), ("qwen2-eager", _random_lm("qwen2", "eager")), ("smollm2-shape", _random_lm("smollm2"))]


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("row_length,max_tokens", [(30, 30), (48, 96), (200, 200)])
def test_packed_logprobs_equal_unpadded(share, row_length, max_tokens, tiny):
    for name, model in _models() + [("tiny-char-llama", tiny)]:
        ids, lengths, tm = grpo_batch(model.config.vocab_size)
        with torch.no_grad():
            ref = token_logprobs(model, ids, _attention_mask(ids, lengths), 1.0)
            prefix = shared_prefix_lengths(ids, tm, lengths) if share else None
            seen = torch.zeros(ids.shape[0], dtype=torch.bool)
            for rows in group_rows(plan_rows(ids, lengths, row_length, prefix), max_tokens):
                packed = build_packed(ids, lengths, rows)
                assert packed.tokens_computed <= max_tokens
                lp = packed_token_logprobs(model, packed, 1.0)
                want = ref[packed.sample_idx, : packed.width] * packed.valid
                assert (lp - want).abs().max() < 1e-5, (name, share, row_length)
                seen[packed.sample_idx] = True
        assert seen.all()


def test_shared_prefix_computes_each_prompt_once():
    ids, lengths, tm = grpo_batch(512, groups=2, G=4, prompt=6)
    plain = build_packed(ids, lengths, plan_rows(ids, lengths, 200))
    shared = build_packed(ids, lengths, plan_rows(ids, lengths, 200, shared_prefix_lengths(ids, tm, lengths)))
    assert plain.tokens_real == int(lengths.sum())
    # Two prompts of 6 tokens, each computed once instead of four times.
    assert shared.tokens_real == int(lengths.sum()) - 2 * 3 * 6


def test_packed_loss_and_gradients_equal_unpadded():
    model = _random_lm("qwen2")
    ids, lengths, tm = grpo_batch(512, groups=2, G=4)
    B, T = ids.shape
    data, _ = pg_train_data(model, ids, lengths, tm)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    toks, seqs = float(tm.sum()), float(B)

    def grads(packing: bool):
        model.zero_grad()
        cfg = PolicyConfig(model_name="x", max_total_sequence_length=T, train_global_batch_size=B,
                           train_micro_batch_size=B, sequence_packing={"enabled": packing,
                                                                       "max_tokens_per_microbatch": 64})
        total = 0.0
        for mb in plan_microbatches(data, cfg, B):
            lp = (packed_token_logprobs(model, mb.packed, 1.0) if mb.packed is not None else
                  token_logprobs(model, mb.data["input_ids"], _attention_mask(mb.data["input_ids"], mb.data["input_lengths"]), 1.0))
            loss, _ = loss_fn(lp, mb.data, seqs, toks)
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_a, g_a = grads(False)
    loss_b, g_b = grads(True)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    for n in g_a:
        assert torch.allclose(g_a[n], g_b[n], rtol=1e-4, atol=1e-6), n


def test_token_budget_microbatches_fit_the_budget_and_cover_the_batch():
    ids, lengths, tm = grpo_batch(512, groups=4, G=4, T=30)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=tm)
    seen = []
    for idx, mb in data.make_token_budget_microbatch_iterator(64):
        assert mb["input_ids"].numel() <= 64 or len(idx) == 1
        assert mb["input_ids"].shape[1] == int(lengths[idx].max())
        assert torch.equal(mb["input_ids"], ids[idx, : mb["input_ids"].shape[1]])
        seen += idx
    assert sorted(seen) == list(range(16))
    with pytest.raises(ValueError, match="longer than the micro-batch token budget"):
        next(data.make_token_budget_microbatch_iterator(8))


def test_padding_efficiency_rises_with_packing():
    ids, lengths, tm = grpo_batch(512, groups=4, G=4, T=40)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=tm)
    base = dict(model_name="x", max_total_sequence_length=40, train_global_batch_size=16, train_micro_batch_size=16)

    def eff(cfg):
        mbs = plan_microbatches(data, PolicyConfig(**cfg), 16)
        return sum(m.tokens_real for m in mbs) / sum(m.tokens_computed for m in mbs)

    padded = eff(base)
    packed = eff(base | {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 160,
                                              "share_prompt_prefix": False}})
    # One micro-batch comes back as given: as wide as the batch.
    assert padded == pytest.approx(float(lengths.sum()) / ids.numel())
    assert packed > 0.9 > padded


@pytest.mark.parametrize("cfg", [
    {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 96}},
    {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 4096}},
    {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 96, "row_length": 48,
                          "share_prompt_prefix": False}},
    {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 120}},
    {},
])
def test_count_microbatches_is_the_plans_length(cfg):
    ids, lengths, tm = grpo_batch(512, groups=4, G=4, T=40)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=tm)
    pc = PolicyConfig(model_name="x", max_total_sequence_length=40, train_global_batch_size=16,
                      train_micro_batch_size=5, **cfg)
    for ratio in (0.0, 0.01):
        n = len(plan_microbatches(data, pc, 5, ratio))
        assert count_microbatches(data, pc, 5, ratio) == n
    # The budgets above give one pass for the whole batch only where it fits.
    assert (n == 1) == (cfg.get("sequence_packing", {}).get("max_tokens_per_microbatch") == 4096)


def test_chosen_row_length_pays_less_attention_than_the_longest_rows():
    # Eight 100-token samples: one 800-token row wastes nothing on padding but attends over 800
    # keys; rows of one sample each attend over 100. With attention priced, the short rows win.
    ids = torch.randint(0, 50, (8, 100), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((8,), 100)
    long_rows = plan_rows(ids, lengths, 800)
    assert [len(r) for r in long_rows] == [8]
    short = plan_rows_auto(ids, lengths, 800, 800, ratio=0.01)
    assert [sum(u.size for u in r) for r in short] == [100] * 8
    assert packing_cost(group_rows(short, 800), 0.01) == pytest.approx(8 * 100 * (1 + 0.01 * 100))
    # Attention free (ratio 0, or a config that does not say): the longest rows, as before.
    assert [len(r) for r in plan_rows_auto(ids, lengths, 800, 800, ratio=0.0)] == [8]


def test_chosen_row_length_weighs_padding_against_attention():
    # Samples of 100 and 60 tokens in one 800-token pass: rows of 100 put each 60-token sample
    # beside 40 padding positions (800 computed), rows of 200 or more attend over twice as many
    # keys; rows of 160-199 hold a 100 and a 60 with no padding (640 computed). Every other
    # candidate costs at least as much.
    ids = torch.randint(0, 50, (8, 100), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([100, 60] * 4)
    rows = plan_rows_auto(ids, lengths, 400, 800, ratio=0.002)
    assert sorted(sum(u.size for u in r) for r in rows) == [160] * 4
    best = packing_cost(group_rows(rows, 800), 0.002)
    assert best == pytest.approx(640 * (1 + 0.002 * 160))
    for n in (100, 200, 320, 400):
        assert packing_cost(group_rows(plan_rows(ids, lengths, n), 800), 0.002) > best


def test_attention_cost_ratio_reads_the_model_shape(tiny):
    # tiny: 4 heads covering the hidden size: w * 2 * hidden / (4 * hidden^2 + 3 * hidden * mlp).
    w, c = ATTENTION_MAC_WEIGHT, tiny.config
    linear = 4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size
    assert attention_cost_ratio(c) == pytest.approx(w * 2 * c.hidden_size / linear)
    gqa = _random_lm("smollm2").config  # 9 query heads of 8, 3 kv heads: k and v are a third of q
    assert attention_cost_ratio(gqa) == pytest.approx(w * 2 * 72 / (2 * 72 * 72 + 2 * 72 * 24 + 3 * 72 * 192))
    assert attention_cost_ratio(object()) == 0.0  # not a transformer config: the longest rows


def test_chosen_rows_give_the_unpadded_logprobs(tiny):
    ids, lengths, tm = grpo_batch(tiny.config.vocab_size, groups=4, G=4, T=30)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=tm)
    cfg = PolicyConfig(model_name="x", max_total_sequence_length=30, train_global_batch_size=16,
                       train_micro_batch_size=16, sequence_packing={"enabled": True, "max_tokens_per_microbatch": 240})
    with torch.no_grad():
        ref = token_logprobs(tiny, ids, _attention_mask(ids, lengths), 1.0)
        widths, seen = set(), []
        for mb in plan_microbatches(data, cfg, 16, attention_cost_ratio(tiny.config)):
            lp = packed_token_logprobs(tiny, mb.packed, 1.0)
            assert (lp - ref[mb.packed.sample_idx, : mb.packed.width] * mb.packed.valid).abs().max() < 1e-5
            widths.add(mb.packed.input_ids.shape[1])
            seen += mb.idx
    assert sorted(seen) == list(range(16))
    assert max(widths) < cfg.packing_row_length  # shorter rows than the 120-token cap were chosen


def test_budget_smaller_than_longest_sample_is_a_config_error():
    with pytest.raises(ValueError, match=r"policy.sequence_packing.max_tokens_per_microbatch \(32\) is smaller than the longest"):
        PolicyConfig(model_name="x", max_total_sequence_length=48, sequence_packing={"enabled": True, "max_tokens_per_microbatch": 32})
    with pytest.raises(ValueError, match=r"policy.dynamic_batching.max_tokens_per_microbatch \(16\)"):
        PolicyConfig(model_name="x", max_total_sequence_length=48, dynamic_batching={"enabled": True, "max_tokens_per_microbatch": 16})
    with pytest.raises(ValueError, match="enable one of them"):
        PolicyConfig(model_name="x", sequence_packing={"enabled": True}, dynamic_batching={"enabled": True})
    # Off, a small budget is nobody's business.
    PolicyConfig(model_name="x", max_total_sequence_length=48, sequence_packing={"max_tokens_per_microbatch": 32})
    ids = torch.zeros(1, 50, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit a packed row"):
        plan_rows(ids, torch.tensor([50]), 40)


def test_packing_refused_on_attention_that_cannot_confine_sequences():
    flash = _random_lm("qwen2")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="'flash_attention_2' cannot confine packed sequences"):
        check_packing_supported(flash)

    class IgnoresMask(Qwen2ForCausalLM):
        # An injected fault: attention that silently drops the mask it is given.
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
            return super().forward(input_ids=input_ids, **kw)

    leaky = IgnoresMask(_random_lm("qwen2").config)
    with pytest.raises(ValueError, match="does not confine packed sequences"):
        check_packing_supported(leaky)
    check_packing_supported(_random_lm("qwen2"))  # a model that does confine them passes
