"""Trajectory-level GRPO on step environments, end to end with real Ray collectors: CartPole learns,
the collectors act with the latest weights, short trajectories are dropped, a run that cannot learn
stops and says why, resume continues exactly, the CNN trunk learns Catch, and the notebook API."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nemo_like.config import load_yaml_with_defaults
from nemo_like.gym.experiment import GymGRPOExperiment

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
CARTPOLE = os.path.join(CONFIGS, "grpo_cartpole.yaml")


def _overrides(tmp, *extra):
    return [f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false", "logger.stdout_enabled=false",
            f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "grpo.target_val_return=null", *extra]


def test_cartpole_learns_with_the_weights_of_the_latest_update(tmp_path, ray_session):
    with GymGRPOExperiment(CARTPOLE, _overrides(tmp_path, "grpo.max_num_steps=20", "checkpointing.enabled=false")) as exp:
        exp.train()
        steps = [h for h in exp.trainer.history if "train/return_mean" in h]
        assert len(steps) == 20 and exp.step_count == 20
        for h in steps:
            # The collectors acted with exactly the weights the learner starts the update from.
            assert h["train/logprob_mismatch"] < 1e-5 and h["train/policy_version_lag"] == 0
            assert h["train/groups_complete"] == 8 and h["train/optimizer_steps"] == 2
        val = exp.returns()
        assert len(val) == 5  # at start and every 5 updates
        assert val[-1] > val[0] + 50, val  # greedy return on held-out seeds: ~10 -> > 100
        assert np.mean([h["train/return_mean"] for h in steps[-3:]]) > 2 * np.mean(
            [h["train/return_mean"] for h in steps[:3]])
        df = exp.metrics
        assert list(df["step"]) == list(range(21)) and "val/return_mean" in df.columns
        assert len(exp.plot().axes) == 3
        episode = exp.rollout(seed=7)
        assert episode["failed"] is None and episode["length"] == episode["return"] > 0
        assert exp.act([np.zeros(4, dtype=np.float32)] * 2) in ([0, 0], [1, 1])


def test_short_trajectories_are_dropped_and_only_complete_groups_trained(tmp_path, ray_session, capsys):
    import ray

    # On a resource pool (cluster.roles.generation: the collectors), placed as a GRPO run's roles are.
    pool = ["++cluster.resource_pools.cpu.cpus_per_node=2", "++cluster.roles.generation=cpu"]
    with GymGRPOExperiment(CARTPOLE, _overrides(tmp_path, "env.min_trajectory_length=15", *pool,
                                                "grpo.max_refill_rounds=3", "checkpointing.enabled=false")) as exp:
        m = exp.step()
        # The two collectors run in the pool's bundle, 1 of its 2 CPUs each: none of it is left.
        pg = [k for k, p in ray.util.placement_group_table().items() if p["name"] == "pool-cpu" and
              p["state"] == "CREATED"]
        assert len(pg) == 1 and ray.available_resources().get(f"CPU_group_{pg[0]}", 0.0) == 0.0
    plan = capsys.readouterr().out
    assert ("[nemo_like] placement (role -> pool -> nodes):\n  generation (the collectors) -> pool 'cpu' "
            "(1 node(s) x 2 CPU) -> node ") in plan and " ranks 0,1\n" in plan, plan
    assert m["train/dropped_short"] > 0
    assert m["train/groups_complete"] + m["train/groups_incomplete"] == 8
    assert m["train/groups_complete"] >= 1
    assert m["train/return_min"] >= 15  # CartPole's return is its length: every trained one is long enough
    assert m["train/refill_rounds"] >= 1


def test_a_run_that_cannot_learn_stops_and_says_why(tmp_path, ray_session):
    from nemo_like.cli import run_cli, run_grpo_gym
    from nemo_like.gym.config import load_gym_config

    def main(argv):  # what examples/run_grpo_gym.py does, in this process (Ray is already up)
        return run_cli(argv, CARTPOLE, run_grpo_gym, loader=load_gym_config)

    # CartPole ends at 500 steps: no trajectory is ever long enough, so no group is ever complete.
    args = _overrides(tmp_path, "env.min_trajectory_length=501", "grpo.max_refill_rounds=0",
                      "grpo.max_empty_steps=2", "grpo.val_at_start=false", "checkpointing.enabled=false")
    with GymGRPOExperiment(CARTPOLE, args) as exp:
        exp.train()
        assert exp.step_count == 2
        assert "no complete group in 2 steps" in exp.stop_reason and "min_trajectory_length=501" in exp.stop_reason
    assert main(args) == 1
    assert main(["grpo.group_sise=4"]) == 2  # a config error: exit 2, one line


def test_resume_continues_exactly_where_the_run_stopped(tmp_path, ray_session):
    args = ["grpo.max_num_steps=6", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "checkpointing.save_period=3"]
    with GymGRPOExperiment(CARTPOLE, _overrides(tmp_path / "a", *args)) as exp:
        exp.train()
        straight = [h["train/return_mean"] for h in exp.trainer.history]
        weights = {k: v.clone() for k, v in exp.trainer.net.state_dict().items()}
    with GymGRPOExperiment(CARTPOLE, _overrides(tmp_path / "b", *args)) as exp:
        exp.train(steps=3)
        assert exp.step_count == 3
    with GymGRPOExperiment.resume(tmp_path / "b" / "ckpt") as exp:
        assert exp.step_count == 3
        exp.train()
        resumed = [h["train/return_mean"] for h in exp.trainer.history]
        assert resumed == straight  # rows 1-3 come back from metrics.jsonl, 4-6 are drawn as before
        for k, v in exp.trainer.net.state_dict().items():
            torch.testing.assert_close(v, weights[k], rtol=0, atol=0)


def test_reference_refresh_and_a_loss_from_the_registry(tmp_path, ray_session):
    args = _overrides(tmp_path, "loss_fn.ref_kl_coef=0.1", "grpo.ref_sync_every=2", "grpo.val_at_start=false",
                      "checkpointing.enabled=false")
    with GymGRPOExperiment(CARTPOLE, args) as exp:
        m = exp.step()
        assert m["train/ref_kl"] != 0.0  # epoch 2 trains away from the reference
        assert not all(torch.equal(a, b) for a, b in zip(exp.trainer.ref_net.parameters(), exp.trainer.net.parameters()))
        exp.step()  # update 2: the reference is refreshed to the live weights
        assert all(torch.equal(a, b) for a, b in zip(exp.trainer.ref_net.parameters(), exp.trainer.net.parameters()))
    # The language-model side's clipped objective, on trajectories (ratios against the pre-update weights).
    cfg = load_yaml_with_defaults(CARTPOLE)
    cfg["loss_fn"] = {"name": "clipped_pg", "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}
    with GymGRPOExperiment(cfg, _overrides(tmp_path / "c", "grpo.val_at_start=false", "checkpointing.enabled=false",
                                           "grpo.max_num_steps=8")) as exp:
        exp.train()
        h = [x for x in exp.trainer.history if "train/loss" in x]  # not the validation row at the end
    assert exp.trainer.ref_net is not None  # clipped_pg's KL (0.01 by default) is against a frozen reference
    assert len(h) == 8 and all(np.isfinite(x["train/loss"]) for x in h)
    assert h[0]["train/probs_ratio"] == pytest.approx(1.0, abs=0.05)  # averaged over both epochs
    assert np.mean([x["train/return_mean"] for x in h[-2:]]) > np.mean([x["train/return_mean"] for x in h[:2]])


@pytest.mark.parametrize("with_vector", [False, True])
def test_the_cnn_trunk_learns_catch_from_images(tmp_path, ray_session, with_vector):
    args = _overrides(tmp_path, "grpo.max_num_steps=50", "grpo.val_period=0", "grpo.val_at_start=false",
                      "grpo.val_at_end=false", "checkpointing.enabled=false", f"env.kwargs.with_vector={with_vector}")
    with GymGRPOExperiment(os.path.join(CONFIGS, "grpo_catch.yaml"), args) as exp:
        exp.train()
        r = [h["train/return_mean"] for h in exp.trainer.history]
    # Random play catches about one ball in five (mean return ~ -0.6); learned play most of them.
    assert np.mean(r[:5]) < 0 and np.mean(r[-5:]) > np.mean(r[:5]) + 0.8, r


def test_a_collector_killed_mid_episode_is_restarted_and_the_run_goes_on(tmp_path, ray_session):
    import threading
    import time

    import ray
    from _nl_gym_helpers import SlowCartPole

    from nemo_like.gym.step_env import STEP_ENV_REGISTRY

    with STEP_ENV_REGISTRY.isolated():
        STEP_ENV_REGISTRY.register("slow-cartpole", SlowCartPole)
        exp = GymGRPOExperiment(CARTPOLE, _overrides(tmp_path, "env.id=slow-cartpole", "grpo.val_at_start=false",
                                                     "checkpointing.enabled=false"))
    with exp:
        exp.step()
        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("m", exp.step()))
        worker.start()
        time.sleep(0.3)  # 32 episodes of ~20 steps x 2 ms on each collector: mid-episode
        ray.kill(exp.trainer.collectors.actors[1], no_restart=False)
        worker.join(timeout=120)
        assert not worker.is_alive()
        m = out["m"]
        assert m["collectors/restarts"] == 1 and m["train/groups_complete"] == 8
        assert m["train/logprob_mismatch"] < 1e-5  # the restarted collector acted with this update's weights
        assert exp.step()["train/groups_complete"] == 8  # and the run goes on


def test_fewer_complete_groups_than_minibatches(tmp_path, ray_session):
    args = _overrides(tmp_path, "grpo.num_minibatches=8", "env.min_trajectory_length=15", "grpo.max_refill_rounds=0",
                      "grpo.val_at_start=false", "checkpointing.enabled=false")
    with GymGRPOExperiment(CARTPOLE, args) as exp:
        m = exp.step()
    assert 0 < m["train/groups_complete"] < 8
    assert m["train/optimizer_steps"] == 2 * m["train/groups_complete"]  # one group per minibatch, 2 epochs


def test_resume_refuses_another_runs_checkpoint_and_a_finished_run_stays_finished(tmp_path, ray_session):
    from nemo_like.config import ConfigError

    # The target is reached at the validation of update 5 (greedy 46.9).
    args = [*_overrides(tmp_path, "grpo.val_period=5", "grpo.max_num_steps=50"), "grpo.target_val_return=40"]
    with GymGRPOExperiment(CARTPOLE, args) as exp:
        exp.train()
        assert exp.reached_target and exp.step_count == 5
    with GymGRPOExperiment(CARTPOLE, args) as exp:  # the same command again: nothing more to do
        assert exp.step_count == 5 and exp.reached_target
        assert exp.train() == []
    with pytest.raises(ConfigError, match=r"env.id='Acrobot-v1' but the checkpoint .* was trained with 'CartPole-v1'"):
        GymGRPOExperiment(CARTPOLE, [*args, "env.id=Acrobot-v1"])
    with pytest.raises(ConfigError, match=r"policy.hidden_sizes=\[32\] but the checkpoint"):
        GymGRPOExperiment(CARTPOLE, [*args, "policy.hidden_sizes=[32]"])


def test_ppo_with_the_value_head_as_critic_runs_on_cartpole(tmp_path, ray_session):
    """examples/configs/ppo_cartpole.yaml (grpo.advantage_estimator=gae): the value head is trained toward the
    GAE returns alongside the clipped policy loss."""
    ppo = os.path.join(CONFIGS, "ppo_cartpole.yaml")
    with GymGRPOExperiment(ppo, _overrides(tmp_path, "grpo.val_at_start=false", "checkpointing.enabled=false",
                                           "grpo.max_num_steps=6", "grpo.val_period=0")) as exp:
        exp.train()
        h = [x for x in exp.trainer.history if "train/loss" in x]
    assert len(h) == 6 and exp.trainer.ref_net is None  # reference_policy_kl_penalty 0: no reference
    for x in h:
        assert all(np.isfinite(x[k]) for k in ("critic/value_loss", "critic/vf_explained_var", "critic/values_mean",
                                               "critic/returns_mean", "train/loss"))
        assert x["critic/vf_clipfrac"] == 0.0 and x["train/optimizer_steps"] == 20
    # The value head starts near 0 and moves toward the returns (tens, for CartPole at gamma 0.98).
    assert h[0]["critic/values_mean"] < 1.0 < h[-1]["critic/values_mean"]
    assert h[-1]["critic/vf_explained_var"] > h[0]["critic/vf_explained_var"]
