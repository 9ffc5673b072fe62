"""The SmolLM2 recipe (examples/configs/grpo_smollm2_math.yaml) end to end on CPU: a real pretrained
chat model from a GGUF file, its BPE tokenizer and ChatML template, graded by the math environment.

One tiny GRPO step in float32 with the CPU overrides the recipe documents, scaled down. The converted
model folder is shared with tests/unit/models/test_pretrained.py (same cache dir), so a session converts once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from nemo_like import GRPOExperiment
from nemo_like.data.collate import rl_collate_fn
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.experience.rollouts import flatten_message_logs

CONFIG = Path(__file__).parents[2] / "examples" / "configs" / "grpo_smollm2_math.yaml"
IM_END = "<|im_end|>"
MAX_NEW = 40


@pytest.fixture(scope="module")
def exp(ray_session, tmp_path_factory):
    # setup() converts into $NEMO_LIKE_CACHE/pretrained: the same folder test_pretrained.py uses.
    cache = os.environ.get("NEMO_LIKE_CACHE") or str(tmp_path_factory.getbasetemp() / "nemo_like_cache")
    tmp = tmp_path_factory.mktemp("smollm2_grpo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEMO_LIKE_CACHE", cache)
        e = GRPOExperiment.from_config(CONFIG, overrides=[
            # the CPU overrides of the recipe
            "policy.precision=float32", "cluster.gpus_per_worker=0", "cluster.cpus_per_worker=2", "cluster.num_cpus=2",
            # and a tiny step: 2 prompts x 2 samples, one optimizer step
            "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=4", "policy.generation_batch_size=4",
            f"policy.generation.max_new_tokens={MAX_NEW}",
            "grpo.reuse_generation_logprobs=false",  # recompute, so token_mult_prob_error measures something
            "grpo.val_period=0", "grpo.max_val_samples=2",
            "data.train.generator.num_samples=32", "data.validation.generator.num_samples=2",
            f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
            "checkpointing.enabled=false", f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        ])
    yield e
    e.close()


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_smollm2_grpo_step_on_cpu(exp):
    tok = exp.trainer.tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    # The policy is the converted GGUF: a real BPE vocabulary, ChatML, stops at the end of its turn.
    assert Path(exp.config.policy.model_name).parent.name == "pretrained"  # setup resolved gguf: to a folder
    assert len(tok) == 49152 and tok.eos_token == IM_END and tok.eos_token_id == im_end

    # Greedy generation of a short answer ends at <|im_end|> (a step's samples might all be cut off).
    datum = exp._datum("2+3=", "math", 0)
    flat = flatten_message_logs(rl_collate_fn([datum])["message_log"], tok.pad_token_id)
    out = exp.trainer.policy.generate(BatchedDataDict(input_ids=flat["input_ids"], input_lengths=flat["input_lengths"]),
                                      greedy=True)
    start, end = int(flat["input_lengths"][0]), int(out["unpadded_sequence_lengths"][0])
    ids = out["output_ids"][0, start:end].tolist()
    assert not bool(out["truncated"][0]) and ids[-1] == im_end and len(ids) < MAX_NEW
    text = tok.decode(ids, skip_special_tokens=True)
    print(f"greedy 2+3= -> {text!r}")
    assert "5" in text

    m = exp.step()
    batch = exp.trainer.last_batch
    assert m["train/num_samples"] == 4.0 and len(batch["message_log"]) == 4
    system = exp.config.data.train.system_prompt
    for i, log in enumerate(batch["message_log"]):
        first = next(j for j, msg in enumerate(log) if msg["role"] == "assistant")
        prompt = "".join(msg["content"] for msg in log[:first])
        problem = batch["extra_env_info"][i]["problem"]
        assert prompt == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nCalculate: {problem} End your "
                          "reply with: The final answer is \\boxed{answer}.<|im_end|>\n<|im_start|>assistant\n")
        gen = [msg for msg in log if msg["role"] == "assistant"]
        assert len(gen) == 1
        ids = gen[0]["token_ids"].tolist()
        assert 0 < len(ids) <= MAX_NEW
        if batch["truncated"][i]:
            assert len(ids) == MAX_NEW and im_end not in ids
        else:  # ended on purpose: at <|im_end|>, and only there
            assert ids[-1] == im_end and im_end not in ids[:-1]
    # Every sample graded by the math environment.
    rewards = batch["total_reward"]
    assert torch.isfinite(rewards).all() and set(rewards.tolist()) <= {0.0, 1.0}
    assert m["train/unscorable_frac"] == 0.0
    # Log-probs recomputed by the training pass agree with the sampler's (float32, same weights).
    assert m["train/prev_logprobs_reused"] == 0.0
    assert abs(m["train/token_mult_prob_error"] - 1.0) < 0.01
    assert math.isfinite(m["train/loss"])
