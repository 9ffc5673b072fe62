"""GRPO with a reward model beside the math environment: its score joins every training sample's
reward (train/reward_mean = env reward + score on average), validation stays the environment's."""

from __future__ import annotations

import os

import pytest

from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config
from nemo_like.models.reward_model import load_reward_model

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


def test_one_step_with_a_reward_model_of_another_tokenizer(ray_session, tmp_path, model_dir, base_model_cache):
    from transformers import AutoTokenizer

    rm_dir = tmp_path / "rm"
    load_reward_model(model_dir).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(rm_dir)
    cfg = load_config(CONFIG, [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=1", "grpo.val_period=1", "grpo.max_val_samples=8", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "data.train.generator.num_samples=40", "data.validation.generator.num_samples=8",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1", "bootstrap.sft.num_steps=2",
        "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16", "bootstrap.num_workers=1",
        f"bootstrap.cache_dir={base_model_cache}", f"logger.log_dir={tmp_path / 'logs'}",
        "logger.tensorboard_enabled=false", "checkpointing.enabled=false",
        f"reward_model.model_name={rm_dir}", "reward_model.weight=1.0", "cluster.num_cpus=null"])
    trainer = setup(cfg)
    try:
        m = trainer.step()
    finally:
        trainer.close()
    assert m["train/reward_mean"] == pytest.approx(m["rm/env_reward_mean"] + m["rm/score_mean"], abs=1e-4)
    assert m["rm/score_std"] > 0 and m["timing/reward_model"] > 0
    assert "val/accuracy" in m and not any(k.startswith("val/") and "rm" in k for k in m)
