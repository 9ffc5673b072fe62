"""A reward model's score joins the environments' rewards: conversations rendered again with the
reward model's own tokenizer and template, env reward + task weight x score, unscorable stays so."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from nemo_like.algorithms.rm_reward import RewardModelScorer
from nemo_like.config_sections import RewardModelRewardConfig
from nemo_like.data.processors import render_chat
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.reward_model import LastTokenScore, RewardModel, RewardModelConfig, load_reward_model


def _log(q: str, a: str, tool: str | None = None) -> list[dict]:
    log = [{"role": "user", "content": q, "token_ids": torch.tensor([1])},
           {"role": "assistant", "content": a, "token_ids": torch.tensor([2])}]
    if tool:
        log += [{"role": "tool", "content": tool, "token_ids": torch.tensor([3])},
                {"role": "assistant", "content": "done", "token_ids": torch.tensor([4])}]
    return log


def test_score_is_added_with_task_weights_and_nan_stays(ray_session, model_dir, tmp_path):
    rm_dir = str(tmp_path / "rm")  # a reward model folder: its head is saved, not drawn anew
    load_reward_model(model_dir).save_pretrained(rm_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.save_pretrained(rm_dir)
    cfg = RewardModelRewardConfig(model_name=rm_dir, weight=0.5, task_weights={"code": 2.0}, max_length=30)
    cluster = RayVirtualCluster(1, cpus_per_worker=1)
    rm = RewardModel(cluster, RewardModelConfig(model_name=rm_dir, train_global_batch_size=1,
                                                train_micro_batch_size=1), seed=0)
    try:
        batch = BatchedDataDict(message_log=[_log("1+2=", "3"), _log("run it", "print(1)", tool="1"),
                                             _log("9+9=", "a very long answer " * 4)],
                                total_reward=torch.tensor([1.0, 0.0, float("nan")]),
                                task_name=["math", "code", "math"])
        out, m = RewardModelScorer(cfg, rm, tok).apply(batch)
        # env_weight 0: the reward model alone (the environments' reward still logged).
        out2, m2 = RewardModelScorer(cfg.model_copy(update={"env_weight": 0.0}), rm, tok).apply(BatchedDataDict(
            message_log=batch["message_log"], task_name=batch["task_name"],
            total_reward=torch.tensor([1.0, 0.0, float("nan")])))
    finally:
        rm.shutdown()
        cluster.shutdown()
    # The scores the reward model gives the conversations rendered by its own template, the last 30 tokens.
    hf = LastTokenScore(load_reward_model(rm_dir)).eval()
    seqs = [tok(render_chat(tok, [{"role": x["role"], "content": x["content"]} for x in log], False),
                add_special_tokens=False)["input_ids"][-30:] for log in batch["message_log"]]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([s]), torch.tensor([len(s)]))[0] for s in seqs])
    assert len(seqs[2]) == 30  # the long one was cut to its end
    assert torch.allclose(out["rm_score"], want, atol=1e-5)
    assert torch.allclose(out["total_reward"][:2], torch.tensor([1.0 + 0.5 * want[0], 0.0 + 2.0 * want[1]]), atol=1e-5)
    assert math.isnan(float(out["total_reward"][2])) and math.isnan(float(out["env_reward"][2]))
    assert m["rm/score_mean"] == pytest.approx(float(want.mean()), abs=1e-5)
    assert m["rm/env_reward_mean"] == pytest.approx(0.5) and m["timing/reward_model"] > 0
    assert torch.allclose(out2["total_reward"][:2], torch.tensor([0.5 * want[0], 2.0 * want[1]]), atol=1e-6)
    assert math.isnan(float(out2["total_reward"][2])) and m2["rm/env_reward_mean"] == pytest.approx(0.5)
