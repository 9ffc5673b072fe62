"""PPO's configuration is checked before Ray starts: an estimator that needs a critic without one, a
critic nobody uses, out-of-range GAE and KL-controller settings, and a ReMax baseline that cannot be
computed, each a config error naming the key."""

from __future__ import annotations

import pytest

from nemo_like.algorithms.advantages import ESTIMATOR_INPUTS, estimator_needs, register_advantage_estimator
from nemo_like.config import ConfigError, load_config

PPO = "examples/configs/ppo_math_tiny.yaml"
TINY = "examples/configs/grpo_math_tiny.yaml"


def test_the_ppo_recipe_validates_with_its_critic_and_controller() -> None:
    cfg = load_config(PPO, [])
    assert cfg.grpo.advantage_estimator == "gae" and cfg.critic is not None
    assert cfg.critic.warmup_steps == 3 and cfg.critic.model_name is None
    assert cfg.grpo.kl_in_reward.controller == "adaptive" and cfg.cluster.critic.cpus_per_worker == 1


def test_estimators_declare_what_they_need() -> None:
    assert estimator_needs("grpo") == ()
    assert estimator_needs("gae") == ("values", "token_rewards")
    assert estimator_needs("remax") == ("token_rewards", "greedy_rewards")
    with pytest.raises(ValueError, match=r"unknown inputs \['advantages_of_tomorrow'\]"):
        register_advantage_estimator("oracle", lambda r, g, *, config=None, token_mask=None: r,
                                     needs=("advantages_of_tomorrow",))
    assert "values" in ESTIMATOR_INPUTS


@pytest.mark.parametrize("overrides, message", [
    (["grpo.advantage_estimator=gae"], r"grpo.advantage_estimator='gae' needs a critic's values: add a critic section"),
    (["critic.warmup_steps=2"], r"critic is set, but grpo.advantage_estimator='grpo' uses no values"),
    (["grpo.advantage_estimator=remax"], r"grades one greedy sample per prompt of the step: it does not combine "
                                         r"with grpo.dynamic_sampling"),
    (["grpo.gae.lam=1.5"], r"grpo.gae.lam"),
    (["grpo.gae.gamma=-0.1"], r"grpo.gae.gamma"),
    (["grpo.kl_in_reward.target_kl=0"], r"grpo.kl_in_reward.target_kl"),
    (["grpo.kl_in_reward.controller=pid"], r"grpo.kl_in_reward.controller"),
])
def test_bad_ppo_settings_are_config_errors_naming_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_remax_validates_without_dynamic_sampling() -> None:
    cfg = load_config(TINY, ["grpo.advantage_estimator=remax", "grpo.dynamic_sampling.enabled=false"])
    assert cfg.critic is None
