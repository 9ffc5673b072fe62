"""PPO with a critic through real Ray on the tiny math work: the critic's warm-up leaves the actor's
weights bit-identical while the critic's change, then both train; values, GAE advantages, the KL in
the reward with the adaptive controller, the critic's metrics; a checkpoint holds the critic and the
controller, and a resume restores them exactly."""

from __future__ import annotations

import json
import math
import os

import pytest

from nemo_like.algorithms.grpo import grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "ppo_math_tiny.yaml")


def _config(tmp, cache, *extra):
    return load_config(CONFIG, [
        "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=3",
        "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false",
        "critic.warmup_steps=1", "critic.train_micro_batch_size=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "cluster.cpus_per_worker=1", "cluster.critic.cpus_per_worker=1",
        "data.train.generator.num_samples=64", "data.validation.generator.num_samples=8",
        # A base model that gets some sums right, so rewards differ and gradients are not zero. The same
        # recipe as test_ppo_combinations and test_megatron_grpo: built once in the shared cache.
        "bootstrap.num_workers=1", "bootstrap.model.hidden_size=64", "bootstrap.model.num_layers=2",
        "bootstrap.sft.num_steps=150", "bootstrap.sft.batch_size=32", "bootstrap.sft.micro_batch_size=32",
        f"bootstrap.cache_dir={cache}", f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.save_period=3", *extra])


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_ppo_warms_the_critic_up_then_trains_both_and_resumes_exactly(ray_session, tmp_path, base_model_cache):
    trainer = setup(_config(tmp_path, base_model_cache))
    try:
        actor0, critic0 = trainer.policy.weights_checksum(), trainer.critic.weights_checksum()
        (m1,) = grpo_train(trainer, max_steps=1)
        # Warm-up: the critic trained, the actor did not move (its weights, checked bit for bit).
        assert m1["critic/warmup"] == 1.0 and "train/loss" not in m1
        assert trainer.policy.weights_checksum() == actor0 and trainer.critic.weights_checksum() != critic0
        for m in [m1, *grpo_train(trainer, max_steps=2)]:
            assert math.isfinite(m["critic/value_loss"]) and 0.0 <= m["critic/vf_clipfrac"] <= 1.0
            assert m["timing/compute_values"] > 0 and m["timing/update_critic"] > 0
            assert m["kl_in_reward/coef"] > 0 and math.isfinite(m["kl_in_reward/kl"])  # k1 may be < 0
        assert "train/loss" in m and m["train/advantage_abs_mean"] > 0 and "critic/warmup" not in m
        assert trainer.policy.weights_checksum() != actor0
        # The adaptive controller moved the coefficient from its start (0.001) by the rule.
        coef_after = trainer.ppo.kl_ctl.coef
        assert coef_after != 0.001
        saved_critic = trainer.critic.weights_checksum()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "critic/value_loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["critic/vf_explained_var"]) or math.isnan(r["critic/vf_explained_var"])
               for r in rows if "critic/vf_explained_var" in r)

    trainer = setup(_config(tmp_path, base_model_cache, "grpo.max_num_steps=4"))
    try:
        assert trainer.step_count == 3
        assert trainer.critic.weights_checksum() == saved_critic
        assert trainer.ppo.kl_ctl.coef == pytest.approx(coef_after, rel=0, abs=0)
    finally:
        trainer.close()
