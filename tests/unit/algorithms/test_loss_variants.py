"""Policy-loss variants (GSPO, CISPO), truncated / masked importance sampling, the Dr.GRPO
normaliser, their config rules and the loss registry, against hand-computed values and gradients.

As in test_loss_functions.py: prev_logprobs = 0 unless stated, so curr = log(r) picks the ratio r;
gradients come from torch.autograd.grad and are compared with numbers derived by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_like.algorithms.loss_functions import (
    LOSSES,
    ClippedPGLossConfig,
    ClippedPGLossFn,
    NLLLossFn,
    check_loss_name,
    clipped_pg_loss,
    get_loss_fn,
    register_loss,
)

D = torch.float64
LN2 = math.log(2.0)


def t(values):
    return torch.tensor(values, dtype=D)


def close(a, b, tol=1e-12):
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0)


def cfg(**overrides):
    return {"reference_policy_kl_penalty": 0.0, **overrides}


def loss_and_grads(curr, adv, mask=None, prev=None, gen=None, config=None):
    """(loss, metrics, d loss/d curr, d loss/d prev or None); gen = prev and ref = curr by default."""
    curr = curr.clone().requires_grad_(True)
    prev = (torch.zeros_like(curr) if prev is None else prev.clone()).requires_grad_(True)
    gen = prev.detach().clone() if gen is None else gen
    mask = torch.ones_like(curr) if mask is None else mask
    loss, metrics = clipped_pg_loss(curr, prev, gen, curr.detach(), adv, mask, config or cfg())
    g_curr, g_prev = torch.autograd.grad(loss, [curr, prev], allow_unused=True)
    return loss, metrics, g_curr, g_prev


# ---------------------------------------------------------------- GSPO ------------------------

# row 0: token log-ratios 2 ln1.1 and 0 -> s = exp(ln1.1) = 1.1 (inside [0.8, 1.2]), A = 2;
#        the third position is masked and holds garbage.
# row 1: log-ratios ln2 x3 -> s = 2, A = +1: max(-2, -1.2) = -1.2, clipped (no gradient).
# row 2: log-ratios ln4, 0 -> s = exp(ln4 / 2) = 2, A = -1: max(2, 1.2) = 2, unclipped.
GSPO_CURR = t([[2 * math.log(1.1), 0.0, 7.0], [LN2, LN2, LN2], [2 * LN2, 0.0, math.nan]])
GSPO_MASK = t([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
GSPO_ADV = t([2.0, 1.0, -1.0])


def test_gspo_token_level_value_gradient_and_metrics():
    loss, m, g, g_prev = loss_and_grads(GSPO_CURR, GSPO_ADV, GSPO_MASK, config=cfg(policy_loss="gspo"))
    # every token of a sequence carries pg_i: (2 * -2.2 + 3 * -1.2 + 2 * 2) / 7 tokens
    assert close(loss, (-4.4 - 3.6 + 4.0) / 7)
    # loss = sum_i n_i pg_i / N and d s_i/d curr_t = s_i / n_i, so each unclipped token gets
    # -A_i s_i / N: row 0 -2.2/7, row 2 +2/7; row 1 is clipped.
    assert close(g, [[-2.2 / 7, -2.2 / 7, 0.0], [0.0, 0.0, 0.0], [2 / 7, 2 / 7, 0.0]])
    assert close(g_prev, -g)  # s depends on curr - prev only
    assert m["probs_ratio"] == pytest.approx((2 * 1.1 + 3 * 2 + 2 * 2) / 7)
    assert m["probs_ratio_clamped"] == pytest.approx((2 * 1.1 + 3 * 1.2 + 2 * 1.2) / 7)
    assert m["clip_fraction"] == pytest.approx(5 / 7)
    # the token-level surrogate differs: row 2's tokens r = 4, 1 cost 4 + 1 instead of 2 + 2
    ppo, _, _, _ = loss_and_grads(GSPO_CURR, GSPO_ADV, GSPO_MASK)
    assert close(ppo, (-2 * 1.2 - 2.0 - 3.6 + 4.0 + 1.0) / 7)


def test_gspo_sequence_level_reduction():
    loss, _, g, _ = loss_and_grads(GSPO_CURR, GSPO_ADV, GSPO_MASK,
                                   config=cfg(policy_loss="gspo", token_level_loss=False))
    # mean of the rows' pg_i; d pg_i/d curr_t = -A_i s_i / n_i, divided by 3 rows
    assert close(loss, (-2.2 - 1.2 + 2.0) / 3)
    assert close(g, [[-1.1 / 3, -1.1 / 3, 0.0], [0.0, 0.0, 0.0], [1 / 3, 1 / 3, 0.0]])


# ---------------------------------------------------------------- CISPO -----------------------


def test_cispo_keeps_gradient_of_clipped_tokens():
    # r = 0.5, 1.5 (A = 2) and 1.1, 3 (A = -1); r_c = 0.8, 1.2, 1.1, 1.2.
    curr = torch.log(t([[0.5, 1.5], [1.1, 3.0]]))
    loss, m, g, g_prev = loss_and_grads(curr, t([2.0, -1.0]), config=cfg(policy_loss="cispo"))
    # pg = -A * r_c * curr
    expected = (-2 * 0.8 * math.log(0.5) - 2 * 1.2 * math.log(1.5)
                + 1.1 * math.log(1.1) + 1.2 * math.log(3.0)) / 4
    assert close(loss, expected)
    # d pg/d curr = -A r_c for every token, clipped ones included (PPO would give them 0)
    assert close(g, [[-1.6 / 4, -2.4 / 4], [1.1 / 4, 1.2 / 4]])
    assert g_prev is None  # the ratio is a stop-gradient weight: no path to prev
    assert m["clip_fraction"] == pytest.approx(3 / 4)
    assert m["probs_ratio_clamped"] == pytest.approx((0.8 + 1.2 + 1.1 + 1.2) / 4)


# ---------------------------------------------------------------- TIS / masked IS -------------


def test_truncated_importance_sampling():
    # r = 1, A = 1; w = exp(prev - gen) = 0.5, 2, 4, inf; C = 2.5 -> 0.5, 2, 2.5, 0 (non-finite).
    gen = t([[LN2, -LN2, -2 * LN2, -math.inf]])
    config = cfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.5)
    loss, m, g, _ = loss_and_grads(torch.zeros(1, 4, dtype=D), t([1.0]), gen=gen, config=config)
    assert close(loss, (-0.5 - 2.0 - 2.5 - 0.0) / 4)
    assert close(g, [[-0.5 / 4, -2.0 / 4, -2.5 / 4, 0.0]])  # -A r w / N
    assert m["is_truncated_fraction"] == pytest.approx(1 / 4)  # only w = 4; inf became 0
    assert "is_masked_fraction" not in m


def test_masked_importance_sampling_with_and_without_truncation():
    # r = 1, A = 1, w = 0.25, 0.5, 2, 3, inf; mask [0.4, 2.5] zeroes 0.25, 3 and inf.
    gen = t([[2 * LN2, LN2, -LN2, -math.log(3.0), -math.inf]])
    base = cfg(use_importance_sampling_correction=True, importance_sampling_mask=[0.4, 2.5])
    loss, m, g, _ = loss_and_grads(torch.zeros(1, 5, dtype=D), t([1.0]), gen=gen, config=base)
    # masked tokens stay in the denominator (5)
    assert close(loss, (-0.5 - 2.0) / 5)
    assert close(g, [[0.0, -0.5 / 5, -2.0 / 5, 0.0, 0.0]])
    assert m["is_masked_fraction"] == pytest.approx(3 / 5)
    assert "is_truncated_fraction" not in m
    # adding C = 1.5 caps the kept w = 2; masked tokens are not counted as truncated
    loss, m, g, _ = loss_and_grads(torch.zeros(1, 5, dtype=D), t([1.0]), gen=gen,
                                   config={**base, "truncated_importance_sampling_ratio": 1.5})
    assert close(loss, (-0.5 - 1.5) / 5)
    assert close(g, [[0.0, -0.5 / 5, -1.5 / 5, 0.0, 0.0]])
    assert m["is_masked_fraction"] == pytest.approx(3 / 5)
    assert m["is_truncated_fraction"] == pytest.approx(1 / 5)


def test_is_weight_applies_to_gspo_and_cispo_surrogates():
    # one row, r = 1 per token (so s = 1), A = 1, w = 2 and 4 capped at 3.
    gen = t([[-LN2, -2 * LN2]])
    extra = dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=3.0)
    curr = torch.zeros(1, 2, dtype=D)
    loss, _, g, _ = loss_and_grads(curr, t([1.0]), gen=gen, config=cfg(policy_loss="gspo", **extra))
    # pg_i = -s = -1 on both tokens, times w; d s/d curr_t = s/2, so d loss/d curr_t = -(2+3)/2 / 2
    assert close(loss, (-2.0 - 3.0) / 2)
    assert close(g, [[-1.25, -1.25]])
    loss, _, g, _ = loss_and_grads(curr, t([1.0]), gen=gen, config=cfg(policy_loss="cispo", **extra))
    assert close(loss, 0.0)  # curr = 0: -A r_c w curr
    assert close(g, [[-2.0 / 2, -3.0 / 2]])


# ---------------------------------------------------------------- Dr.GRPO ---------------------

# r = 1 so l = -A per valid token. Row 0: 2 tokens, A = 1; row 1: none; row 2: 1 token, A = 3.
DR_MASK = t([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
DR_ADV = t([1.0, 5.0, 3.0])


@pytest.mark.parametrize("token_level", [True, False])
def test_dr_grpo_normaliser_overrides_token_level_loss(token_level):
    config = cfg(loss_length_normalizer=4, token_level_loss=token_level)
    loss, _, g, _ = loss_and_grads(torch.zeros(3, 3, dtype=D), DR_ADV, DR_MASK, config=config)
    # sum(l * mask) / (n_seq * L) = (-1 - 1 - 3) / (2 * 4); the empty row is not a sequence
    assert close(loss, -5 / 8)
    assert close(g, [[-1 / 8, -1 / 8, 0.0], [0.0, 0.0, 0.0], [-3 / 8, 0.0, 0.0]])


def test_dr_grpo_microbatches_sum_to_the_batch_loss():
    fn = ClippedPGLossFn(cfg(loss_length_normalizer=4))
    assert fn.loss_type == "sequence"
    z = torch.zeros(3, 3, dtype=D)
    data = {"token_mask": DR_MASK, "advantages": DR_ADV, "prev_logprobs": z,
            "generation_logprobs": z, "reference_policy_logprobs": z}
    g_seqs, g_toks = torch.tensor(2.0), torch.tensor(3.0)  # what the worker counts (all ranks)
    curr = z.clone().requires_grad_(True)
    whole, m = fn(curr, data, g_seqs, g_toks)
    assert close(whole, -5 / 8) and m["num_valid_seqs"] == 2.0
    # two micro-batches (or two ranks' shards): -2/8 + -3/8
    parts = [fn(curr[a:b], {k: v[a:b] for k, v in data.items()}, g_seqs, g_toks)[0]
             for a, b in ((0, 1), (1, 3))]
    assert close(parts[0], -2 / 8) and close(parts[1], -3 / 8)
    (grad,) = torch.autograd.grad(parts[0] + parts[1], [curr])
    assert close(grad, [[-1 / 8, -1 / 8, 0.0], [0.0, 0.0, 0.0], [-3 / 8, 0.0, 0.0]])
    with pytest.raises(ValueError, match="global_valid_seqs"):
        fn(curr, data, torch.tensor(1.0), g_toks)  # a per-micro-batch count, not the global one


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_variants_microbatches_match_the_pure_function(policy_loss):
    # Random batch, every new option on: micro-batch losses and gradients sum to the whole
    # batch's, which equals clipped_pg_loss on the combined mask.
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g, dtype=D) * 0.3 - 1.0
    mask = (torch.rand(6, 5, generator=g) > 0.3).to(D)
    mask[2] = 0
    data = {"token_mask": mask, "advantages": torch.randn(6, generator=g, dtype=D),
            "prev_logprobs": base + 0.2 * torch.randn(6, 5, generator=g, dtype=D),
            "generation_logprobs": base + 0.3 * torch.randn(6, 5, generator=g, dtype=D),
            "reference_policy_logprobs": base + 0.3 * torch.randn(6, 5, generator=g, dtype=D)}
    config = ClippedPGLossConfig(policy_loss=policy_loss, reference_policy_kl_penalty=0.05,
                                 use_importance_sampling_correction=True,
                                 truncated_importance_sampling_ratio=1.1,
                                 importance_sampling_mask=(0.8, 1.6), loss_length_normalizer=7)
    fn = ClippedPGLossFn(config)
    g_seqs, g_toks = (mask.sum(-1) > 0).sum(), mask.sum()
    curr = base.clone().requires_grad_(True)
    whole, m = fn(curr, data, g_seqs, g_toks)
    assert 0 < m["is_masked_fraction"] < 1 and 0 < m["is_truncated_fraction"] < 1
    (whole_grad,) = torch.autograd.grad(whole, [curr])
    pure, _ = clipped_pg_loss(base, data["prev_logprobs"], data["generation_logprobs"],
                              data["reference_policy_logprobs"], data["advantages"], mask, config)
    assert close(whole, pure)
    total = sum(fn(curr[a:b], {k: v[a:b] for k, v in data.items()}, g_seqs, g_toks)[0]
                for a, b in ((0, 2), (2, 3), (3, 6)))
    (grad,) = torch.autograd.grad(total, [curr])
    assert close(total, whole) and close(grad, whole_grad)


# ---------------------------------------------------------------- config rules ----------------


@pytest.mark.parametrize("bad, key", [
    ({"policy_loss": "ppo"}, "policy_loss"),
    ({"policy_loss": "gspo", "ratio_clip_c": 3.0}, "ratio_clip_c"),
    ({"policy_loss": "cispo", "ratio_clip_c": 3.0}, "ratio_clip_c"),
    ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 0.0},
     "truncated_importance_sampling_ratio"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": math.inf},
     "truncated_importance_sampling_ratio"),
    ({"importance_sampling_mask": [0.5, 2.0]}, "importance_sampling_mask"),
    ({"use_importance_sampling_correction": True, "importance_sampling_mask": [2.0, 0.5]},
     "importance_sampling_mask"),
    ({"use_importance_sampling_correction": True, "importance_sampling_mask": [1.0, 1.0]},
     "importance_sampling_mask"),
    ({"use_importance_sampling_correction": True, "importance_sampling_mask": [-0.1, 2.0]},
     "importance_sampling_mask"),
    ({"use_importance_sampling_correction": True, "importance_sampling_mask": [0.5, math.inf]},
     "importance_sampling_mask"),
    ({"use_importance_sampling_correction": True, "importance_sampling_mask": [0.5]},
     "importance_sampling_mask"),
    ({"loss_length_normalizer": 0}, "loss_length_normalizer"),
    ({"loss_length_normalizer": 2.5}, "loss_length_normalizer"),
    ({"loss_length_normalizer": True}, "loss_length_normalizer"),
    ({"name": ""}, "name"),
])
def test_config_errors_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        ClippedPGLossConfig(**bad)
    curr = torch.zeros(1, 1, dtype=D)
    with pytest.raises(ValueError, match=key):
        clipped_pg_loss(curr, curr, curr, curr, t([1.0]), curr, bad)


def test_dual_clip_refused_on_assignment_too():
    config = ClippedPGLossConfig(ratio_clip_c=3.0)
    with pytest.raises(ValueError, match="ratio_clip_c"):
        config.policy_loss = "gspo"


def test_config_round_trips_through_json():
    config = ClippedPGLossConfig(policy_loss="gspo", use_importance_sampling_correction=True,
                                 importance_sampling_mask=[0.5, 2], loss_length_normalizer=512)
    dumped = json.loads(config.model_dump_json())
    assert dumped["policy_loss"] == "gspo" and dumped["importance_sampling_mask"] == [0.5, 2.0]
    assert dumped["loss_length_normalizer"] == 512 and dumped["name"] == "clipped_pg"
    assert ClippedPGLossConfig.model_validate(dumped) == config


def test_get_loss_fn_builds_from_the_loss_config():
    config = ClippedPGLossConfig(policy_loss="cispo", token_level_loss=False)
    fn = get_loss_fn(config.name, config)
    assert isinstance(fn, ClippedPGLossFn) and fn.config == config and fn.loss_type == "sequence"
    check_loss_name("clipped_pg")
    check_loss_name("nll")
    with pytest.raises(KeyError, match="did you mean 'clipped_pg'"):
        check_loss_name("clipped_pgg")


def test_loss_registry_overwrite_import_paths_and_isolation():
    with LOSSES.isolated():
        register_loss("lazy_nll", "nemo_like.algorithms.loss_functions:NLLLossFn")
        assert isinstance(get_loss_fn("lazy_nll"), NLLLossFn)
        with pytest.raises(ValueError, match="overwrite=True"):
            register_loss("nll", ClippedPGLossFn)
        register_loss("nll", ClippedPGLossFn, overwrite=True)
        assert isinstance(get_loss_fn("nll"), ClippedPGLossFn)
        with pytest.raises(TypeError, match="factory"):
            register_loss("not_callable", 3)
    assert isinstance(get_loss_fn("nll"), NLLLossFn) and "lazy_nll" not in LOSSES
