"""grpo.advantage_estimator=gae on step-environment agents: GAE through the gym trainer's path (its batch of
padded trajectories, the value head's values, terminated vs truncated), the value term training the
value head, and the config errors. No Ray: the trainer's phases are called on hand-made trajectories.

Fixture (gamma 0.9, lam 0.8, V(s) = 0.5 everywhere, rewards 1 per step):
    3 steps, terminated (value past the end 0):
        delta_2 = 1 + 0 - 0.5 = 0.5               A_2 = 0.5
        delta_1 = 1 + 0.9*0.5 - 0.5 = 0.95        A_1 = 0.95 + 0.72*0.5  = 1.31
        delta_0 = 0.95                            A_0 = 0.95 + 0.72*1.31 = 1.8932
    the same 3 steps truncated, bootstrapped with V(final obs) = 0.5:
        delta_2 = 0.95                            A_2 = 0.95
                                                  A_1 = 0.95 + 0.72*0.95  = 1.634
                                                  A_0 = 0.95 + 0.72*1.634 = 2.12648
    2 steps, terminated: A_1 = 0.5, A_0 = 1.31 (padded to T=3: 0 on the pad)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nemo_like.algorithms.loss_functions import get_loss_fn
from nemo_like.config import ConfigError
from nemo_like.gym.agent import AGENT_NETWORKS, build_network
from nemo_like.gym.collector import Trajectory
from nemo_like.gym.config import validate_gym_config
from nemo_like.gym.setup import check_value_head
from nemo_like.gym.step_env import ObsSpec
from nemo_like.gym.trainer import GymGRPOTrainer, _Batch, trajectory_gae

SPEC = ObsSpec(num_actions=2, vector_dim=4)
TERMINATED = [1.8932, 1.31, 0.5]
TRUNCATED_BOOTSTRAPPED = [2.12648, 1.634, 0.95]


def gae_config(**grpo):
    return validate_gym_config({
        "grpo": {"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8, "whiten_advantages": False, "group_size": 2,
                 "num_groups_per_step": 1, "update_epochs": 1, **grpo},
        "loss_fn": {"name": "clipped_pg", "reference_policy_kl_penalty": 0.0, "vf_coef": 0.5},
    })


def trajectory(length, *, terminated=True, seed=0, rewards=None):
    rng = np.random.default_rng(seed)
    return Trajectory(group_id=0, seed=seed, obs=rng.normal(size=(length, 4)).astype(np.float32),
                      actions=rng.integers(0, 2, size=length), logprobs=np.full(length, np.log(0.5), np.float32),
                      rewards=np.ones(length, np.float32) if rewards is None else np.asarray(rewards, np.float32),
                      terminated=terminated, truncated=not terminated, policy_version=0)


def trainer(config, value=None):
    net = build_network(SPEC, config.policy, seed=0)
    if value is not None:  # a value head that says `value` for every observation
        with torch.no_grad():
            net.heads.value.weight.zero_()
            net.heads.value.bias.fill_(value)
    return GymGRPOTrainer(config=config, collectors=None, net=net,
                          optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
                          loss_fn=get_loss_fn(config.loss_fn["name"], config.loss_options()), logger=None)


def gae(trajs, **grpo):
    tr = trainer(gae_config(**grpo), value=0.5)
    batch = _Batch.from_trajectories(trajs)
    adv, critic = tr._gae(batch, trajs)
    return adv, critic, batch


def test_hand_computed_advantages_and_returns_through_the_gym_path():
    adv, critic, batch = gae([trajectory(3), trajectory(2, seed=1)])
    assert adv.shape == (2, 3)
    torch.testing.assert_close(adv, torch.tensor([TERMINATED, [1.31, 0.5, 0.0]]))
    torch.testing.assert_close(critic["values"], torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]]))
    # returns = advantages + values on real steps (the value head's targets), 0 on the pad
    torch.testing.assert_close(critic["returns"], torch.tensor([[2.3932, 1.81, 1.0], [1.81, 1.0, 0.0]]))
    torch.testing.assert_close(batch.rewards, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))


def test_gamma_1_lam_1_with_a_zero_critic_is_the_reward_to_go():
    tr = trainer(gae_config(gamma=1.0, lam=1.0), value=0.0)
    trajs = [trajectory(4, rewards=[1, 0, 2, 3])]
    adv, critic = tr._gae(_Batch.from_trajectories(trajs), trajs)
    torch.testing.assert_close(adv, torch.tensor([[6.0, 5.0, 5.0, 3.0]]))
    torch.testing.assert_close(critic["returns"], adv)


def test_terminated_vs_truncated():
    # Truncated (time limit) with the final observation: bootstrapped with V(final obs), as SB3 does.
    cut = trajectory(3, terminated=False)
    cut.final_obs = np.zeros(4, np.float32)
    adv, _, _ = gae([cut, trajectory(3)])
    torch.testing.assert_close(adv, torch.tensor([TRUNCATED_BOOTSTRAPPED, TERMINATED]))
    # A truncated trajectory without it (built outside the collector) gets 0 past the end, like a
    # terminated one.
    assert trajectory(3, terminated=False).final_obs is None
    adv, _, _ = gae([trajectory(3, terminated=False), trajectory(3)])
    torch.testing.assert_close(adv, torch.tensor([TERMINATED, TERMINATED]))
    # A terminated episode is never bootstrapped, whatever it carries.
    done = trajectory(3)
    done.final_obs = np.zeros(4, np.float32)
    adv, _, _ = gae([done, trajectory(3)])
    torch.testing.assert_close(adv[0], torch.tensor(TERMINATED))


def test_trajectory_gae_bootstrap_is_the_delta_of_the_last_step():
    r, v, mask = torch.ones(1, 3), torch.full((1, 3), 0.5), torch.ones(1, 3)
    adv, ret = trajectory_gae(r, v, mask, torch.tensor([0.5]), gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([TRUNCATED_BOOTSTRAPPED]))
    torch.testing.assert_close(ret, adv + v)


def test_whitened_over_the_real_steps_only():
    adv, critic, batch = gae([trajectory(3), trajectory(2, seed=1)], whiten_advantages=True)
    real = adv[batch.mask().bool()]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(real.std()) == pytest.approx(1.0, abs=1e-4)
    assert float(adv[1, 2]) == 0.0
    # the returns are the unwhitened ones
    torch.testing.assert_close(critic["returns"][0], torch.tensor([2.3932, 1.81, 1.0]))


def _fixed_batch(tr):
    trajs = [trajectory(n, seed=i, rewards=np.random.default_rng(i).uniform(0, 2, n)) for i, n in enumerate([9, 6])]
    batch = _Batch.from_trajectories(trajs)
    adv, critic = tr._gae(batch, trajs)
    fixed = tr._fixed_logprobs(batch)
    return batch, adv, critic, fixed


def test_the_value_term_moves_the_value_head_toward_the_returns():
    tr = trainer(gae_config())
    batch, adv, critic, fixed = _fixed_batch(tr)
    first = tr._train(batch, adv, fixed, 1, critic)
    for _ in range(30):  # the same batch, targets fixed: the value loss falls
        last = tr._train(batch, adv, fixed, 1, critic)
    assert {"critic/value_loss", "critic/vf_clipfrac"} <= set(first)
    assert first["critic/vf_clipfrac"] == 0.0  # cliprange_value defaults to None: no clipping
    assert last["critic/value_loss"] < 0.5 * first["critic/value_loss"]
    with torch.no_grad():
        values = batch.pad(tr.net(batch.obs)[1])
    mask = batch.mask()
    err_before = ((critic["values"] - critic["returns"]) ** 2 * mask).sum()
    err_after = ((values - critic["returns"]) ** 2 * mask).sum()
    assert err_after < 0.5 * err_before
    assert np.isfinite(tr._critic_stats(batch, critic)["critic/vf_explained_var"])


def test_vf_coef_0_leaves_the_value_head_alone_and_clipping_reports_its_fraction():
    cfg = gae_config()
    cfg.loss_fn["vf_coef"] = 0.0
    tr = trainer(cfg)
    before = [p.clone() for p in tr.net.heads.value.parameters()]
    batch, adv, critic, fixed = _fixed_batch(tr)
    tr._train(batch, adv, fixed, 1, critic)
    assert all(torch.equal(a, b) for a, b in zip(before, tr.net.heads.value.parameters()))
    # A tiny clip around the pre-update values: after a few steps most steps are clipped.
    cfg = gae_config()
    cfg.loss_fn["cliprange_value"] = 1e-4
    tr = trainer(cfg)
    batch, adv, critic, fixed = _fixed_batch(tr)
    for _ in range(3):
        m = tr._train(batch, adv, fixed, 1, critic)
    assert m["critic/vf_clipfrac"] > 0.5


@pytest.mark.parametrize(("override", "needle"), [
    ({"grpo": {"gamma": 1.5}}, "grpo.gamma"),
    ({"grpo": {"lam": -0.1}}, "grpo.lam"),
    ({"loss_fn": {"vf_coef": -1.0}}, "vf_coef"),
    ({"loss_fn": {"cliprange_value": -0.2}}, "cliprange_value"),
    ({"grpo": {"advantage_estimator": "mean_std"}}, "loss_fn.vf_coef"),  # a value term with no critic targets
    ({"grpo": {"advantage_estimator": "remax"}}, "greedy_rewards"),  # inputs the gym trainer cannot give
])
def test_config_errors_name_the_key(override, needle):
    cfg = {"grpo": {"advantage_estimator": "gae"}, "loss_fn": {"name": "trajectory_pg", "vf_coef": 0.5}}
    for section, values in override.items():
        cfg[section] = cfg[section] | values
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate_gym_config(cfg)


def test_config_defaults_and_the_value_keys_are_not_the_policy_losss():
    cfg = validate_gym_config({"grpo": {"advantage_estimator": "gae"}, "loss_fn": {"name": "trajectory_pg", "ent_coef": 0.01}})
    assert (cfg.grpo.gamma, cfg.grpo.lam, cfg.grpo.whiten_advantages) == (0.99, 0.95, True)
    assert cfg.value_loss().vf_coef == 0.5 and cfg.value_loss().cliprange_value is None
    cfg = validate_gym_config({"grpo": {"advantage_estimator": "gae"},
                               "loss_fn": {"name": "trajectory_pg", "vf_coef": 0.25, "cliprange_value": 0.2}})
    assert cfg.loss_options() == {}
    assert (cfg.value_loss().vf_coef, cfg.value_loss().cliprange_value) == (0.25, 0.2)
    assert validate_gym_config({}).value_loss() is None  # mean_std: no value term


def test_gae_needs_a_network_with_a_value_head():
    cfg = gae_config()
    check_value_head(build_network(SPEC, cfg.policy), SPEC, cfg)  # mlp has one

    class PolicyOnly(nn.Module):
        def __init__(self, spec, config):
            super().__init__()
            self.pi = nn.Linear(spec.vector_dim, spec.num_actions)

        def forward(self, obs):
            return self.pi(obs), None

    with AGENT_NETWORKS.isolated():
        AGENT_NETWORKS.register("policy_only", PolicyOnly)
        cfg = validate_gym_config({"policy": {"network": "policy_only"}, "grpo": {"advantage_estimator": "gae"}})
        with pytest.raises(ConfigError, match="value head"):
            check_value_head(build_network(SPEC, cfg.policy), SPEC, cfg)
