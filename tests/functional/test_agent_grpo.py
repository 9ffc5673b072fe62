"""GRPO on an agent program: the program talks to the run's OpenAI-compatible server, the server
records the sampled tokens, and the trainer trains on exactly those (the sampler's and the trainer's
log-probs agree), with failing and hanging episodes counted, never fatal."""

from __future__ import annotations

import math
import os

import pytest

from nemo_like.algorithms.grpo import grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


def _config(tmp_path, cache, *extra):
    return load_config(CONFIG, [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=2", "grpo.val_period=2", "grpo.max_val_samples=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "cluster.num_workers=2", "cluster.cpus_per_worker=1",
        "data.train.generator.num_samples=200", "data.validation.generator.num_samples=16",
        "data.train.env_name=agent", "data.validation.env_name=agent", "policy.max_total_sequence_length=64",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=5", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        f"bootstrap.cache_dir={cache}",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.enabled=false",
        *extra,
    ])


@pytest.mark.parametrize("workers", [2, 1], ids=["batched-for-two-ranks", "streamed-into-one-worker"])
def test_grpo_trains_an_agent_program_on_the_tokens_it_was_served(ray_session, tmp_path, base_model_cache, workers):
    # Two FSDP ranks decode in lock step: the server batches the turns for generate(). One worker
    # streaming episodes takes them into its continuous engine as they come (StreamingEngine).
    # Hung episodes are cut at 2 s: at 1 s, on a slow CI machine, a step once had no episode left to
    # train on (its log-prob error NaN).
    cfg = _config(tmp_path, base_model_cache, "env.agent.fn=_nl_agent_helpers:two_turns",
                  "env.agent.episode_timeout_s=2", "grpo.val_at_start=false",
                  f"cluster.num_workers={workers}", f"cluster.cpus_per_worker={3 - workers}",
                  f"policy.generation.stream_episodes={workers == 1}")
    trainer = setup(cfg)
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 2
        assert trainer.agent_server.streaming == (workers == 1)
        if workers == 1:  # the last rollout's (validation's) turns, each taken and answered by the worker
            stats = trainer.agent_server.stats
            assert stats["taken"] == stats["answered"] > 0
        batch = trainer.last_batch
        for m in results:
            # Recomputed by the trainer on the recorded tokens, the sampler's log-probs agree.
            assert abs(m["train/token_mult_prob_error"] - 1.0) < 0.01
        errors, rewards = batch["grading_error"], batch["total_reward"].tolist()
        failed = [e is not None for e in errors]
        assert 0 < sum(failed) < len(failed)
        for i, log in enumerate(batch["message_log"]):
            if failed[i]:  # raised or timed out: unscorable, the run went on
                assert math.isnan(rewards[i])
                assert "fails on purpose" in errors[i] or "episode_timeout_s=2" in errors[i]
                continue
            # Two requests, the second extending the first: one row, both replies trained.
            assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
            assert rewards[i] in (0.0, 1.0)
            for m in log[1::2]:
                assert len(m["generation_logprobs"]) == len(m["token_ids"]) > 0
        last = results[-1]
        assert last["train/agent/failed"] == sum(failed)
        assert 0 < last["train/agent/timeouts"] < sum(failed)
        assert last["train/agent/requests"] == 2 * (len(failed) - sum(failed))
        assert last["train/agent/prefix_breaks"] == 0
        assert "val/accuracy" in last
    finally:
        trainer.close()
