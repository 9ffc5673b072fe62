"""Log-probs computed only where the loss reads them (``selected_logits``) equal the full computation
there, with the same loss and gradients, packed or not, with and without the top-k parts."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import grpo_batch, pg_train_data
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.hf_worker import _attention_mask, token_logprobs
from nemo_like.models.policy.packing import packed_token_logprobs, plan_microbatches
from nemo_like.models.policy.selected_logits import can_select, logits_at


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=72, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                        attn_implementation="sdpa")).float()


def _gemma2():
    """A model that soft-caps its logits after the output layer: the cap must still apply."""
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          final_logit_softcapping=5.0, attn_implementation="eager")).float()


@pytest.mark.parametrize("make", [_llama, _gemma2])
def test_unpacked_selected_logprobs_equal_the_full_ones_where_needed_and_zero_elsewhere(make):
    model = make()
    ids, lengths, tm = grpo_batch(model.config.vocab_size, prompt=9, T=24)
    mask = _attention_mask(ids, lengths)
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 0.7)
        full_ids, full_top = token_logprobs(model, ids, mask, 0.7, topk=5)[1:]
        sel = token_logprobs(model, ids, mask, 0.7, need=tm)
        _, sel_ids, sel_top = token_logprobs(model, ids, mask, 0.7, topk=5, need=tm)
        _, sel_given = token_logprobs(model, ids, mask, 0.7, topk=full_ids, need=tm)
    on = tm.bool()
    on[:, 0] = False
    assert on.sum() > 20 and (~on & (mask > 0)).sum() > 20  # both kinds of position are in the batch
    assert torch.allclose(sel[on], full[on], atol=1e-5)
    assert (sel[~on] == 0).all() and (full[~on & (mask > 0)] != 0).any()
    assert torch.equal(sel_ids[on], full_ids[on]) and torch.allclose(sel_top[on], full_top[on], atol=1e-5)
    assert torch.allclose(sel_given[on], full_top[on], atol=1e-5) and (sel_given[~on] == 0).all()


def test_packed_loss_and_gradients_equal_the_full_computation():
    model = _llama()
    ids, lengths, tm = grpo_batch(512, prompt=9, T=24)
    B, T = ids.shape
    data, g = pg_train_data(model, ids, lengths, tm)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    toks, seqs = float(tm.sum()), float(B)
    top_ids = torch.randint(0, 512, (B, T, 4), generator=g)

    def run(packing: bool, select: bool):
        model.zero_grad()
        cfg = PolicyConfig(model_name="x", max_total_sequence_length=T, train_global_batch_size=B,
                           train_micro_batch_size=B, sequence_packing={"enabled": packing,
                                                                       "max_tokens_per_microbatch": 96})
        total, computed = 0.0, 0
        for mb in plan_microbatches(data, cfg, B):
            need = mb.data["token_mask"] if select else None
            tk = top_ids[mb.idx][:, : mb.data["input_ids"].shape[1]]
            if mb.packed is not None:
                lp, top = packed_token_logprobs(model, mb.packed, 1.0, tk, need)
                computed += mb.packed.tokens_computed
            else:
                x = mb.data["input_ids"]
                lp, top = token_logprobs(model, x, _attention_mask(x, mb.data["input_lengths"]), 1.0, tk, need)
            loss, _ = loss_fn(lp, mb.data, seqs, toks)
            m = mb.data["token_mask"][:, : top.shape[1], None].float()
            loss = loss + (top.exp() * m).sum() / toks  # a top-k term, as the distillation loss adds
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    base_loss, base_grads = run(False, False)
    for packing, select in [(False, True), (True, True), (True, False)]:
        loss, grads = run(packing, select)
        assert loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7), (packing, select)
        for n in base_grads:
            assert torch.allclose(grads[n], base_grads[n], rtol=1e-4, atol=1e-6), (packing, select, n)


def test_the_output_layer_sees_only_the_selected_positions():
    model = _llama()
    ids, lengths, tm = grpo_batch(512, groups=1, G=2, prompt=9, T=24)
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    with torch.no_grad():
        token_logprobs(model, ids, _attention_mask(ids, lengths), 1.0, need=tm)
    hook.remove()
    needed = int(tm[:, 1:].sum())
    assert shapes == [(needed, 512)] and needed < ids.numel() // 2


def test_a_model_without_an_output_layer_or_a_mask_is_computed_whole():
    model = _llama()
    ids, lengths, tm = grpo_batch(512, groups=1, G=2, prompt=9, T=24)
    mask = _attention_mask(ids, lengths)
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 1.0)
        # a mask with nothing to train: every position, as before
        assert torch.equal(token_logprobs(model, ids, mask, 1.0, need=torch.zeros_like(tm)), full)
    model.get_output_embeddings = lambda: None
    assert not can_select(model)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids, mask, 1.0, need=tm), full)


def test_a_forward_that_reshapes_the_logits_is_refused_once_then_computed_whole():
    model = _llama()
    ids, lengths, tm = grpo_batch(512, groups=1, G=2, prompt=9, T=24)
    mask = _attention_mask(ids, lengths)
    inner = model.forward
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 1.0)

    def forward(**kw):  # a model that puts a batch dimension back on whatever its head returned
        out = inner(**kw)
        if out.logits.dim() == 2:
            out.logits = out.logits[None]
        return out
    model.forward = forward
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="reshaped"):
            logits_at(model, torch.tensor([0, 1]), input_ids=ids, attention_mask=mask)
        assert can_select(model)
        got = token_logprobs(model, ids, mask, 1.0, need=tm)
    assert not can_select(model)
    assert torch.allclose(got, full, atol=1e-6)
