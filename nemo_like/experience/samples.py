"""Samples as a person reads them: one row per sample of a rollout batch (task, problem, prompt,
completion, reward, ground truth...), for the notebook's ``samples()`` table and the logger's
``samples.jsonl``. Reading what a run generates is how reward hacking and formatting drift are seen."""

from __future__ import annotations

import math
from typing import Any


def sample_rows(batch: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """Up to ``limit`` rows (None: all) of a rolled-out batch, in its order. The prompt is every message
    before the first assistant turn; the completion is the rest, other roles' turns marked
    ``[role]``. ``advantage`` only where the batch has one (training batches; per-token advantages as
    their mean over the tokens that carry one); an unscorable sample's reward is None (NaN in the batch)."""
    n = len(batch["message_log"]) if limit is None else min(limit, len(batch["message_log"]))
    rows = []
    for i in range(n):
        log = batch["message_log"][i]
        first = next((j for j, m in enumerate(log) if m["role"] == "assistant"), len(log))
        info = batch["extra_env_info"][i] or {}
        reward = float(batch["total_reward"][i])
        row = {
            "task": batch["task_name"][i],
            "problem": info.get("problem"),
            "prompt": "".join(m["content"] for m in log[:first]),
            "completion": "\n".join(m["content"] if m["role"] == "assistant" else f"[{m['role']}] {m['content']}"
                                    for m in log[first:]),
            "reward": None if math.isnan(reward) else reward,
        }
        if "advantages" in batch:
            adv = batch["advantages"][i]
            if adv.dim():  # per token (GAE): the mean over the tokens that carry one
                carried = adv[adv != 0]
                adv = carried.mean() if carried.numel() else adv.new_zeros(())
            row["advantage"] = float(adv)
        row |= {"ground_truth": info.get("ground_truth"), "turns": int(batch["num_turns"][i]),
                "truncated": bool(batch["truncated"][i])}
        error = batch["grading_error"][i] if "grading_error" in batch else None
        if error is not None:  # why an unscorable sample has no reward (a grader's or an agent's failure)
            row["error"] = str(error)
        rows.append(row)
    return rows
