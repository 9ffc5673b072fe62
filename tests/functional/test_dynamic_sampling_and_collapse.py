"""DAPO dynamic sampling and the collapse stop through the real trainer (Ray, policy workers, the
reward-function actor). The rewards are forced by functions in _nl_reward_helpers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_like import GRPOExperiment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def _overrides(tmp: Path, cache: Path | None, *extra: str) -> list[str]:
    """``cache``: this module's bootstrap.cache_dir (a 2-step SFT model), or None where ``extra`` names
    the model (the untrained tiny one, or the session's shared base model)."""
    return [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=10",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
        "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "data.train.generator.num_samples=200", "data.validation.generator.num_samples=4",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=2", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        *([] if cache is None else ["bootstrap.num_workers=1", f"bootstrap.cache_dir={cache}"]),
        f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.save_period=100",
        *extra,
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("base_cache")


def test_dynamic_sampling_trains_only_groups_with_reward_spread(ray_session, tmp_path, cache):
    over = _overrides(tmp_path, cache, "++data.train.reward_fns=[{fn: _nl_reward_helpers.half_constant}]",
                      "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_gen_batches=6",
                      "grpo.stop_on_collapse.enabled=false")
    with GRPOExperiment(str(CONFIG), over) as exp:
        for _ in range(2):
            m = exp.step()
            batch = exp.trainer.last_batch
            r = batch["total_reward"].view(-1, 4)
            trained = batch["loss_multiplier"].view(-1, 4)[:, 0] > 0
            assert r.shape[0] == 4  # the step still trains num_prompts_per_step groups
            # every trained group has spread: the constant half was dropped
            assert bool((r.amax(dim=1) > r.amin(dim=1))[trained].all())
            assert torch.equal(trained, torch.ones(4, dtype=torch.bool)) == (m["train/dynamic_sampling/filled_groups"] == 0)
            assert m["train/zero_std_group_frac"] == pytest.approx(1 - float(trained.float().mean()))
            assert 1 <= m["train/dynamic_sampling/gen_batches"] <= 6
            assert 0 < m["train/dynamic_sampling/kept_group_frac"] < 1  # about half the prompts are constant
        # more prompts were drawn than 2 steps x 4, and the sampler's position says so (resumable)
        assert exp.trainer.sampler.position == 4 * sum(h["train/dynamic_sampling/gen_batches"] for h in exp.trainer.history)


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_advantage_collapse_stops_training_saves_and_survives_resume(ray_session, tmp_path, model_dir):
    # Rewards forced to 0: any model collapses, so the untrained tiny one (no bootstrap: this module's
    # base models are keyed by their reward_fns, and this one would be built for this test alone).
    over = _overrides(tmp_path, None, f"policy.model_name={model_dir}",
                      "++data.train.reward_fns=[{fn: _nl_reward_helpers.always_zero}]",
                      "grpo.stop_on_collapse.patience=3")
    with GRPOExperiment(str(CONFIG), over) as exp:
        exp.train(steps=2)
        assert exp.stop_reason is None and exp.step_count == 2
        exp.save()
    with GRPOExperiment.resume(tmp_path / "ckpt") as exp:
        assert exp.trainer.collapse_watch.counts["advantage_collapse"] == 2  # counters came back
        results = exp.train()  # would run to step 10; stops at step 3
        assert len(results) == 1 and exp.step_count == 3
        assert exp.stop_reason == ("advantage_collapse at step 3: 1.00 of groups have equal rewards (>= 0.99) "
                                   "for 3 consecutive steps (grpo.stop_on_collapse.patience=3)")
        assert (tmp_path / "ckpt" / "step_3").is_dir()  # saved at the stop, off the save_period


def test_generation_collapse_exits_3_with_one_line(ray_session, tmp_path, base_model_cache, capsys, monkeypatch):
    from nemo_like.cli import run_cli, run_grpo

    # A trained model, so that its one token is never the end of turn (truncation rate exactly 1.00).
    # One token cannot answer "\\boxed{N}": the math reward is 0 for every sample. The base model is
    # the session's shared 5-step one (test_experiment, test_grpo_functional, the math notebooks).
    over = _overrides(tmp_path, None, "bootstrap.sft.num_steps=5", f"bootstrap.cache_dir={base_model_cache}",
                      "policy.generation.max_new_tokens=1", "grpo.stop_on_collapse.patience=2",
                      "grpo.stop_on_collapse.zero_std_group_frac=1.0")
    # examples/run_grpo_math.py's main (the CLI's run_cli) in this process, on the session's Ray: a
    # subprocess started a Ray of its own (~10 s more). Its exit code is main's return value.
    monkeypatch.chdir(tmp_path)
    code = run_cli(over, CONFIG, run_grpo)
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: stopped: generation_collapse at step 2: truncation "
                                                     "rate 1.00 >= 0.9 and mean reward 0.000 <= 0.0"), err[-2000:]
    assert errors[0].endswith(f"checkpoint in {tmp_path / 'ckpt'}")
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "ckpt" / "step_2").is_dir()


def test_a_registered_estimator_gets_rewards_groups_token_mask_and_config(ray_session, tmp_path, model_dir):
    from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    seen = {}
    with ADVANTAGE_ESTIMATORS.isolated():

        @register_advantage_estimator("length_aware")
        def length_aware(rewards, group_ids, *, config, token_mask=None):
            seen.update(n=len(rewards), groups=group_ids.tolist(), mask=token_mask, config=config)
            return rewards - rewards.mean()  # one decorated function: no edit to the trainer

        # What the estimator is handed, not what the model learned: the untrained tiny model.
        over = _overrides(tmp_path, None, f"policy.model_name={model_dir}", "grpo.advantage_estimator=length_aware",
                          "grpo.max_num_steps=1")
        with GRPOExperiment(str(CONFIG), over) as exp:
            exp.step()
            batch = exp.trainer.last_batch
    assert seen["n"] == 16 and seen["groups"] == [g for g in range(4) for _ in range(4)]
    assert seen["config"].advantage_estimator == "length_aware"
    # the token mask is the training rows' own: assistant tokens per sample
    assert seen["mask"].shape[0] == 16 and seen["mask"].sum(dim=1).tolist() == batch["generation_lengths"].tolist()
    r = batch["total_reward"]
    assert torch.allclose(batch["advantages"], r - r.mean())
