"""A reward model's score added to the environments' rewards of GRPO's training samples.

The conversation of each sample (its messages' text, the environments' turns included) is rendered
again with the reward model's own tokenizer and chat template, so a reward model with another
vocabulary than the policy's reads what it was trained on (verl does the same when the tokenizers
differ). A sample's reward becomes env_weight x env reward + w x score, w the task's weight; a
sample no environment could score (NaN) stays unscorable.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nemo_like.config_sections import RewardModelRewardConfig
from nemo_like.data.processors import render_chat, tokenize_text
from nemo_like.distributed.batched_data_dict import BatchedDataDict


class RewardModelScorer:
    def __init__(self, config: RewardModelRewardConfig, reward_model: Any, tokenizer: Any):
        self.cfg, self.rm, self.tokenizer = config, reward_model, tokenizer

    def rows(self, message_logs: list[list[dict[str, Any]]]) -> BatchedDataDict:
        """``input_ids`` / ``input_lengths`` of the conversations as the reward model reads them."""
        seqs = []
        for log in message_logs:
            messages = [{"role": m["role"], "content": m["content"]} for m in log]
            ids = tokenize_text(self.tokenizer, render_chat(self.tokenizer, messages, add_generation_prompt=False))
            seqs.append(ids[-self.cfg.max_length:])  # the score is read at the end: keep the end
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(s) for s in seqs]))

    def weights(self, task_names: list[str]) -> torch.Tensor:
        return torch.tensor([self.cfg.task_weights.get(t, self.cfg.weight) for t in task_names])

    def apply(self, batch: BatchedDataDict) -> tuple[BatchedDataDict, dict[str, float]]:
        """``batch`` with ``total_reward`` += weight x score (``env_reward`` keeps the environments'),
        and the metrics ``rm/score_mean``, ``rm/score_std``, ``rm/env_reward_mean``, ``timing/reward_model``."""
        t0 = time.perf_counter()
        scores = self.rm.score(self.rows(batch["message_log"])).float()
        env = batch["total_reward"].float()
        batch["env_reward"] = env.clone()
        batch["rm_score"] = scores
        # NaN (unscorable) stays NaN even with env_weight 0: nothing is known of that sample.
        batch["total_reward"] = torch.where(torch.isfinite(env), self.cfg.env_weight * env, env) + \
            self.weights(list(batch["task_name"])) * scores
        scored = torch.isfinite(env)
        metrics = {"rm/score_mean": float(scores.mean()), "rm/score_std": float(scores.std()) if len(scores) > 1 else 0.0,
                   "rm/env_reward_mean": float(env[scored].mean()) if bool(scored.any()) else float("nan"),
                   "timing/reward_model": time.perf_counter() - t0}
        return batch, metrics
