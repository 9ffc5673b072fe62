"""GRPO advantages against hand-computed values.

Fixture batch (ids interleaved, in no particular order):
  group 7: rewards [1, 0, 0, 1]  mean 0.5, unbiased std sqrt(1/3); LOO baselines 1/3 (r=1), 2/3 (r=0)
  group 0: rewards [1, 2, 6]     mean 3,   unbiased std sqrt(14/2) = sqrt(7); LOO baselines 4, 3.5, 1.5
  group 2: reward  [3]           singleton -> 0
  group 5: rewards [2, 2]        zero std -> 0
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nemo_like.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    get_advantage_estimator,
    grpo_estimator,
    register_advantage_estimator,
    registered_advantage_estimators,
)

IDS = torch.tensor([7, 0, 2, 7, 5, 0, 7, 5, 0, 7])
REWARDS = torch.tensor([1, 1, 3, 0, 2, 2, 0, 2, 6, 1], dtype=torch.float64)
LOO = [2 / 3, -3.0, 0.0, -2 / 3, 0.0, -1.5, -2 / 3, 0.0, 4.5, 2 / 3]
MEAN = [0.5, -2.0, 0.0, -0.5, 0.0, -1.0, -0.5, 0.0, 3.0, 0.5]
STD7, STD0 = math.sqrt(1 / 3), math.sqrt(7.0)
GROUP_STD = [STD7, STD0, None, STD7, None, STD0, STD7, None, STD0, STD7]  # None: left unchanged
BATCH_STD = math.sqrt(27.6 / 9)  # sum 18, mean 1.8; squared deviations 3*0.64+1.44+2*3.24+3*0.04+17.64 = 27.6


def expect(values, stds=None, eps=1e-6):
    out = []
    for i, v in enumerate(values):
        s = stds[i] if isinstance(stds, list) else stds
        out.append(v if s is None else v / (s + eps))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "leave_one_out, std_scale, expected",
    [
        (True, None, expect(LOO)),
        (False, None, expect(MEAN)),
        (True, "group", expect(LOO, GROUP_STD)),
        (False, "group", expect(MEAN, GROUP_STD)),
        (True, "batch", expect(LOO, BATCH_STD)),
        (False, "batch", expect(MEAN, BATCH_STD)),
    ],
)
def test_hand_computed(leave_one_out, std_scale, expected):
    adv = compute_grpo_advantages(REWARDS, IDS, leave_one_out=leave_one_out, std_scale=std_scale)
    assert adv.dtype == torch.float64 and adv.shape == (10,)
    assert torch.allclose(adv, expected, atol=1e-12, rtol=0)
    # singleton (index 2) and zero-std group (indices 4, 7) are exactly zero
    assert adv[2].item() == 0.0 and adv[4].item() == 0.0 and adv[7].item() == 0.0


def test_eps_is_added_to_std():
    adv = compute_grpo_advantages(REWARDS, IDS, leave_one_out=False, std_scale="group", eps=0.5)
    assert adv[8].item() == pytest.approx(3.0 / (STD0 + 0.5))
    adv = compute_grpo_advantages(REWARDS, IDS, leave_one_out=False, std_scale="batch", eps=0.0)
    assert adv[8].item() == pytest.approx(3.0 / BATCH_STD)


def test_default_is_leave_one_out_with_group_std():
    adv = compute_grpo_advantages(REWARDS, IDS)
    assert torch.allclose(adv, expect(LOO, GROUP_STD), atol=1e-12, rtol=0)
    assert get_advantage_estimator("grpo")(REWARDS, IDS).tolist() == adv.tolist()


def test_shuffled_order_and_arbitrary_ids_permute_results():
    perm = torch.tensor([9, 3, 0, 8, 5, 1, 7, 2, 6, 4])
    ids = IDS * 1000 - 5  # arbitrary (negative, large) ids
    for loo in (True, False):
        for scale in ("group", "batch", None):
            base = compute_grpo_advantages(REWARDS, IDS, leave_one_out=loo, std_scale=scale)
            shuffled = compute_grpo_advantages(REWARDS[perm], ids[perm], leave_one_out=loo, std_scale=scale)
            assert torch.allclose(shuffled, base[perm], atol=1e-12, rtol=0)


def test_singletons_only_and_single_sample():
    adv = compute_grpo_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 1, 2]))
    assert adv.tolist() == [0.0, 0.0, 0.0]
    for scale in ("group", "batch", None):
        assert compute_grpo_advantages(torch.tensor([4.0]), torch.tensor([3]), std_scale=scale).tolist() == [0.0]
    assert compute_grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_zero_std_groups_are_exactly_zero_even_with_inexact_floats():
    # float32 mean of [0.1]*3 is not exactly 0.1; without the exact test the advantages would be
    # ~1e-8 / eps ~ 0.01 instead of 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float32)
    ids = torch.tensor([4, 4, 4, 9, 9])
    for loo in (True, False):
        for scale in ("group", "batch", None):
            adv = compute_grpo_advantages(rewards, ids, leave_one_out=loo, std_scale=scale)
            assert adv.dtype == torch.float32
            assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group 9, mean baseline, group std: (+-0.5) / (sqrt(0.5) + eps)
    adv = compute_grpo_advantages(rewards, ids, leave_one_out=False, std_scale="group")
    assert adv[3].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)
    # all rewards equal: batch std 0 -> everything 0 (no 0/eps)
    flat = compute_grpo_advantages(torch.full((4,), 0.3), torch.tensor([0, 0, 1, 1]), std_scale="batch")
    assert flat.tolist() == [0.0] * 4


def test_accepts_lists_and_integer_rewards():
    adv = compute_grpo_advantages([1, 0, 1, 1], [0, 0, 1, 1], leave_one_out=True, std_scale=None)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="std_scale"):
        compute_grpo_advantages(REWARDS, IDS, std_scale="global")
    with pytest.raises(ValueError, match="10 entries but group_ids has 9"):
        compute_grpo_advantages(REWARDS, IDS[:9])
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        compute_grpo_advantages(REWARDS[None], IDS)
    with pytest.raises(ValueError, match="group_ids must be integers"):
        compute_grpo_advantages(REWARDS, IDS.double())
    with pytest.raises(ValueError, match=r"non-finite at indices \[1\]"):
        compute_grpo_advantages(torch.tensor([0.0, math.nan]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="eps"):
        compute_grpo_advantages(REWARDS, IDS, eps=-1.0)


# ================================================================ the registered estimators
# Second fixture: groups [1, 0, 0, 1] (id 3), [2, 2] (id 1), [5] (id 8).
#   group 3: mean 0.5, unbiased std sqrt(1/3) = 0.5773503; leave-one-out baselines 1/3 (r=1), 2/3 (r=0)
#   batch:   mean 11/7, unbiased std sqrt((2*16 + 2*121 + 2*9 + 576)/49 / 6) = sqrt(62/21) = 1.7182494
#   reinforce_pp: a = r - group mean = [.5, -.5, -.5, .5, 0, 0, 0], mean(a) = 0,
#                 unbiased std(a) = sqrt(1/6) = 0.4082483
R7 = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
IDS7 = torch.tensor([3, 3, 3, 3, 1, 1, 8])
EXPECTED7 = {
    # (name, use_leave_one_out_baseline, std_scale): expected advantages
    ("grpo", True, "group"): [1.1546985, -1.1546985, -1.1546985, 1.1546985, 0, 0, 0],  # (2/3)/(0.5773503+1e-6)
    ("grpo", False, "group"): [0.8660239, -0.8660239, -0.8660239, 0.8660239, 0, 0, 0],  # 0.5/(0.5773503+1e-6)
    ("grpo", True, "batch"): [0.3879916, -0.3879916, -0.3879916, 0.3879916, 0, 0, 0],  # (2/3)/(1.7182494+1e-6)
    ("grpo", False, None): [0.5, -0.5, -0.5, 0.5, 0, 0, 0],
    ("dr_grpo", True, "group"): [0.5, -0.5, -0.5, 0.5, 0, 0, 0],  # the config does not matter
    ("rloo", False, "batch"): [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0],  # 1 - 1/3, 0 - 2/3
    ("reinforce_pp", True, "group"): [1.2247419, -1.2247419, -1.2247419, 1.2247419, 0, 0, 0],  # 0.5/(0.4082483+1e-6)
}


def grpo_section(loo=True, scale="group"):
    """Stands in for the run's ``grpo`` config section (only the attributes estimators read)."""
    return SimpleNamespace(use_leave_one_out_baseline=loo, std_scale=scale, num_generations_per_prompt=4)


@pytest.mark.parametrize("name, loo, scale", list(EXPECTED7))
def test_registered_estimators_hand_computed(name, loo, scale):
    estimator = get_advantage_estimator(name)
    adv = estimator(R7, IDS7, config=grpo_section(loo, scale), token_mask=torch.ones(7, 5))
    assert adv.dtype == torch.float32 and adv.shape == (7,) and not adv.requires_grad
    assert torch.allclose(adv.double(), torch.tensor(EXPECTED7[name, loo, scale], dtype=torch.float64),
                          atol=1e-6, rtol=0)
    # any order of groups and samples, arbitrary ids: the same values, permuted
    perm = torch.tensor([6, 2, 4, 0, 5, 3, 1])
    shuffled = estimator(R7[perm], IDS7[perm] * 100 - 7, config=grpo_section(loo, scale))
    assert torch.allclose(shuffled, adv[perm], atol=1e-6, rtol=0)


def test_public_rloo_and_reinforce_pp_functions():
    assert compute_rloo_advantages(R7, IDS7).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0])
    # group [1, 2, 6]: 1 - (2+6)/2 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    assert compute_rloo_advantages([1.0, 2.0, 6.0], [0, 0, 0]).tolist() == pytest.approx([-3.0, -1.5, 4.5])
    adv = compute_reinforce_pp_advantages(R7.double(), IDS7, eps=0.0)
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([math.sqrt(1.5), -math.sqrt(1.5), -math.sqrt(1.5), math.sqrt(1.5), 0, 0, 0])
    # batch std 0 (every group constant) or a single sample: a - mean(a), i.e. exact zeros here
    assert compute_reinforce_pp_advantages([2.0, 2.0, 7.0], [0, 0, 1]).tolist() == [0.0, 0.0, 0.0]
    assert compute_reinforce_pp_advantages([4.0], [0]).tolist() == [0.0]
    assert compute_reinforce_pp_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    # integer rewards -> float32; no gradient flows back
    assert compute_reinforce_pp_advantages([1, 0], [0, 0]).dtype == torch.float32
    grad_rewards = R7.clone().requires_grad_(True)
    for fn in (compute_rloo_advantages, compute_reinforce_pp_advantages):
        assert not fn(grad_rewards, IDS7).requires_grad
    with pytest.raises(ValueError, match="eps"):
        compute_reinforce_pp_advantages(R7, IDS7, eps=-1.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_non_finite_rewards_are_refused(name):
    # The trainer masks NaN (unscorable) rewards out before calling an estimator.
    with pytest.raises(ValueError, match=r"non-finite at indices \[1\]"):
        get_advantage_estimator(name)(torch.tensor([0.0, math.nan, 1.0]), torch.tensor([0, 0, 0]),
                                      config=grpo_section())


def test_grpo_estimator_config_defaults():
    grpo = get_advantage_estimator("grpo")
    # a config without the attributes: leave-one-out with group std, compute_grpo_advantages' defaults
    assert torch.allclose(grpo(R7, IDS7, config=SimpleNamespace()), grpo(R7, IDS7, config=grpo_section()))
    plain = grpo(R7, IDS7, config=SimpleNamespace(use_leave_one_out_baseline=False, std_scale=None))
    assert plain.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]


def test_estimator_registry():
    assert get_advantage_estimator("grpo") is grpo_estimator
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(registered_advantage_estimators())
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'rlooo' \(did you mean 'rloo'\?\); registered: \[.*'grpo'"):
        get_advantage_estimator("rlooo")

    with ADVANTAGE_ESTIMATORS.isolated():
        @register_advantage_estimator("test_best_of_group")
        def best_of_group(rewards, group_ids, *, config, token_mask=None):
            # 1 for each group's best sample(s), else 0: a user estimator needs no trainer edit
            best = torch.stack([rewards[group_ids == g].max() for g in group_ids])
            return (rewards == best).to(rewards.dtype)

        out = get_advantage_estimator("test_best_of_group")(R7, IDS7, config=grpo_section())
        assert out.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("grpo")(best_of_group)
        with pytest.raises(TypeError, match=r"must accept \(rewards, group_ids, \*, config"):
            register_advantage_estimator("test_old_style", lambda rewards, group_ids: rewards)
    assert "test_best_of_group" not in registered_advantage_estimators()
