"""GRPO through Ray with the Megatron-core training backend (on this CPU megatron's CUDA-only pieces
are pointed at the CPU): an HF rollout worker generates, the Megatron worker trains, and each step's
refit brings the rollout worker the Megatron weights in HF names."""

from __future__ import annotations

import math
import os

import pytest

from nemo_like.algorithms.grpo import grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_grpo_trains_the_megatron_backend_and_refits_the_rollout_worker(ray_session, tmp_path, base_model_cache):
    cfg = load_config(CONFIG, [
        "policy.backend=megatron", "policy.generation.colocated=false", "policy.sequence_packing.enabled=false",
        "cluster.cpus_per_worker=1", "cluster.generation.cpus_per_worker=1",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "grpo.reuse_generation_logprobs=false",  # recompute every step: the rollout/trainer agreement is measured
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "data.train.generator.num_samples=64", "data.validation.generator.num_samples=8",
        # A base model that gets some problems right, so that groups differ and gradients are not zero:
        # the PPO tests' recipe (one SFT worker), so the session's shared cache builds it once.
        "bootstrap.num_workers=1",
        "bootstrap.model.hidden_size=64", "bootstrap.model.num_layers=2",
        "bootstrap.sft.num_steps=150", "bootstrap.sft.batch_size=32", "bootstrap.sft.micro_batch_size=32",
        f"bootstrap.cache_dir={base_model_cache}", f"logger.log_dir={tmp_path / 'logs'}",
        "logger.tensorboard_enabled=false", "checkpointing.enabled=false",
    ])
    trainer = setup(cfg)
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 2 and len(results) == 2
        for m in results:
            assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
            # The rollout worker sampled with the weights Megatron then recomputed the log-probs of:
            # the same float32 numbers up to kernel order (step 2's weights came by refit after step 1).
            assert abs(m["train/token_mult_prob_error"] - 1.0) < 1e-3
        assert trainer.generator.weights_checksums() == [trainer.policy.weights_checksum()]
    finally:
        trainer.close()
