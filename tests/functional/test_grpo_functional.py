"""A short GRPO run end to end through real Ray, real FSDP/gloo workers and the real math actor:
bootstrap a tiny base model, train a few steps, checkpoint, resume from the checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nemo_like.algorithms.grpo import accuracy_summary, grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


def _config(tmp_path, cache, *extra):
    overrides = [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=3",
        "grpo.val_period=2", "grpo.max_val_samples=16",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "loss_fn.reference_policy_kl_penalty=0.01",
        # Two FSDP ranks (the default is one worker): generation, log-probs and training all sharded.
        "cluster.num_workers=2", "cluster.cpus_per_worker=1",
        "data.train.generator.num_samples=200", "data.validation.generator.num_samples=16",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=5", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        # The session's shared cache: test_grpo_functional is the first to build this recipe (two SFT
        # workers); its later tests and the math notebooks reuse it.
        f"bootstrap.cache_dir={cache}",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.save_period=2",
        *extra,
    ]
    return load_config(CONFIG, overrides)


@pytest.fixture(scope="module")
def run_dir(ray_session, tmp_path_factory):
    return tmp_path_factory.mktemp("grpo")


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_grpo_runs_logs_checkpoints_and_resumes(run_dir, base_model_cache):
    cfg = _config(run_dir, base_model_cache)
    trainer = setup(cfg)
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 3 and len(results) == 3
        for m in results:
            assert 0.0 <= m["train/reward_mean"] <= 1.0
            assert m["train/num_samples"] == 16.0
            assert torch.isfinite(torch.tensor(m["train/loss"]))
            # The sampler's log-probs and the trainer's agree: HF generation and the training
            # forward pass run on the same sharded weights.
            assert abs(m["train/token_mult_prob_error"] - 1.0) < 0.02
            for phase in ("generation_and_reward", "generation", "logprobs", "train"):
                assert m[f"timing/{phase}"] > 0
            assert 0 < m["train/padding_efficiency"] <= 1 and m["perf/train_tokens_per_s"] > 0
            assert m["perf/peak_memory_gb"] > 0 and "perf/mfu" not in m  # no MFU on a CPU
        # float32 in-worker sampling: the sampler's log-probs are the old policy's, recomputed only
        # every grpo.logprob_check_period (10) steps, the first included.
        assert [m["train/prev_logprobs_reused"] for m in results] == [0.0, 1.0, 1.0]
        assert "train/logprob_padding_efficiency" in results[0] and "train/logprob_padding_efficiency" not in results[1]
        assert "val/accuracy" in results[1]  # val_period=2
        # The first and last validations graded the same problems: the summary pairs them.
        first, last = trainer.first_val_results, trainer.last_val_results
        n = int(trainer.last_val_metrics["val/num_samples"])
        assert len(first["correct"]) == len(last["correct"]) == n and first["task_name"] == last["task_name"]
        assert sum(last["correct"]) == round(trainer.last_val_metrics["val/accuracy"] * n)
        gained = sum(a and not b for b, a in zip(first["correct"], last["correct"]))
        lost = sum(b and not a for b, a in zip(first["correct"], last["correct"]))
        summary = accuracy_summary(trainer)
        assert "held-out greedy accuracy" in summary and f"{gained} gained, {lost} lost, McNemar p" in summary
    finally:
        trainer.close()

    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps_with_val = [r["step"] for r in rows if "val/accuracy" in r]
    assert steps_with_val == [0, 2, 3]  # base model, val_period, end of training
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    # A checkpoint at step 2 (save_period) and one at the end (step 3), each complete.
    ckpts = sorted(p.name for p in (run_dir / "ckpt").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_2", "step_3"]
    assert (run_dir / "ckpt" / "step_3" / "policy" / "config.json").exists()

    # A rerun with the same directories resumes at step 3 and continues to step 4; how the passes are
    # cut (here: packed rows on both ranks, log-probs recomputed) may change on a resume.
    trainer = setup(_config(run_dir, base_model_cache, "grpo.max_num_steps=4", "policy.sequence_packing.enabled=true",
                            "grpo.reuse_generation_logprobs=false"))
    try:
        assert trainer.step_count == 3
        assert trainer.first_val_results == first and trainer.last_val_results == last  # kept in the checkpoint
        assert (trainer.sampler.epoch, trainer.sampler.position) == (0, 12)  # 3 steps x 4 prompts
        (m,) = grpo_train(trainer)
        assert trainer.step_count == 4
        assert m["train/prev_logprobs_reused"] == 0.0 and abs(m["train/token_mult_prob_error"] - 1.0) < 0.02
        assert m["train/padding_efficiency"] > 0.9 and m["train/logprob_padding_efficiency"] > 0.9
        # Once the wall-clock budget is spent no step starts: 1 ms lets one step of the two asked for run.
        trainer.config.grpo.max_duration_s = 1e-3
        assert len(grpo_train(trainer, max_steps=2)) == 1 and trainer.step_count == 5
    finally:
        trainer.close()

    # A different recipe in the same checkpoint_dir is refused before anything starts.
    from ray._private.state import actors

    from nemo_like.config import ConfigError

    created = len(actors())
    with pytest.raises(ConfigError, match=r"holds another run, not resumed: loss_fn.ratio_clip_max \(0.2 -> 0.3\)"
                                          r".*set checkpointing.resume=false"):
        setup(_config(run_dir, base_model_cache, "grpo.max_num_steps=5", "loss_fn.ratio_clip_max=0.3"))
    assert len(actors()) == created  # no actor was ever started
    # Asked to start fresh there, it does: step 0, the earlier run's checkpoints kept in previous_1/.
    trainer = setup(_config(run_dir, base_model_cache, "grpo.max_num_steps=5", "loss_fn.ratio_clip_max=0.3",
                            "checkpointing.resume=false"))
    try:
        assert trainer.step_count == 0 and trainer.first_val_results is None
        assert sorted(p.name for p in (run_dir / "ckpt").iterdir() if not p.name.startswith(".")) == ["previous_1"]
        assert (run_dir / "ckpt" / "previous_1" / "step_5" / "run_identity.json").exists()
    finally:
        trainer.close()


def test_several_passes_over_a_batch_clip_against_the_log_probs_before_the_first(ray_session, tmp_path,
                                                                                 base_model_cache):
    # One optimizer step a pass (the global batch is the step's 16 samples), two passes: the first pass's
    # ratio is exactly 1 (no weights moved yet), the second's is not (the same old log-probs, new weights).
    cfg = _config(tmp_path, base_model_cache, "grpo.ppo_epochs=2", "grpo.max_num_steps=1", "cluster.num_workers=1",
                  "loss_fn.reference_policy_kl_penalty=0", "grpo.val_at_end=false", "grpo.val_period=0",
                  "grpo.success_threshold=0.0", "checkpointing.enabled=false", "policy.optimizer.lr=0.01",
                  # rewards with spread in a group, whatever the tiny model writes: advantages to train on
                  "data.train.env_name=reward_fn", 'data.train.reward_fns=[{fn: "_nl_reward_helpers:half_constant"}]')
    trainer = setup(cfg)
    try:
        assert trainer.last_val_metrics == {}
        val = trainer.validate()
        assert val["val/accuracy"] == 1.0  # every reward is >= 0: what the threshold says counts
        (m,) = grpo_train(trainer)
        assert abs(m["train/pass1/probs_ratio"] - 1.0) < 1e-5
        assert abs(m["train/pass2/probs_ratio"] - 1.0) > 1e-4
        assert m["train/probs_ratio"] == m["train/pass2/probs_ratio"]  # train/* is the last pass
        assert m["train/accuracy"] == 1.0
    finally:
        trainer.close()


def test_training_stops_after_max_num_epochs_passes_over_the_data(ray_session, tmp_path, base_model_cache):
    # 8 training prompts, 4 a step: a pass is 2 steps, so 2 epochs end the run at step 4 of 10.
    cfg = _config(tmp_path, base_model_cache, "data.train.generator.num_samples=8", "grpo.max_num_epochs=2", "grpo.max_num_steps=10",
                  "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "cluster.num_workers=1",
                  "checkpointing.enabled=false")
    trainer = setup(cfg)
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 4 and len(results) == 4
        assert [m["train/epoch"] for m in results] == [0.0, 1.0, 1.0, 2.0]
    finally:
        trainer.close()


def test_checkpoints_are_ranked_only_by_their_own_validation(ray_session, tmp_path, base_model_cache):
    # Validated and saved every second step; saves in between (exp.save() in a notebook, the save of a
    # collapse stop) must not carry the score of the validation before them, or they would tie with
    # it and win as the newer.
    cfg = _config(tmp_path, base_model_cache, "grpo.max_num_steps=3", "grpo.val_period=2", "checkpointing.save_period=2",
                  "checkpointing.keep_top_k=null", "cluster.num_workers=1")
    trainer = setup(cfg)
    try:
        trainer.validate()
        trainer.step()
        trainer.save_checkpoint()  # step 1: not validated
        trainer.step()  # step 2: validated and saved
        trainer.step()
        trainer.save_checkpoint()  # step 3: not validated
        ckpt = trainer.checkpointer
        infos = {s: ckpt.load_training_info(tmp_path / "ckpt" / f"step_{s}")["metrics"] for s in (1, 2, 3)}
        assert ["val/accuracy" in infos[s] for s in (1, 2, 3)] == [False, True, False]
        assert ckpt.get_best_checkpoint_path().name == "step_2"
    finally:
        trainer.close()
