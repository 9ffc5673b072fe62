"""Rollouts: turn prompts (message logs) into completed, graded episodes.

Single-turn generation is the one-turn case; environments are Ray actors reached by task name.
"""

from __future__ import annotations

import copy
from typing import Any

import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.interfaces import EnvironmentReturn
from nemo_like.models.generation.interfaces import GenerationInterface


def flatten_message_logs(message_logs: list[list[dict]], pad_id: int) -> BatchedDataDict:
    """Concatenate each sample's messages into one row: input_ids, input_lengths, token_mask
    (1 on assistant tokens) and generation_logprobs (the sampler's log-probs, 0 elsewhere)."""
    rows, masks, glps = [], [], []
    for log in message_logs:
        ids = [m["token_ids"] for m in log]
        rows.append(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long))
        masks.append(torch.cat([torch.full_like(m["token_ids"], int(m["role"] == "assistant" and m.get("loss", True)))
                                for m in log]) if log else torch.zeros(0, dtype=torch.long))
        glps.append(torch.cat([m.get("generation_logprobs", torch.zeros(len(m["token_ids"])))
                               for m in log]).float() if log else torch.zeros(0))
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(int(lengths.max()) if len(rows) else 0, 1)
    out_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    out_mask = torch.zeros((len(rows), width), dtype=torch.long)
    out_glp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m, g) in enumerate(zip(rows, masks, glps)):
        out_ids[i, : len(r)], out_mask[i, : len(r)], out_glp[i, : len(r)] = r, m, g
    return BatchedDataDict(input_ids=out_ids, input_lengths=lengths, token_mask=out_mask,
                           generation_logprobs=out_glp)


def calculate_rewards(message_logs: list[list[dict]], task_names: list[str], env_infos: list[dict],
                      envs: dict[str, Any]) -> tuple[torch.Tensor, list[EnvironmentReturn | None], dict[str, float]]:
    """Group samples by task, send each group to its environment actor in one call, and put the
    results back in batch order. An environment that fails scores its samples 0 (counted)."""
    n = len(message_logs)
    rewards = torch.zeros(n, dtype=torch.float32)
    returns: list[EnvironmentReturn | None] = [None] * n
    metrics: dict[str, float] = {}
    by_task: dict[str, list[int]] = {}
    for i, t in enumerate(task_names):
        by_task.setdefault(t, []).append(i)
    futures = {}
    for task, idx in by_task.items():
        if task not in envs:
            raise KeyError(f"no environment for task {task!r}; configured: {sorted(envs)}")
        futures[task] = envs[task].step.remote([message_logs[i] for i in idx], [env_infos[i] for i in idx])
    for task, fut in futures.items():
        idx = by_task[task]
        try:
            ret: EnvironmentReturn = ray.get(fut)
        except Exception as e:  # a crashed grader must not end the run
            metrics[f"env/{task}/step_errors"] = metrics.get(f"env/{task}/step_errors", 0.0) + len(idx)
            print(f"[nemo_like] environment {task!r} failed on {len(idx)} samples, scored 0: {e!r}")
            continue
        for j, i in enumerate(idx):
            rewards[i] = float(ret.rewards[j])
            returns[i] = EnvironmentReturn([ret.observations[j]], [ret.metadata[j]], [ret.next_stop_strings[j]],
                                           ret.rewards[j : j + 1], ret.terminateds[j : j + 1], {})
        for k, v in (ret.metrics or {}).items():
            metrics[f"env/{task}/{k}"] = float(v)
    return rewards, returns, metrics


def run_single_turn_rollout(policy: GenerationInterface, batch: BatchedDataDict, tokenizer, envs: dict[str, Any],
                            *, greedy: bool = False) -> tuple[BatchedDataDict, dict[str, float]]:
    """Generate one assistant turn per sample, append it to the message log, grade it.

    Returns the batch with updated `message_log`, `total_reward` [B], `truncated` [B] and metrics."""
    message_logs = [copy.copy(log) for log in batch["message_log"]]
    flat = flatten_message_logs(message_logs, tokenizer.pad_token_id)
    gen = policy.generate(BatchedDataDict(input_ids=flat["input_ids"], input_lengths=flat["input_lengths"]),
                          greedy=greedy)
    for i, log in enumerate(message_logs):
        start = int(flat["input_lengths"][i])
        end = int(gen["unpadded_sequence_lengths"][i])
        ids = gen["output_ids"][i, start:end].clone()
        log.append({"role": "assistant", "content": tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                    "token_ids": ids, "generation_logprobs": gen["logprobs"][i, start:end].clone()})
    rewards, _, env_metrics = calculate_rewards(message_logs, list(batch["task_name"]), list(batch["extra_env_info"]),
                                                envs)
    out = BatchedDataDict(batch)
    out["message_log"] = message_logs
    out["total_reward"] = rewards
    out["truncated"] = gen["truncated"].bool()
    out["generation_lengths"] = gen["generation_lengths"]
    metrics = {
        "response_length_mean": float(gen["generation_lengths"].float().mean()),
        "truncation_rate": float(gen["truncated"].float().mean()),
    } | env_metrics
    return out, metrics
