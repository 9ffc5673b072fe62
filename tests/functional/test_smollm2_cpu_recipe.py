"""The CPU learning recipe (examples/configs/grpo_smollm2_cpu.yaml) end to end, scaled down: the real
SmolLM2 model, reasoning-gym rows with a worked example as an earlier chat turn, graded by the
reasoning_gym environment actor with the generator's own scorer. The converted model folder is shared
with the other SmolLM2 tests (same cache dir)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from nemo_like import GRPOExperiment
from nemo_like.data.reasoning_gym_tasks import score_reasoning_gym_answer
from nemo_like.environments.reasoning_gym_environment import extract_answer

CONFIG = Path(__file__).parents[2] / "examples" / "configs" / "grpo_smollm2_cpu.yaml"


@pytest.fixture(scope="module")
def exp(ray_session, tmp_path_factory):
    cache = os.environ.get("NEMO_LIKE_CACHE") or str(tmp_path_factory.getbasetemp() / "nemo_like_cache")
    tmp = tmp_path_factory.mktemp("smollm2_cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEMO_LIKE_CACHE", cache)
        e = GRPOExperiment.from_config(CONFIG, overrides=[
            "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8", "policy.generation.max_new_tokens=24",
            "grpo.val_period=0", "grpo.max_val_samples=8", "grpo.max_num_steps=1",
            "data.train.generator.num_samples=50", "data.validation.generator.num_samples=8",
            f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
            "checkpointing.enabled=false", f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        ])
    yield e
    e.close()


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_recipe_step_grades_with_reasoning_gyms_scorer(exp):
    assert exp.config.bootstrap is None and Path(exp.config.policy.model_name).parent.name == "pretrained"
    val = exp.validate()
    assert val["val/num_samples"] == 8.0 and 0.0 <= val["val/accuracy"] <= 1.0

    m = exp.step()
    batch = exp.trainer.last_batch
    assert m["train/num_samples"] == 8.0 and m["train/unscorable_frac"] == 0.0
    assert m["train/prompt_cut_frac"] == 0.0 and 0.0 <= m["train/env/arithmetic/no_answer_rate"] <= 1.0
    assert math.isfinite(m["train/loss"])
    rewards = batch["total_reward"]
    assert set(rewards.tolist()) <= {0.0, 1.0}  # partial_credit: false
    for i, log in enumerate(batch["message_log"]):
        prompt = "".join(msg["content"] for msg in log[:-1])
        # the worked example is an earlier chat turn, before the question
        assert "<|im_start|>assistant\n3 + 4 = 7. The answer is \\boxed{7}.<|im_end|>" in prompt
        info = batch["extra_env_info"][i]
        assert info["problem"] in prompt and prompt.index("3 + 4 = 7") < prompt.index(info["problem"])
        # the environment's reward is reasoning-gym's own score of the boxed answer, exact answers only
        answer = extract_answer(log[-1]["content"], "boxed")
        expect = 0.0 if answer is None else float(
            score_reasoning_gym_answer(info["rg_dataset"], info["rg_options"], info["rg_index"], answer) >= 1.0)
        assert rewards[i].item() == expect
    assert torch.isfinite(batch["advantages"]).all()
