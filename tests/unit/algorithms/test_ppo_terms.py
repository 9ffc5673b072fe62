"""PPO terms against hand-computed values and against a plain per-row loop.

Hand checks (one row, every token a response token, r = [0, 0, 5], V = [1, 2, 3]):
  gamma 1,   lam 0: delta = [0+2-1, 0+3-2, 5+0-3] = [1, 1, 2] = A
  gamma 1,   lam 1: A = reward-to-go - V = [5-1, 5-2, 5-3] = [4, 3, 2], returns [5, 5, 5]
  gamma 0.5, lam 1: returns = discounted reward-to-go = [5/4, 5/2, 5], A = [0.25, 0.5, 2]
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.ppo_terms import (
    AdaptiveKLController,
    FixedKLController,
    clipped_value_loss,
    clipped_value_loss_terms,
    compute_gae,
    explained_variance,
    kl_per_token,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    remax_advantages,
    token_level_rewards,
)

R3 = torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)
V3 = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
ONES3 = torch.ones(1, 3)
GAMMA_LAMS = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.5, 0.0), (0.9, 1.0), (0.0, 0.7)]


def reference_gae(r, v, mask, gamma, lam):
    """Per row: keep the mask tokens in order, run textbook GAE on them (value 0 after the last)."""
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    for i in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[i, t] != 0]
        g, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = float(r[i, t]) + gamma * next_v - float(v[i, t])
            g = delta + gamma * lam * g
            adv[i, t], ret[i, t] = g, g + float(v[i, t])
            next_v = float(v[i, t])
    return adv, ret


def random_batch(seed, n=6, t=11):
    """Rewards, values and a mask with multi-turn gaps, leading/trailing padding and an empty row."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, t, generator=g, dtype=torch.float64)
    v = torch.randn(n, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) < 0.6).float()
    mask[0] = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0][:t])  # two turns, then padding
    mask[1] = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1][-t:])  # leading zeros, then two turns to the end
    mask[2] = 0.0  # no response token at all
    return r, v, mask


# ================================================================ GAE
@pytest.mark.parametrize("gamma, lam, adv, ret", [
    (1.0, 0.0, [1.0, 1.0, 2.0], [2.0, 3.0, 5.0]),
    (1.0, 1.0, [4.0, 3.0, 2.0], [5.0, 5.0, 5.0]),
    (0.5, 1.0, [0.25, 0.5, 2.0], [1.25, 2.5, 5.0]),
])
def test_gae_hand_checks(gamma, lam, adv, ret):
    a, r = compute_gae(R3, V3, ONES3, gamma=gamma, lam=lam)
    assert a.dtype == torch.float64 and not a.requires_grad
    assert a.tolist() == [adv] and r.tolist() == [ret]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma, lam", GAMMA_LAMS)
def test_gae_matches_per_row_loop(seed, gamma, lam):
    r, v, mask = random_batch(seed)
    adv, ret = compute_gae(r, v, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference_gae(r, v, mask, gamma, lam)
    assert torch.allclose(adv, ref_adv, atol=1e-12, rtol=0) and torch.allclose(ret, ref_ret, atol=1e-12, rtol=0)
    assert bool((adv[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all())
    assert adv[2].abs().sum() == 0  # the row without a response token


def test_gae_gamma_lam_one_is_monte_carlo_return_minus_value():
    r, v, mask = random_batch(3)
    adv, ret = compute_gae(r, v, mask, gamma=1.0, lam=1.0)
    to_go = (r * mask).flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(ret, to_go, atol=1e-12) and torch.allclose(adv, (to_go - v) * mask, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_gae_lam_zero_is_one_step_td(gamma):
    r, v, mask = random_batch(4)
    adv, _ = compute_gae(r, v, mask, gamma=gamma, lam=0.0)
    for i in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[i, t]]
        for k, t in enumerate(idx):
            v_next = float(v[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0  # next *assistant* token's value
            assert float(adv[i, t]) == pytest.approx(float(r[i, t]) + gamma * v_next - float(v[i, t]), abs=1e-12)


def test_gae_skips_environment_tokens():
    # Turns [0, 1] and [4, 5]; tokens 2, 3 are the environment's and 6 is padding: whatever they hold
    # (even NaN) is ignored, and the result equals GAE on the four assistant tokens alone.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    nan = math.nan
    r = torch.tensor([[0.0, 1.0, 100.0, nan, 0.0, 2.0, 7.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 1.0, nan, -50.0, 1.5, 2.5, 9.0]], dtype=torch.float64)
    adv, ret = compute_gae(r, v, mask, gamma=0.9, lam=0.8)
    dense_adv, dense_ret = compute_gae(r[:, [0, 1, 4, 5]], v[:, [0, 1, 4, 5]], torch.ones(1, 4), gamma=0.9, lam=0.8)
    assert adv[0, [0, 1, 4, 5]].tolist() == dense_adv[0].tolist()
    assert ret[0, [0, 1, 4, 5]].tolist() == dense_ret[0].tolist()
    assert adv[0, [2, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    # lam = 0: token 1's TD target uses token 4's value (1.5), not token 2's
    adv0, _ = compute_gae(r, v, mask, gamma=1.0, lam=0.0)
    assert adv0[0, 1].item() == 1.0 + 1.5 - 1.0


def test_gae_validation():
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(R3, V3, ONES3, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(R3, V3, ONES3, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match=r"values has shape \(1, 2\)"):
        compute_gae(R3, V3[:, :2], ONES3, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="mask must be 2-D"):
        compute_gae(R3, V3, ONES3[0], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_gae(R3, V3, ONES3 * 0.5, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="values must be finite on mask tokens"):
        compute_gae(R3, torch.tensor([[1.0, math.inf, 3.0]]), ONES3, gamma=1.0, lam=1.0)


def test_dtypes_follow_inputs():
    a, r = compute_gae(R3.float(), V3.float(), ONES3.bool(), gamma=1.0, lam=1.0)
    assert a.dtype == r.dtype == torch.float32 and a.tolist() == [[4.0, 3.0, 2.0]]
    assert compute_gae(R3.long(), V3.long(), ONES3, gamma=1.0, lam=1.0)[0].dtype == torch.float32
    assert masked_whiten(R3.float(), ONES3).dtype == torch.float32
    assert remax_advantages(R3.half(), ONES3, torch.zeros(1, dtype=torch.half)).dtype == torch.float16


# ================================================================ padding changes nothing
def test_padding_rows_and_columns_change_no_statistic():
    r, v, mask = random_batch(5, n=5, t=8)
    old_v = v + 0.3 * torch.randn_like(v)
    base_scores = torch.randn(5, dtype=torch.float64)

    def pad(x, fill):  # 3 padded columns and 2 padded rows holding arbitrary junk
        x = torch.cat([x, torch.full((x.shape[0], 3), fill, dtype=x.dtype)], dim=1)
        return torch.cat([x, torch.full((2, x.shape[1]), fill, dtype=x.dtype)], dim=0)

    pm = pad(mask, 0.0)
    for fill in (123.0, math.nan, -math.inf):
        pr, pv, pold = pad(r, fill), pad(v, fill), pad(old_v, fill)
        ps = torch.cat([base_scores, torch.tensor([fill, fill], dtype=torch.float64)])
        for gamma, lam in GAMMA_LAMS[:3]:
            a, ret = compute_gae(r, v, mask, gamma=gamma, lam=lam)
            pa, pret = compute_gae(pr, pv, pm, gamma=gamma, lam=lam)
            assert torch.equal(pa[:5, :8], a) and torch.equal(pret[:5, :8], ret)
            assert pa[5:].abs().sum() == 0 and pa[:, 8:].abs().sum() == 0
            assert torch.equal(masked_whiten(pa, pm)[:5, :8], masked_whiten(a, mask))
        assert torch.equal(masked_mean(pv, pm), masked_mean(v, mask))
        assert explained_variance(pv, pr, pm) == explained_variance(v, r, mask)
        for clip in (None, 0.2):
            assert clipped_value_loss(pv, pold, pr, pm, cliprange_value=clip) == \
                clipped_value_loss(v, old_v, r, mask, cliprange_value=clip)
        assert torch.equal(token_level_rewards(ps, pm, pr, 0.1)[:5, :8], token_level_rewards(base_scores, mask, r, 0.1))
        assert torch.equal(remax_advantages(pr, pm, ps)[:5, :8], remax_advantages(r, mask, base_scores))


# ================================================================ whitening and masked mean
def test_masked_whiten_mean_zero_std_one():
    r, v, mask = random_batch(6)
    x = 3.0 * r + 7.0
    w = masked_whiten(x, mask, eps=0.0)
    on = w[mask.bool()]
    assert float(on.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(on.std(unbiased=True)) == pytest.approx(1.0, abs=1e-12)
    assert bool((w[mask == 0] == 0).all())
    # default eps 1e-8 is inside the square root
    xs = x[mask.bool()]
    expected = (xs - xs.mean()) / torch.sqrt(xs.var(unbiased=True) + 1e-8)
    assert torch.allclose(masked_whiten(x, mask)[mask.bool()], expected, atol=1e-14, rtol=0)
    # shift_mean=False: scaled around the mean, which is kept
    ws = masked_whiten(x, mask, shift_mean=False, eps=0.0)[mask.bool()]
    assert float(ws.mean()) == pytest.approx(float(xs.mean()), abs=1e-12)
    assert float(ws.std(unbiased=True)) == pytest.approx(1.0, abs=1e-12)


def test_masked_whiten_with_fewer_than_two_tokens():
    x = torch.tensor([[4.0, 9.0, -2.0]])
    one = torch.tensor([[0, 1, 0]])
    assert masked_whiten(x, one).tolist() == [[0.0, 0.0, 0.0]]
    assert masked_whiten(x, one, shift_mean=False).tolist() == [[0.0, 9.0, 0.0]]
    assert masked_whiten(x, torch.zeros(1, 3)).tolist() == [[0.0, 0.0, 0.0]]
    # constant values: 0 (no 0/0)
    assert masked_whiten(torch.full((2, 2), 3.0), torch.ones(2, 2)).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, one, eps=-1.0)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, math.nan, 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    m = masked_mean(x, mask)
    assert m.dtype == torch.float32 and m.item() == pytest.approx(13.0 / 4)
    m.backward()
    assert x.grad.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]]
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0


# ================================================================ ReMax
def test_remax_advantages():
    # reward-to-go over mask tokens minus the greedy reward; env tokens (cols 2, 3) and padding get 0
    r = torch.tensor([[0.0, 0.0, 5.0, 0.0], [-0.1, 9.0, 9.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]])
    adv = remax_advantages(r, mask, torch.tensor([2.0, 1.0, math.nan]))
    assert adv.dtype == torch.float32
    assert torch.allclose(adv, torch.tensor([[3.0, 3.0, 3.0, 0.0], [0.9, 0.0, 0.0, 1.0], [0.0] * 4]), atol=1e-6)
    with pytest.raises(ValueError, match=r"baseline must be a tensor of shape \[N\]=\[3\]"):
        remax_advantages(r, mask, torch.zeros(2))


# ================================================================ token rewards and KL
def test_token_level_rewards_placement_and_kl():
    scores = torch.tensor([1.0, 2.0, math.nan, -3.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    out = token_level_rewards(scores, mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 2, 0], [0] * 5, [0, 0, 0, 0, -3]]
    kl = torch.full((4, 5), 0.5)
    kl[0, 3] = math.nan  # padding: ignored
    out = token_level_rewards(scores, mask, kl, coef=0.2)
    assert torch.allclose(out, torch.tensor([[-0.1, -0.1, 0.9, 0, 0], [-0.1, 0, 0, 1.9, 0], [0.0] * 5,
                                             [0, 0, 0, 0, -3.1]]), atol=1e-6)
    assert token_level_rewards(scores, mask, kl, coef=0.0).tolist() == token_level_rewards(scores, mask).tolist()
    with pytest.raises(ValueError, match=r"scores must be finite .* rows \[0\]"):
        token_level_rewards(torch.tensor([math.nan, 0.0, 0.0, 0.0]), mask)
    with pytest.raises(ValueError, match="scores must be a tensor of shape"):
        token_level_rewards(torch.zeros(3), mask)
    with pytest.raises(ValueError, match="kl must be finite on mask tokens"):
        token_level_rewards(scores, mask, torch.full((4, 5), math.inf), coef=0.1)
    with pytest.raises(ValueError, match="coef"):
        token_level_rewards(scores, mask, kl, coef=math.nan)


def test_kl_estimators_on_known_numbers():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0]])  # d = [1, 0, -2]
    expected = {
        "k1": [1.0, 0.0, -2.0],
        "k2": [0.5, 0.0, 2.0],
        "k3": [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0],
        "abs": [1.0, 0.0, 2.0],
    }
    for name, values in expected.items():
        kl = kl_per_token(logp, ref, name)
        assert kl.dtype == torch.float32 and kl[0].tolist() == pytest.approx(values, rel=1e-6)
    assert kl_per_token(logp, ref).tolist() == [[1.0, 0.0, -2.0]]  # k1 by default
    assert kl_per_token(logp.double(), ref.double(), "k3").dtype == torch.float64
    with pytest.raises(ValueError, match=r"'k4'.*\['k1', 'k2', 'k3', 'abs'\]"):
        kl_per_token(logp, ref, "k4")
    with pytest.raises(ValueError, match="must match"):
        kl_per_token(logp, ref[:, :2])


# ================================================================ value loss
def test_clipped_value_loss_semantics():
    # eps 0.2, v_old 0 -> v_clip in [-0.2, 0.2]
    #   tok 0: v 1.0, R 2   unclipped 1,    clipped (0.2-2)^2 = 3.24  -> clipped binds (zero grad)
    #   tok 1: v 1.0, R -1  unclipped 4,    clipped (0.2+1)^2 = 1.44  -> unclipped
    #   tok 2: v 0.1, R 1   in range, both 0.81                       -> unclipped (a tie is not clipping)
    #   tok 3: v -0.5, R 0  unclipped 0.25, clipped 0.04              -> unclipped
    #   tok 4: padding (NaN)
    v = torch.tensor([[1.0, 1.0, 0.1, -0.5, math.nan]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, math.nan]], dtype=torch.float64)
    ret = torch.tensor([[2.0, -1.0, 1.0, 0.0, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, clipfrac = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 4.0 + 0.81 + 0.25) / 4, abs=1e-12)
    assert clipfrac.item() == 0.25 and not clipfrac.requires_grad
    loss.backward()
    # d/dv of 0.5 * mean((v - R)^2) = (v - R) / 4 on unclipped tokens; 0 where clipping binds and on padding
    assert v.grad[0].tolist() == pytest.approx([0.0, 2.0 / 4, -0.9 / 4, -0.5 / 4, 0.0], abs=1e-12)

    # no clipping range: plain squared error, clip fraction 0
    v.grad = None
    loss, clipfrac = clipped_value_loss(v, old, ret, mask, cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0 + 0.81 + 0.25) / 4, abs=1e-12) and clipfrac.item() == 0.0
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([-1.0 / 4, 2.0 / 4, -0.9 / 4, -0.5 / 4, 0.0], abs=1e-12)

    # a range wide enough that clipping never binds: identical to no clipping
    wide = clipped_value_loss(v, old, ret, mask, cliprange_value=10.0)
    assert wide[0].item() == loss.item() and wide[1].item() == 0.0


def test_clipped_value_loss_edge_cases():
    v = torch.randn(2, 3, requires_grad=True)
    loss, clipfrac = clipped_value_loss(v, v.detach(), torch.zeros(2, 3), torch.zeros(2, 3), cliprange_value=0.2)
    assert loss.item() == 0.0 and clipfrac.item() == 0.0 and loss.dtype == torch.float32
    loss.backward()
    assert v.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(v, v, v, torch.ones(2, 3), cliprange_value=-0.1)
    with pytest.raises(ValueError, match="returns has shape"):
        clipped_value_loss(v, v, v[:1], torch.ones(2, 3), cliprange_value=0.2)


def test_value_loss_terms_hand_values_and_aggregation():
    # The tokens of test_clipped_value_loss_semantics, float32 like the critic worker's: per token
    # 0.5 * [3.24, 4.0, 0.81, 0.25], only token 0 clipped; 0 / False on padding (NaN there).
    v = torch.tensor([[1.0, 1.0, 0.1, -0.5, math.nan]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, math.nan]])
    ret = torch.tensor([[2.0, -1.0, 1.0, 0.0, math.nan]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    terms, clipped = clipped_value_loss_terms(v, old, ret, mask, cliprange_value=0.2)
    assert terms.dtype == torch.float32 and clipped.dtype == torch.bool
    assert terms[0].tolist() == pytest.approx([1.62, 2.0, 0.405, 0.125, 0.0], abs=1e-6)
    assert clipped[0].tolist() == [True, False, False, False, False]
    # The sum a worker takes over the global token count is the token mean of clipped_value_loss.
    loss, clipfrac = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
    assert float(terms.detach().sum() / 4) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert float(loss.detach()) == pytest.approx((1.62 + 2.0 + 0.405 + 0.125) / 4, rel=1e-6)
    assert float(clipped.sum()) / 4 == float(clipfrac) == 0.25
    terms.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 2.0, -0.9, -0.5, 0.0], abs=1e-6)
    # A non-finite live value is not refused by the terms (a worker flags it on every rank) ...
    bad = torch.tensor([[math.inf, 1.0, 0.1, -0.5, 0.0]])
    assert not bool(torch.isfinite(clipped_value_loss_terms(bad, old, ret, mask, cliprange_value=0.2)[0]).all())
    # ... the token mean refuses it, and both refuse non-finite targets.
    with pytest.raises(ValueError, match="values must be finite on mask tokens"):
        clipped_value_loss(bad, old, ret, mask, cliprange_value=0.2)
    with pytest.raises(ValueError, match="returns must be finite on mask tokens"):
        clipped_value_loss_terms(v, old, bad, mask, cliprange_value=0.2)
    with pytest.raises(ValueError, match=r"values has shape \(1, 4\), expected \(1, 5\)"):
        clipped_value_loss_terms(v[:, :4], old, ret, mask, cliprange_value=0.2)


def test_no_clipping_counted_inside_the_band_near_zero():
    # float32 values near 0 whose old values are farther away (still inside the band): the old
    # worker formula old + clamp(v - old, -eps, eps) rounds away from v (here v = 1e-3, old = 0.01
    # gives v + 1.2e-10), and with the return at 0 the rounded value's term is the larger one, so
    # that token was counted as clipped. Clamping the value itself gives v back exactly.
    v = torch.tensor([[1e-3, 1e-3, 1e-3, 3e-3, 1e-3]])
    old = torch.tensor([[0.01, -0.01, 0.1, -0.01, 0.3]])
    ret = torch.zeros(1, 5)
    mask = torch.ones(1, 5)
    assert bool((old + (v - old).clamp(-0.2, 0.2) != v)[0, :4].all())  # the rounding the old formula hit
    terms, clipped = clipped_value_loss_terms(v, old, ret, mask, cliprange_value=0.2)
    assert clipped[0].tolist() == [False, False, False, False, True]
    assert torch.equal(terms[0, :4], 0.5 * v[0, :4].double().pow(2).float())
    # Token 4 is outside the band (|v - old| = 0.299 > 0.2): clipped to 0.1, a larger term.
    assert float(terms[0, 4]) == pytest.approx(0.5 * 0.1**2, rel=1e-6)
    assert clipped_value_loss(v[:, :4], old[:, :4], ret[:, :4], mask[:, :4], cliprange_value=0.2)[1].item() == 0.0
    # Many random tokens near zero, all inside the band: none counted.
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(64, 256, generator=g) * 2 - 1) * 1e-3
    old = v + (torch.rand(64, 256, generator=g) * 2 - 1) * 0.05
    ret = (torch.rand(64, 256, generator=g) * 2 - 1) * 1e-3
    assert clipped_value_loss(v, old, ret, torch.ones(64, 256), cliprange_value=0.2)[1].item() == 0.0
    assert not bool(clipped_value_loss_terms(v, old, ret, torch.ones(64, 256), cliprange_value=0.2)[1].any())


def test_explained_variance():
    # R - V = [0, 0, 0, 1]: unbiased var 0.25; Var[R] = 5/3 -> 1 - 0.25 / (5/3) = 0.85
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    v = torch.tensor([[1.0, 2.0, 3.0, 3.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(v, ret, mask) == pytest.approx(0.85, abs=1e-12)
    assert explained_variance(ret, ret, mask) == 1.0
    assert explained_variance(torch.zeros(1, 5), ret, mask) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(v, torch.full((1, 5), 2.0), mask))  # Var[R] == 0
    assert math.isnan(explained_variance(v, ret, torch.tensor([[0, 0, 1, 0, 0]])))  # one token


# ================================================================ KL controllers
def test_adaptive_controller_update():
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(0.2, 10)  # error 1.0 -> clipped to 0.2
    assert ctl.coef == pytest.approx(0.1 * (1 + 0.2 * 10 / 100), rel=1e-12)  # 0.102
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(0.05, 10)  # error -0.5 -> clipped to -0.2
    assert ctl.coef == pytest.approx(0.1 * (1 - 0.2 * 10 / 100), rel=1e-12)  # 0.098
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(0.11, 10)  # error 0.1, inside the clip
    assert ctl.coef == pytest.approx(0.1 * (1 + 0.1 * 10 / 100), rel=1e-12)
    ctl.update(0.5, 0)  # no samples: no change
    assert ctl.coef == pytest.approx(0.101, rel=1e-12)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="measured_kl must be a finite number"):
            ctl.update(bad, 10)
    assert ctl.coef == pytest.approx(0.101, rel=1e-12)  # never poisoned
    with pytest.raises(ValueError, match="n_samples"):
        ctl.update(0.1, -1)
    # more samples than 5 * horizon with the error at -0.2 would flip the sign: floored at 0
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=1)
    ctl.update(0.0, 10)
    assert ctl.coef == 0.0


def test_fixed_controller_and_state_dicts():
    fixed = FixedKLController(0.001)
    fixed.update(5.0, 1000)
    assert fixed.coef == 0.001
    with pytest.raises(ValueError, match="measured_kl"):
        fixed.update(math.nan, 1)
    ctl = AdaptiveKLController(0.1, 0.1, 100)
    ctl.update(0.2, 10)
    ctl.update(0.2, 10)
    state = ctl.state_dict()
    fresh = AdaptiveKLController(0.1, 0.1, 100)
    fresh.load_state_dict(state)
    assert fresh.coef == ctl.coef == pytest.approx(0.1 * 1.02 ** 2, rel=1e-12)
    fresh.update(0.2, 10)
    ctl.update(0.2, 10)
    assert fresh.coef == ctl.coef
    assert fixed.state_dict() == {"controller": "fixed", "coef": 0.001}
    fixed.load_state_dict({"controller": "fixed", "coef": 0.5})  # checked, but the configured coef stays
    assert fixed.coef == 0.001
    with pytest.raises(ValueError, match="coef"):
        fresh.load_state_dict({"coef": math.nan})
    with pytest.raises(ValueError, match="'coef'"):
        fresh.load_state_dict({})


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", 0.001, 0.1, 10000)
    assert isinstance(fixed, FixedKLController) and not isinstance(fixed, AdaptiveKLController)
    assert fixed.coef == 0.001 and make_kl_controller("fixed", 0.5, None, 1).coef == 0.5
    adaptive = make_kl_controller("adaptive", 0.2, 0.05, 500)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.coef, adaptive.target_kl, adaptive.horizon) == (0.2, 0.05, 500)
    with pytest.raises(ValueError, match=r"'pid'.*\['fixed', 'adaptive'\]"):
        make_kl_controller("pid", 0.1, 0.1, 100)
    for target in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="target_kl"):
            make_kl_controller("adaptive", 0.1, target, 100)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1, None, 100)
    for horizon in (0, -5):
        with pytest.raises(ValueError, match="horizon"):
            make_kl_controller("adaptive", 0.1, 0.1, horizon)
        with pytest.raises(ValueError, match="horizon"):
            make_kl_controller("fixed", 0.1, 0.1, horizon)
    with pytest.raises(ValueError, match="init_coef"):
        make_kl_controller("adaptive", -0.1, 0.1, 100)
