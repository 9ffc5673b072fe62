"""PPO's critic with what already exists, in one run from the notebook API: async rollouts (the values
of samples from older weights come from the current critic at training time), LoRA on the policy
(the critic is a full model of its own) and packed policy passes (the recipe's)."""

from __future__ import annotations

import math
import os

import pytest

from nemo_like import GRPOExperiment

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "ppo_math_tiny.yaml")


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_ppo_with_async_rollouts_and_lora_from_the_notebook_api(ray_session, tmp_path, base_model_cache):
    exp = GRPOExperiment(CONFIG, [
        "grpo.num_prompts_per_step=8", "grpo.max_num_steps=3", "grpo.val_at_start=false", "grpo.val_period=0",
        "grpo.val_at_end=false", "critic.warmup_steps=1", "critic.train_micro_batch_size=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "grpo.async_rollouts.enabled=true", "policy.generation.colocated=false",
        "loss_fn.use_importance_sampling_correction=true",
        "policy.lora.enabled=true", "policy.lora.target_modules=all-linear",
        "cluster.cpus_per_worker=1", "cluster.generation.cpus_per_worker=1", "cluster.critic.cpus_per_worker=1",
        "data.train.generator.num_samples=64", "data.validation.generator.num_samples=8",
        "bootstrap.num_workers=1", "bootstrap.model.hidden_size=64", "bootstrap.model.num_layers=2",
        "bootstrap.sft.num_steps=150", "bootstrap.sft.batch_size=32", "bootstrap.sft.micro_batch_size=32",
        f"bootstrap.cache_dir={base_model_cache}", f"logger.log_dir={tmp_path / 'logs'}",
        "logger.tensorboard_enabled=false", "checkpointing.enabled=false"])
    try:
        history = exp.train(steps=3)
        assert len(history) == 3 and history[0]["critic/warmup"] == 1.0
        for m in history:
            assert math.isfinite(m["critic/value_loss"]) and m["timing/compute_values"] > 0
        # After the warm-up the LoRA policy trains on the critic's advantages, from batches that async
        # generation may have drawn one version back.
        assert all("train/loss" in m and math.isfinite(m["train/loss"]) for m in history[1:])
        assert {m["train/policy_version_lag"] for m in history} <= {0.0, 1.0}
    finally:
        exp.close()
