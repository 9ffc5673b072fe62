"""Loss functions against hand-computed values and hand-derived gradients.

Conventions: prev_logprobs = 0, so curr = log(r) picks the ratio r directly. Hand gradients of the
per-token loss w.r.t. curr: unclipped PG token -> -A*r, clipped/dual-clipped token -> 0,
k3 KL -> -beta*(exp(d) - 1) with d = ref - curr (0 when a clamp is active); the reduction then
divides by the token count (token level) or by (tokens in the sequence * valid sequences).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    NLLLossFn,
    clipped_pg_loss,
    get_loss_fn,
    register_loss,
    registered_losses,
)

LN2 = math.log(2.0)
D = torch.float64


def cfg(**overrides):
    base = dict(
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        ratio_clip_c=None,
        reference_policy_kl_penalty=0.0,
        use_on_policy_kl_approximation=False,
        use_importance_sampling_correction=False,
        token_level_loss=True,
    )
    base.update(overrides)
    return base


def t(values):
    return torch.tensor(values, dtype=D)


def logs(values):
    return torch.log(t(values))


def run(curr, prev=None, gen=None, ref=None, adv=None, mask=None, config=None):
    """Returns (loss, metrics, grad wrt curr). Default prev = gen = 0, ref = curr (no KL)."""
    curr = curr.clone().requires_grad_(True)
    zeros = torch.zeros_like(curr)
    prev = zeros if prev is None else prev
    gen = zeros if gen is None else gen
    ref = curr.detach().clone() if ref is None else ref
    mask = torch.ones_like(curr) if mask is None else mask
    loss, metrics = clipped_pg_loss(curr, prev, gen, ref, adv, mask, config or cfg())
    loss.backward()
    return loss, metrics, curr.grad


def close(a, b, tol=1e-9):
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0)


# ---------------------------------------------------------------- plain clipped PG ------------


def test_plain_pg_positive_advantage_in_and_out_of_clip_range():
    # r = 0.5 (below range, unclipped: -A r = -1.0 > -A r_c = -1.6), 0.9, 1.1 (inside),
    # 1.5 (above range, clipped: max(-3.0, -2.4) = -2.4, no gradient). A = 2.
    loss, m, grad = run(logs([[0.5, 0.9, 1.1, 1.5]]), adv=t([2.0]))
    assert close(loss, (-1.0 - 1.8 - 2.2 - 2.4) / 4)
    assert close(grad, [[-1.0 / 4, -1.8 / 4, -2.2 / 4, 0.0]])
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["probs_ratio"] == pytest.approx((0.5 + 0.9 + 1.1 + 1.5) / 4)
    assert m["probs_ratio_clamped"] == pytest.approx((0.8 + 0.9 + 1.1 + 1.2) / 4)


def test_plain_pg_negative_advantage_in_and_out_of_clip_range():
    # A = -1: r = 0.5 -> max(0.5, 0.8) = 0.8 clipped (grad 0); 0.9, 1.1 inside;
    # r = 1.5 -> max(1.5, 1.2) = 1.5 unclipped (grad -A r = 1.5).
    loss, m, grad = run(logs([[0.5, 0.9, 1.1, 1.5]]), adv=t([-1.0]))
    assert close(loss, (0.8 + 0.9 + 1.1 + 1.5) / 4)
    assert close(grad, [[0.0, 0.9 / 4, 1.1 / 4, 1.5 / 4]])
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_asymmetric_clip_bounds():
    # range [0.9, 1.5]: r = 1.4 now inside (A=1: -1.4, grad -1.4); r = 0.8 -> max(-0.8, -0.9) = -0.8
    loss, m, grad = run(logs([[1.4, 0.8, 2.0]]), adv=t([1.0]), config=cfg(ratio_clip_min=0.1, ratio_clip_max=0.5))
    # r = 2.0 -> max(-2.0, -1.5) = -1.5 clipped
    assert close(loss, (-1.4 - 0.8 - 1.5) / 3)
    assert close(grad, [[-1.4 / 3, -0.8 / 3, 0.0]])
    assert m["clip_fraction"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------- dual clip -------------------


def test_dual_clip_caps_negative_advantage_only():
    curr = logs([[1.5, 2.5, 4.0], [4.0, 1.0, 0.5]])
    adv = t([-1.0, 2.0])
    # row 0 (A=-1, c=3): 1.5, 2.5 unchanged (grads 1.5, 2.5); 4.0 -> min(4.0, 3.0) = 3.0 (grad 0)
    # row 1 (A=+2): r=4 -> -2.4 (clipped), r=1 -> -2 (grad -2), r=0.5 -> -1 (grad -1); no dual clip
    loss, m, grad = run(curr, adv=adv, config=cfg(ratio_clip_c=3.0))
    assert close(loss, (1.5 + 2.5 + 3.0 - 2.4 - 2.0 - 1.0) / 6)
    assert close(grad, [[1.5 / 6, 2.5 / 6, 0.0], [0.0, -2.0 / 6, -1.0 / 6]])
    # without dual clip the r=4, A=-1 token costs 4.0 with gradient 4.0
    loss2, _, grad2 = run(curr, adv=adv)
    assert close(loss2, (1.5 + 2.5 + 4.0 - 2.4 - 2.0 - 1.0) / 6)
    assert close(grad2[0, 2], 4.0 / 6)
    # clip_fraction counts only the ordinary clamp: r in {1.5, 2.5, 4.0, 4.0, 0.5} is outside
    assert m["clip_fraction"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0])
def test_dual_clip_must_exceed_one(bad):
    curr = logs([[1.0]])
    with pytest.raises(ValueError, match="ratio_clip_c"):
        clipped_pg_loss(curr, curr, curr, curr, t([1.0]), torch.ones_like(curr), cfg(ratio_clip_c=bad))
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLossConfig(ratio_clip_c=bad)


# ---------------------------------------------------------------- IS correction ---------------


def test_importance_sampling_correction_weights_and_no_grad_through_w():
    # w = exp(prev - gen) = 2, 0.5, and inf (gen = -inf) -> 0.
    curr = logs([[1.0, 1.5, 0.9]])
    gen = torch.tensor([[-LN2, LN2, -math.inf]], dtype=D, requires_grad=True)
    prev = torch.zeros(1, 3, dtype=D, requires_grad=True)
    # A=1: r=1 -> -1*2 = -2 (grad -A r w = -2); r=1.5 -> -1.2*0.5 = -0.6 (clipped, grad 0); w=0 -> 0
    loss, m, grad = run(curr, prev=prev, gen=gen, adv=t([1.0]), config=cfg(use_importance_sampling_correction=True))
    assert close(loss, (-2.0 - 0.6 + 0.0) / 3)
    assert close(grad, [[-2.0 / 3, 0.0, 0.0]])
    assert gen.grad is None  # w (and the metrics) are constants: no path to gen
    assert close(prev.grad, [[2.0 / 3, 0.0, 0.0]])  # only through r = exp(curr - prev)


def test_importance_sampling_metrics():
    curr = logs([[1.0, 1.5]])
    gen = t([[-LN2, LN2]])
    _, m, _ = run(curr, gen=gen, adv=t([1.0]), config=cfg(use_importance_sampling_correction=True))
    assert m["sampling_importance_ratio"] == pytest.approx((2.0 + 0.5) / 2)
    assert m["token_mult_prob_error"] == pytest.approx((2.0 + 2.0) / 2)


# ---------------------------------------------------------------- KL ---------------------------


def test_k3_kl_with_both_clamps():
    # A = 0 so only KL counts; curr = 0, d = ref - curr; beta = 0.5.
    # d=0 -> 0 (grad 0); d=ln2 -> 2-ln2-1 (grad -(2-1) = -1); d=-ln2 -> 0.5+ln2-1 (grad 0.5);
    # d=3 -> e^3-4 = 16.09 capped at 10 (grad 0); d=+-1000 -> clamped to +-20 -> capped at 10 (grad 0,
    # finite: without the d clamp exp(1000) = inf would poison value/gradient).
    curr = torch.zeros(1, 6, dtype=D)
    ref = t([[0.0, LN2, -LN2, 3.0, 1000.0, -1000.0]])
    loss, m, grad = run(curr, ref=ref, adv=t([0.0]), config=cfg(reference_policy_kl_penalty=0.5))
    kl_sum = 0.0 + (1 - LN2) + (LN2 - 0.5) + 10 + 10 + 10
    assert close(loss, 0.5 * kl_sum / 6)
    assert close(grad, [[0.0, -0.5 / 6, 0.25 / 6, 0.0, 0.0, 0.0]])
    assert torch.isfinite(grad).all()
    assert m["kl_penalty"] == pytest.approx(0.5 * kl_sum / 6)


def test_kl_with_curr_at_minus_inf_is_finite():
    # curr = -inf would make d = +inf and exp(d) - d = inf - inf = NaN without the d clamp.
    # r = exp(-inf - 0) = 0 and A = 0, so the loss is the capped KL alone.
    loss, _, grad = run(t([[-math.inf]]), ref=t([[0.0]]), adv=t([0.0]),
                        config=cfg(reference_policy_kl_penalty=1.0))
    assert loss.item() == 10.0
    assert torch.equal(grad, t([[0.0]]))


def test_on_policy_kl_approximation_weight_is_constant():
    # curr = 0, gen = -ln2 -> weight exp(curr - gen) = 2; d = ln2 -> kl = 1 - ln2; beta = 1.
    # Value 2(1 - ln2); gradient = 2 * -(e^d - 1) = -2 (a differentiated weight would add
    # kl * 2 = 0.614 and give -1.386).
    gen = torch.tensor([[-LN2]], dtype=D, requires_grad=True)
    loss, m, grad = run(torch.zeros(1, 1, dtype=D), gen=gen, ref=t([[LN2]]), adv=t([0.0]),
                        config=cfg(reference_policy_kl_penalty=1.0, use_on_policy_kl_approximation=True))
    assert close(loss, 2 * (1 - LN2))
    assert close(grad, [[-2.0]])
    assert gen.grad is None
    assert m["kl_penalty"] == pytest.approx(2 * (1 - LN2))


def test_pg_plus_kl_combined():
    # A = 1, r = 1.1 (pg -1.1, grad -1.1), d = ref - curr = ln2 (kl 1-ln2, grad -1), beta = 0.1
    curr = logs([[1.1]])
    loss, _, grad = run(curr, ref=curr + LN2, adv=t([1.0]), config=cfg(reference_policy_kl_penalty=0.1))
    assert close(loss, -1.1 + 0.1 * (1 - LN2))
    assert close(grad, [[-1.1 - 0.1]])


# ---------------------------------------------------------------- reductions & metrics --------


def test_token_and_sequence_reductions_with_empty_sequence():
    # r = 1 everywhere so l = -A per token (grad -A); per-token advantages [B, T].
    curr = torch.zeros(3, 2, dtype=D)
    adv = t([[1.0, 3.0], [5.0, 5.0], [4.0, 9.0]])
    mask = t([[1, 1], [0, 0], [1, 0]])
    loss, _, grad = run(curr, adv=adv, mask=mask)
    assert close(loss, (-1 - 3 - 4) / 3)
    assert close(grad, [[-1 / 3, -1.0], [0.0, 0.0], [-4 / 3, 0.0]])
    # sequence level: row means -2 and -4 (row 1 has no tokens and is skipped) -> -3
    loss, _, grad = run(curr, adv=adv, mask=mask, config=cfg(token_level_loss=False))
    assert close(loss, -3.0)
    assert close(grad, [[-1 / 4, -3 / 4], [0.0, 0.0], [-2.0, 0.0]])


def test_all_metrics_and_masked_garbage():
    # Valid tokens: a=(0,0), b=(0,1), c=(1,0). Masked positions hold NaN/inf garbage.
    nan, inf = math.nan, math.inf
    curr = t([[math.log(1.5), 0.0, 50.0], [math.log(0.7), nan, -inf]])
    gen = t([[0.0, LN2, nan], [-2 * LN2, inf, 0.0]])
    ref = t([[math.log(1.5), LN2, -inf], [math.log(0.7), nan, 3.0]])
    prev = t([[0.0, 0.0, inf], [0.0, -inf, nan]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv = t([1.0, -1.0])
    for token_level in (True, False):
        loss, m, grad = run(curr, prev=prev, gen=gen, ref=ref, adv=adv, mask=mask,
                            config=cfg(reference_policy_kl_penalty=0.1, token_level_loss=token_level))
        # a: r=1.5 -> -1.2 (clipped); b: r=1 -> -1, kl(d=ln2) = 1-ln2; c: A=-1, r=0.7 -> 0.8 (clipped)
        kl_b = 0.1 * (1 - LN2)
        if token_level:
            assert close(loss, (-1.2 - 1.0 + kl_b + 0.8) / 3)
            assert close(grad, [[0.0, (-1.0 - 0.1) / 3, 0.0], [0.0, 0.0, 0.0]])
        else:
            assert close(loss, ((-1.2 - 1.0 + kl_b) / 2 + 0.8) / 2)
            assert close(grad, [[0.0, (-1.0 - 0.1) / 4, 0.0], [0.0, 0.0, 0.0]])
        assert m == pytest.approx({
            "probs_ratio": (1.5 + 1.0 + 0.7) / 3,
            "probs_ratio_clamped": (1.2 + 1.0 + 0.8) / 3,
            "kl_penalty": kl_b / 3,
            "token_mult_prob_error": (1.0 + 2.0 + 4.0) / 3,
            "sampling_importance_ratio": (1.0 + 0.5 + 4.0) / 3,
            # -exp(curr - gen) * curr: a: -1.5 ln1.5, b: 0, c: -(0.7*4) ln0.7
            "approx_entropy": (-1.5 * math.log(1.5) - 2.8 * math.log(0.7)) / 3,
            "clip_fraction": 2 / 3,
        })
        assert all(type(v) is float for v in m.values())


def test_empty_mask_gives_zero_loss_with_graph():
    curr = t([[0.3, -0.2], [0.1, 0.4]])
    for token_level in (True, False):
        loss, m, grad = run(curr, adv=t([1.0, -2.0]), mask=torch.zeros(2, 2, dtype=D),
                            config=cfg(token_level_loss=token_level, reference_policy_kl_penalty=0.1))
        assert loss.item() == 0.0
        assert torch.equal(grad, torch.zeros(2, 2, dtype=D))
        assert set(m) == {"probs_ratio", "probs_ratio_clamped", "kl_penalty", "token_mult_prob_error",
                          "sampling_importance_ratio", "approx_entropy", "clip_fraction"}
        assert all(v == 0.0 and type(v) is float for v in m.values())


def test_config_model_and_dict_are_equivalent_and_bad_input_is_rejected():
    curr = logs([[0.5, 1.5]])
    z = torch.zeros_like(curr)
    a = clipped_pg_loss(curr, z, z, z, t([1.0]), torch.ones_like(curr), cfg(reference_policy_kl_penalty=0.3))
    b = clipped_pg_loss(curr, z, z, z, t([1.0]), torch.ones_like(curr),
                        ClippedPGLossConfig(reference_policy_kl_penalty=0.3))
    assert close(a[0], b[0]) and a[1] == b[1]
    # the model's defaults are the plain dict's, plus the keys that select the loss variants
    dumped = ClippedPGLossConfig().model_dump()
    assert {k: dumped[k] for k in cfg()} == dict(cfg(reference_policy_kl_penalty=0.01))
    with pytest.raises(ValueError, match="ratio_clip_maxx"):
        clipped_pg_loss(curr, z, z, z, t([1.0]), z, {**cfg(), "ratio_clip_maxx": 0.3})
    with pytest.raises(ValueError, match="reference_policy_kl_penalty"):
        ClippedPGLossConfig(reference_policy_kl_penalty=-0.1)
    with pytest.raises(ValueError, match="generation_logprobs"):
        clipped_pg_loss(curr, z, z[:, :1], z, t([1.0]), z, cfg())
    with pytest.raises(ValueError, match="advantages"):
        clipped_pg_loss(curr, z, z, z, t([1.0, 2.0]), z, cfg())
    with pytest.raises(ValueError, match="curr_logprobs must be 2-D"):
        clipped_pg_loss(curr[0], z, z, z, t([1.0]), z, cfg())
    with pytest.raises(TypeError, match="config"):
        clipped_pg_loss(curr, z, z, z, t([1.0]), z, 0.2)


# ---------------------------------------------------------------- ClippedPGLossFn ---------------


def make_batch(seed=0, batch=6, seq=5):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, seq, generator=g, dtype=D) * 0.3 - 1.0
    token_mask = (torch.rand(batch, seq, generator=g) > 0.3).to(D)
    token_mask[2] = 0  # a sequence with no loss tokens
    sample_mask = torch.ones(batch, dtype=D)
    sample_mask[4] = 0.0  # a truncated prompt
    data = {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(batch, generator=g, dtype=D),
        "prev_logprobs": base + 0.2 * torch.randn(batch, seq, generator=g, dtype=D),
        "generation_logprobs": base + 0.05 * torch.randn(batch, seq, generator=g, dtype=D),
        "reference_policy_logprobs": base + 0.3 * torch.randn(batch, seq, generator=g, dtype=D),
    }
    return base, data


@pytest.mark.parametrize("token_level", [True, False])
def test_microbatch_losses_sum_to_global_batch_loss(token_level):
    config = ClippedPGLossConfig(ratio_clip_c=3.0, reference_policy_kl_penalty=0.05,
                                 use_importance_sampling_correction=True, token_level_loss=token_level)
    loss_fn = ClippedPGLossFn(config)
    assert loss_fn.loss_type == ("token" if token_level else "sequence")
    curr_base, data = make_batch()
    mask = data["token_mask"] * data["sample_mask"][:, None]
    g_toks, g_seqs = mask.sum(), (mask.sum(-1) > 0).sum()

    curr = curr_base.clone().requires_grad_(True)
    whole, whole_metrics = loss_fn(curr, data, g_seqs, g_toks)
    whole.backward()
    whole_grad = curr.grad.clone()
    pure, _ = clipped_pg_loss(curr_base, data["prev_logprobs"], data["generation_logprobs"],
                              data["reference_policy_logprobs"], data["advantages"], mask, config)
    assert close(whole, pure)
    assert whole_metrics["loss"] == pytest.approx(whole.item())
    assert whole_metrics["num_valid_tokens"] == float(g_toks)

    curr = curr_base.clone().requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for start, end in ((0, 2), (2, 3), (3, 6)):
        mb = {k: v[start:end] for k, v in data.items()}
        part, part_metrics = loss_fn(curr[start:end], mb, g_seqs, g_toks)
        assert part_metrics["loss"] == pytest.approx(part.item())
        total = total + part
    total.backward()
    assert close(total, whole, 1e-12)
    assert close(curr.grad, whole_grad, 1e-12)


def test_loss_fn_rescales_by_global_counts_by_hand():
    # one sequence, tokens r = 1 with A = 2 -> l = -2 per token, 2 valid tokens
    curr = torch.zeros(1, 3, dtype=D, requires_grad=True)
    z = torch.zeros(1, 3, dtype=D)
    data = {"token_mask": t([[1, 1, 0]]), "sample_mask": t([1.0]), "advantages": t([2.0]),
            "prev_logprobs": z, "generation_logprobs": z, "reference_policy_logprobs": z}
    loss, m = ClippedPGLossFn(cfg())(curr, data, torch.tensor(4), torch.tensor(8.0))
    assert close(loss, -4.0 / 8)  # local mean -2 times 2/8
    assert m["loss"] == pytest.approx(-0.5) and m["num_valid_tokens"] == 2.0 and m["num_valid_seqs"] == 1.0
    loss, _ = ClippedPGLossFn(cfg(token_level_loss=False))(curr, data, torch.tensor(4), torch.tensor(8.0))
    assert close(loss, -2.0 / 4)  # one sequence of mean -2 over 4 global sequences
    loss.backward()
    assert close(curr.grad, [[-0.25, -0.25, 0.0]])


def test_loss_fn_empty_microbatch_and_bad_inputs():
    curr_base, data = make_batch()
    loss_fn = ClippedPGLossFn()
    curr = curr_base[2:3].clone().requires_grad_(True)  # row 2 has no loss tokens
    mb = {k: v[2:3] for k, v in data.items()}
    for g in (0, 10):
        loss, m = loss_fn(curr, mb, g, g)
        assert loss.item() == 0.0 and m["loss"] == 0.0 and m["num_valid_tokens"] == 0.0
        loss.backward()
    assert torch.equal(curr.grad, torch.zeros_like(curr))
    with pytest.raises(KeyError, match="advantages"):
        loss_fn(curr_base, {k: v for k, v in data.items() if k != "advantages"}, 5, 20)
    with pytest.raises(ValueError, match="global_valid_toks"):
        loss_fn(curr_base, data, 5, 1)  # smaller than the micro-batch's own count
    with pytest.raises(ValueError, match="sample_mask"):
        loss_fn(curr_base, {**data, "sample_mask": torch.ones(3)}, 5, 100)


# ---------------------------------------------------------------- NLL ---------------------------


def test_nll_loss():
    curr = torch.tensor([[math.log(0.5), math.log(0.25), 0.0], [math.log(0.5), 7.0, -math.inf]],
                        dtype=D, requires_grad=True)
    data = {"token_mask": t([[1, 1, 0], [1, 0, 1]]), "sample_mask": t([1.0, 0.0])}
    loss_fn = NLLLossFn()
    assert loss_fn.loss_type == "token"
    loss, m = loss_fn(curr, data, torch.tensor(2), torch.tensor(4))
    assert close(loss, (LN2 + 2 * LN2) / 4)
    assert m == pytest.approx({"nll": 3 * LN2 / 2, "num_valid_tokens": 2.0, "loss": 3 * LN2 / 4})
    loss.backward()
    assert close(curr.grad, [[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="no config"):
        NLLLossFn({"foo": 1})


# ---------------------------------------------------------------- registry ----------------------


def test_loss_registry():
    assert {"clipped_pg", "nll"} <= set(registered_losses())
    fn = get_loss_fn("clipped_pg", {**cfg(), "token_level_loss": False})
    assert isinstance(fn, ClippedPGLossFn) and fn.loss_type == "sequence"
    assert isinstance(get_loss_fn("clipped_pg"), ClippedPGLossFn)
    assert isinstance(get_loss_fn("nll"), NLLLossFn)
    # (other modules of the session may have registered theirs: DPO's)
    with pytest.raises(KeyError, match=r"unknown loss 'ppo'.*registered: \[.*'clipped_pg'.*'nll'"):
        get_loss_fn("ppo")

    @register_loss("test_scaled_nll")
    def make_scaled(config):
        return ("scaled", config["scale"])

    assert get_loss_fn("test_scaled_nll", {"scale": 3}) == ("scaled", 3)
    with pytest.raises(ValueError, match="already registered"):
        register_loss("nll")(make_scaled)
    with pytest.raises(ValueError, match="non-empty"):
        register_loss("")


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_proximal_is_current_takes_prev_logprobs_from_the_training_forward(kl: float) -> None:
    """Async GRPO with one optimizer step per batch: no separate pass for the proximal policy; the
    loss and its gradient are those of prev = curr.detach() (and ref too, when no reference is given)."""
    torch.manual_seed(0)
    B, T = 4, 6
    base = torch.randn(B, T) - 1.0
    gen = base + 0.3 * torch.randn(B, T)  # the behaviour policy: older weights
    ref = base + 0.1 * torch.randn(B, T)
    common = {"advantages": torch.tensor([1.0, -0.5, 0.25, -1.0]), "token_mask": torch.ones(B, T),
              "generation_logprobs": gen}
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=kl, use_importance_sampling_correction=True,
                              truncated_importance_sampling_ratio=2.0)
    fn = ClippedPGLossFn(cfg)
    a = base.clone().requires_grad_(True)
    explicit = {**common, "prev_logprobs": a.detach(), "reference_policy_logprobs": ref if kl else a.detach()}
    la, ma = fn(a, explicit, torch.tensor(B), torch.tensor(float(B * T)))
    la.backward()
    b = base.clone().requires_grad_(True)
    marked = {**common, "proximal_is_current": torch.ones(B)} | ({"reference_policy_logprobs": ref} if kl else {})
    lb, mb = fn(b, marked, torch.tensor(B), torch.tensor(float(B * T)))
    lb.backward()
    assert torch.allclose(la, lb) and torch.allclose(a.grad, b.grad)
    assert ma == mb
    assert float(b.grad.abs().sum()) > 0
    with pytest.raises(KeyError, match="prev_logprobs"):  # without the marker a missing key is an error
        fn(b, common | {"reference_policy_logprobs": ref}, torch.tensor(B), torch.tensor(float(B * T)))
