"""GRPO on a verifiers environment, unchanged: its taskset gives the prompts (train and held-out
splits), verifiers' own harness program plays each episode through the run's OpenAI-compatible server,
the trainer trains on the tokens the server recorded, the rubric's weighted score is the reward and each
reward function's score is a metric. Tasks whose reward reads a field they lack cost only their episodes.

Each episode starts verifiers' chat program in a subprocess, so the test keeps to two steps of 8
episodes and 4 validation episodes."""

from __future__ import annotations

import math
import os

import pytest

from nemo_like.algorithms.grpo import grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

pytest.importorskip("verifiers.v1")

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")
# Every other task lacks the answer its reward reads (one of the 4 train tasks, all drawn in the 2 steps);
# a quarter of the tasks are held out.
GEN = ("{kind: verifiers, environment: '_nl_vf_helpers:load_environment', validation_percent: 25, "
       "args: {num_tasks: 48, missing_every: 2}")


def _config(tmp_path, cache, *extra):
    return load_config(CONFIG, [
        f"data.train={{task_name: vf, env_name: verifiers, generator: {GEN}, split: train, seed: 1, num_samples: 4}}}}",
        f"data.validation={{task_name: vf, env_name: verifiers, generator: {GEN}, split: validation, seed: 2}}}}",
        "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=2", "grpo.val_period=2", "grpo.max_val_samples=4", "grpo.val_at_start=false",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8", "policy.generation_batch_size=8",
        "cluster.num_workers=2", "cluster.cpus_per_worker=1", "policy.max_total_sequence_length=64",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=5", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        f"bootstrap.cache_dir={cache}", "env.verifiers.episode_timeout_s=120",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.enabled=false",
        *extra,
    ])


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_grpo_trains_a_verifiers_environment_on_the_tokens_it_was_served(ray_session, tmp_path, base_model_cache):
    trainer = setup(_config(tmp_path, base_model_cache))
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 2
        # Recomputed by the trainer on the recorded tokens, the sampler's log-probs agree (a step whose groups
        # all tied trains on nothing and measures nothing).
        measured = [m["train/token_mult_prob_error"] for m in results if not math.isnan(m["train/token_mult_prob_error"])]
        assert measured and all(abs(x - 1.0) < 0.01 for x in measured)
        batch = trainer.last_batch
        errors, rewards = batch["grading_error"], batch["total_reward"].tolist()
        failed = [e is not None for e in errors]
        # The task that lacks its answer cost its 4 episodes, counted; the other 12 were scored.
        assert sum(m["train/agent/failed"] for m in results) == 4
        for i, log in enumerate(batch["message_log"]):
            if failed[i]:  # the task lacks its answer: unscorable, counted, the run went on
                assert math.isnan(rewards[i]) and "KeyError" in errors[i]
                continue
            assert [m["role"] for m in log] == ["user", "assistant"]
            assert len(log[1]["generation_logprobs"]) == len(log[1]["token_ids"]) > 0
            assert rewards[i] in (0.0, 0.5, 1.0, 1.5)  # exact (weight 1) + short (weight 0.5)
        last = results[-1]
        assert last["train/agent/failed"] == sum(failed) and last["train/agent/requests"] == 8
        # Each reward function's score and the metric, averaged over the scored episodes.
        assert 0.0 <= last["train/agent/exact"] <= 1.0 and 0.0 <= last["train/agent/short"] <= 1.0
        assert last["train/agent/reply_chars"] >= 0.0
        assert "val/accuracy" in last
    finally:
        trainer.close()
