"""trajectory_pg against hand-computed values, and the group-baseline estimators it is used with.

Fixture: B=2 trajectories of lengths 3 and 2 padded to T=3, advantages [1.0, -0.5]:
    policy term = -(1.0 * (lp00 + lp01 + lp02) + (-0.5) * (lp10 + lp11)) / 2
    d loss / d lp0t = -1.0 / 2,  d loss / d lp1t = +0.5 / 2,  0 on the padded step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nemo_like.algorithms.advantages import get_advantage_estimator
from nemo_like.algorithms.loss_config import ClippedPGLossConfig
from nemo_like.algorithms.loss_functions import LOSSES, get_loss_fn
from nemo_like.gym.loss import TrajectoryPGLossConfig, TrajectoryPGLossFn

D = torch.float64
LP = [[-0.5, -1.0, -0.25], [-2.0, -0.75, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
PG = -(1.0 * (-0.5 - 1.0 - 0.25) + (-0.5) * (-2.0 - 0.75)) / 2  # = -(-1.75 + 1.375) / 2 = 0.1875
ENT = [[0.9, 0.6, 0.3], [1.2, 0.0, 99.0]]  # valid mean (0.9 + 0.6 + 0.3 + 1.2 + 0.0) / 5 = 0.6
REF = [[-0.4, -1.5, -0.25], [-1.0, -0.75, 5.0]]  # curr - ref on valid steps: -0.1, 0.5, 0, -1.0, 0 -> mean -0.12


def t(values):
    return torch.tensor(values, dtype=D)


def data(**overrides):
    d = {"advantages": t(ADV), "token_mask": t(MASK)}
    d.update(overrides)
    return d


def run(config=None, curr=LP, seqs=2, toks=5, **overrides):
    curr = (t(curr) if not isinstance(curr, torch.Tensor) else curr).clone().requires_grad_(True)
    loss, metrics = TrajectoryPGLossFn(config)(curr, data(**overrides), seqs, toks)
    loss.backward()
    return loss.detach(), metrics, curr.grad


def test_policy_term_matches_hand_value_and_gradient():
    assert PG == pytest.approx(0.1875)
    loss, metrics, grad = run()
    assert float(loss) == pytest.approx(PG, abs=1e-12)
    torch.testing.assert_close(grad, t([[-0.5, -0.5, -0.5], [0.25, 0.25, 0.0]]))
    assert metrics["pg_loss"] == pytest.approx(PG)
    assert metrics["loss"] == pytest.approx(PG)
    assert metrics["num_valid_seqs"] == 2 and metrics["num_valid_tokens"] == 5
    assert metrics["traj_logprob_mean"] == pytest.approx((-1.75 + -2.75) / 2)
    assert "ref_kl" not in metrics and "entropy" not in metrics
    assert TrajectoryPGLossFn.loss_type == "sequence"


@pytest.mark.parametrize("pad", [1e30, -1e30, float("-inf"), float("inf"), float("nan")])
def test_padded_step_does_not_matter(pad):
    curr = [row[:] for row in LP]
    curr[1][2] = pad
    loss, _, grad = run(curr=curr)
    assert torch.isfinite(loss) and float(loss) == pytest.approx(PG, abs=1e-12)
    assert torch.isfinite(grad).all()
    assert grad[1, 2] == 0.0
    torch.testing.assert_close(grad, t([[-0.5, -0.5, -0.5], [0.25, 0.25, 0.0]]))


@pytest.mark.parametrize("pad", [float("-inf"), float("nan")])
def test_padded_entropy_and_reference_do_not_matter(pad):
    ent, ref = t(ENT), t(REF)
    ent[1, 2], ref[1, 2] = pad, pad
    loss, _, grad = run({"ent_coef": 0.1, "ref_kl_coef": 0.5}, entropy=ent, reference_policy_logprobs=ref)
    assert float(loss) == pytest.approx(PG - 0.1 * 0.6 + 0.5 * -0.12, abs=1e-12)
    assert torch.isfinite(grad).all() and grad[1, 2] == 0.0


def test_sample_mask_drops_a_trajectory():
    loss, metrics, grad = run(seqs=1, toks=3, sample_mask=t([1.0, 0.0]))
    assert float(loss) == pytest.approx(1.75)  # -(1.0 * -1.75) / 1
    assert metrics["num_valid_seqs"] == 1 and metrics["num_valid_tokens"] == 3
    torch.testing.assert_close(grad, t([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]))


def test_normalised_by_the_global_count_not_the_local_one():
    loss, _, grad = run(seqs=8, toks=20)
    assert float(loss) == pytest.approx(PG * 2 / 8)
    torch.testing.assert_close(grad, t([[-1 / 8] * 3, [0.5 / 8, 0.5 / 8, 0.0]]))
    with pytest.raises(ValueError, match="global_valid_seqs"):
        run(seqs=1)  # smaller than this batch's own count of 2


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
    entropy = t(ENT).requires_grad_(True)
    curr = t(LP).requires_grad_(True)
    loss, metrics = TrajectoryPGLossFn({"ent_coef": 0.1})(curr, data(entropy=entropy), 2, 5)
    assert float(loss.detach()) == pytest.approx(PG - 0.1 * 0.6, abs=1e-12)
    assert metrics["entropy"] == pytest.approx(0.6)
    loss.backward()
    # the entropy carries the gradient: -coef / valid steps on each valid step, 0 on padding
    torch.testing.assert_close(entropy.grad, t([[-0.02, -0.02, -0.02], [-0.02, -0.02, 0.0]]))


def test_entropy_is_reported_without_a_coefficient_and_required_with_one():
    loss, metrics, _ = run(entropy=t(ENT))
    assert float(loss) == pytest.approx(PG)
    assert metrics["entropy"] == pytest.approx(0.6)
    with pytest.raises(KeyError, match="entropy"):
        run({"ent_coef": 0.1})


def test_reference_kl_term_adds_coef_times_mean_logprob_difference():
    loss, metrics, grad = run({"ref_kl_coef": 0.5}, reference_policy_logprobs=t(REF))
    assert float(loss) == pytest.approx(PG + 0.5 * -0.12, abs=1e-12)
    assert metrics["ref_kl"] == pytest.approx(-0.12)
    # + coef / valid steps on each valid step
    torch.testing.assert_close(grad, t([[-0.5 + 0.1] * 3, [0.25 + 0.1, 0.25 + 0.1, 0.0]]))
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        run({"ref_kl_coef": 0.5})


def test_all_terms_together():
    loss, _, _ = run({"ent_coef": 0.1, "ref_kl_coef": 0.5}, entropy=t(ENT), reference_policy_logprobs=t(REF))
    assert float(loss) == pytest.approx(PG - 0.1 * 0.6 + 0.5 * -0.12, abs=1e-12)


def test_micro_batches_sum_to_the_whole_batch():
    cfg = {"ent_coef": 0.1, "ref_kl_coef": 0.5}
    fn = TrajectoryPGLossFn(cfg)
    full = data(entropy=t(ENT), reference_policy_logprobs=t(REF))
    whole, _ = fn(t(LP), full, 2, 5)
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 2)):
        part = {k: v[rows] for k, v in full.items()}
        loss, _ = fn(t(LP)[rows], part, 2, 5)
        parts = parts + loss
    assert float(parts) == pytest.approx(float(whole), abs=1e-12)


def test_per_token_advantages_constant_along_a_row_equal_the_per_trajectory_ones():
    per_token = t([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    loss_b, _, grad_b = run()
    loss_bt, _, grad_bt = run(advantages=per_token)
    assert float(loss_bt) == pytest.approx(float(loss_b), abs=1e-12)
    torch.testing.assert_close(grad_bt, grad_b)
    # and a genuinely per-token advantage weights each step: -sum_t A_t lp_t / B
    varying = t([[2.0, 0.0, 1.0], [1.0, -1.0, 0.0]])
    loss, _, _ = run(advantages=varying)
    assert float(loss) == pytest.approx(-(2 * -0.5 + 1 * -0.25 + 1 * -2.0 + -1 * -0.75) / 2)


def test_non_finite_advantages_off_mask_do_not_matter():
    per_token = t([[1.0, 1.0, 1.0], [-0.5, -0.5, float("inf")]])
    loss, _, grad = run(advantages=per_token)
    assert float(loss) == pytest.approx(PG)
    assert torch.isfinite(grad).all()
    loss, _, _ = run(seqs=1, toks=3, advantages=t([1.0, float("nan")]), sample_mask=t([1.0, 0.0]))
    assert float(loss) == pytest.approx(1.75)


def test_shape_errors():
    with pytest.raises(ValueError, match="advantages"):
        run(advantages=t([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="advantages"):
        run(advantages=t([[1.0, 2.0], [3.0, 4.0]]))
    with pytest.raises(ValueError, match="curr_logprobs"):
        TrajectoryPGLossFn()(t([1.0, 2.0]), data(), 2, 5)
    with pytest.raises(KeyError, match="token_mask"):
        TrajectoryPGLossFn()(t(LP), {"advantages": t(ADV)}, 2, 5)


# ---- config -----------------------------------------------------------------------------------------
def test_registered_and_configured_by_name():
    assert "trajectory_pg" in LOSSES
    fn = get_loss_fn("trajectory_pg", {"ent_coef": 0.1})
    assert isinstance(fn, TrajectoryPGLossFn)
    assert fn.config.ent_coef == 0.1 and fn.config.ref_kl_coef == 0.0
    assert get_loss_fn("trajectory_pg").config == TrajectoryPGLossConfig()
    same = TrajectoryPGLossConfig(ref_kl_coef=0.2)
    assert TrajectoryPGLossFn(same).config is same
    with pytest.raises(ValueError, match="entcoef"):
        get_loss_fn("trajectory_pg", {"entcoef": 1})
    with pytest.raises(ValueError, match="ent_coef"):
        get_loss_fn("trajectory_pg", {"ent_coef": -1.0})


def test_a_language_model_loss_config_maps_by_name():
    lm = ClippedPGLossConfig(name="trajectory_pg", reference_policy_kl_penalty=0.05)
    fn = get_loss_fn("trajectory_pg", lm)
    assert fn.config.ref_kl_coef == 0.05 and fn.config.ent_coef == 0.0
    ns = TrajectoryPGLossFn(SimpleNamespace(reference_policy_kl_penalty=0.3, ent_coef=0.02))
    assert (ns.config.ref_kl_coef, ns.config.ent_coef) == (0.3, 0.02)
    # an explicit ref_kl_coef wins over the language-model name
    both = TrajectoryPGLossFn(SimpleNamespace(reference_policy_kl_penalty=0.3, ref_kl_coef=0.7))
    assert both.config.ref_kl_coef == 0.7


# ---- advantage estimators ---------------------------------------------------------------------------
REWARDS = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def test_mean_estimator_subtracts_the_group_mean():
    adv = get_advantage_estimator("mean")(REWARDS, GROUPS, config=None)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    assert adv.dtype == torch.float32


def test_mean_std_estimator_divides_by_the_unbiased_group_std():
    adv = get_advantage_estimator("mean_std")(REWARDS, GROUPS, config=None)
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (1.0 + 1e-6)  # std of [1, 2, 3] is 1
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert adv[3:].eq(0).all()  # equal rewards: exactly 0
    # eps from the config
    wide = get_advantage_estimator("mean_std")(REWARDS, GROUPS, config=SimpleNamespace(adv_eps=1.0))
    torch.testing.assert_close(wide[:3], torch.tensor([-0.5, 0.0, 0.5]))


@pytest.mark.parametrize("name", ["mean", "mean_std"])
def test_estimators_accept_any_order_and_arbitrary_group_ids(name):
    estimator = get_advantage_estimator(name)
    perm = torch.tensor([4, 2, 0, 5, 3, 1])
    ids = torch.tensor([-7, 1000])[GROUPS]  # arbitrary integer ids
    base = estimator(REWARDS, GROUPS, config=None)
    shuffled = estimator(REWARDS[perm], ids[perm], config=None)
    torch.testing.assert_close(shuffled, base[perm])
    # a second group with a different spread is scaled by its own std (mean_std) or not at all (mean)
    rewards = torch.tensor([0.0, 4.0, 1.0, 2.0, 3.0])
    groups = torch.tensor([9, 9, 3, 3, 3])
    adv = estimator(rewards, groups, config=None)
    std9 = math.sqrt(8.0)  # unbiased std of [0, 4]
    expected = [-2.0, 2.0, -1.0, 0.0, 1.0] if name == "mean" else [-2.0 / std9, 2.0 / std9, -1.0, 0.0, 1.0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)
