"""What a GRPO run reports: per-task metrics of a batch and the end-of-run accuracy summaries."""

from __future__ import annotations

from typing import Any

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.utils.stats import paired_change


def per_task_metrics(batch: BatchedDataDict, prefix: str) -> dict[str, float]:
    """`<prefix>/<task>/reward_mean`, `accuracy`, `turns_per_sample`, `truncation_rate` per task."""
    out: dict[str, float] = {}
    tasks = list(batch["task_name"])
    for task in sorted(set(tasks)):
        idx = torch.tensor([i for i, t in enumerate(tasks) if t == task])
        r = batch["total_reward"][idx].nan_to_num(0.0)
        out |= {f"{prefix}/{task}/reward_mean": float(r.mean()),
                f"{prefix}/{task}/accuracy": float((r >= 1.0).float().mean()),
                f"{prefix}/{task}/turns_per_sample": float(batch["num_turns"][idx].float().mean()),
                f"{prefix}/{task}/truncation_rate": float(batch["truncated"][idx].float().mean()),
                f"{prefix}/{task}/num_samples": float(len(idx))}
    return out


def accuracy_summary(trainer: Any) -> str:
    vals = [(h["step"], h["val/accuracy"]) for h in trainer.history if "val/accuracy" in h]
    if not vals:
        return "no validation was run"
    (s0, a0), (s1, a1) = vals[0], vals[-1]
    paired = _paired(trainer, None)
    return (f"held-out greedy accuracy: {a0:.1%} at step {s0} -> {a1:.1%} at step {s1} "
            f"({(a1 - a0) * 100:+.1f} points{'; ' + paired if paired else ''})")


def per_task_summary(trainer: Any) -> list[str]:
    """`<task>: first -> last` held-out accuracy per task (multi-task runs)."""
    lines = []
    keys = sorted({k for h in trainer.history for k in h if k.startswith("val/") and k.endswith("/accuracy")
                   and k.count("/") == 2})
    for key in keys:
        vals = [h[key] for h in trainer.history if key in h]
        task = key.split("/")[1]
        paired = _paired(trainer, task)
        lines.append(f"{task}: {vals[0]:.1%} -> {vals[-1]:.1%} ({(vals[-1] - vals[0]) * 100:+.1f} points"
                     f"{'; ' + paired if paired else ''})")
    return lines


def _paired(trainer: Any, task: str | None) -> str | None:
    """Problems gained and lost between the first and the latest validation (the same problems),
    with an exact McNemar p-value: how far a change is from what noise would give."""
    first, last = trainer.first_val_results, trainer.last_val_results
    if not first or not last or first is last or first["task_name"] != last["task_name"]:
        return None
    pick = [i for i, t in enumerate(first["task_name"]) if task is None or t == task]
    return paired_change([first["correct"][i] for i in pick], [last["correct"][i] for i in pick])
