"""A crashed GRPO run resumed through the real trainer (setup(): Ray, policy workers, the math actor):
the checkpoint_dir is locked while a run lives, a damaged newest checkpoint is skipped with a warning
naming what is wrong, and metrics.jsonl holds each step once after the resume."""

from __future__ import annotations

import os
import re

import pytest

from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import ConfigError, load_config
from nemo_like.utils.jsonl_files import read_metrics_jsonl

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


def _config(tmp, model_dir):
    return load_config(CONFIG, [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=50",
        "grpo.val_period=0", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "data.train.generator.num_samples=100", "data.validation.generator.num_samples=8",
        # The untrained tiny model, no bootstrap: what is checked is which steps, prompts and
        # checkpoints survive the crash, not what the model learned.
        f"policy.model_name={model_dir}", f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.save_period=2",
    ])


def test_crashed_run_resumes_from_newest_intact_checkpoint_with_each_step_logged_once(ray_session, tmp_path,
                                                                                    model_dir):
    cfg = _config(tmp_path, model_dir)
    first = setup(cfg)
    try:
        for _ in range(3):
            first.step()  # a checkpoint at step 2 (save_period); step 3 is logged
        first.save_checkpoint()  # and a checkpoint at step 3, damaged below; then the run "crashes"
        # While it lives, the directory is refused to a second run, before anything starts.
        with pytest.raises(ConfigError, match=re.escape(f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'} is in "
                                                        f"use by another run (this process (pid {os.getpid()}")):
            setup(cfg)
    finally:
        first.close()  # releases the lock, as the kernel does for a killed run
    with open(tmp_path / "ckpt" / "step_3" / "train_state.pt", "r+b") as f:
        f.truncate(10)
    crashed = read_metrics_jsonl(tmp_path / "logs")
    assert [r["step"] for r in crashed] == [1, 2, 3]
    # Each row names the 4 prompts its step drew, none drawn twice.
    assert all(len(r["prompt_ids"]) == 4 for r in crashed)
    assert len({p for r in crashed for p in r["prompt_ids"]}) == 12

    with pytest.warns(UserWarning) as caught:
        second = setup(cfg)
    said = " | ".join(str(w.message) for w in caught)
    assert re.search(r"skipping checkpoint step_3 \(train_state.pt has 10 bytes, the manifest says \d+\); using "
                     r"step_2", said) and "step_3 is damaged; moved to invalid_step_3" in said, said
    try:
        assert second.step_count == 2 and second.sampler.position == 8  # 2 steps x 4 prompts
        assert (tmp_path / "ckpt" / "invalid_step_3").is_dir() and not (tmp_path / "ckpt" / "step_3").exists()
        assert [r["step"] for r in read_metrics_jsonl(tmp_path / "logs")] == [1, 2]  # the crashed rows dropped
        assert [h["step"] for h in second.history] == [1, 2]
        second.step()
        second.step()
    finally:
        second.close()
    rows = read_metrics_jsonl(tmp_path / "logs")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once
    # The resumed run drew the crashed run's step-3 prompts again (its weights never kept them), and
    # steps 1-2 kept theirs.
    assert [r["prompt_ids"] for r in rows[:3]] == [r["prompt_ids"] for r in crashed]
    assert not set(rows[3]["prompt_ids"]) & {p for r in crashed for p in r["prompt_ids"]}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
