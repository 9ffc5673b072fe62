"""What a GRPO run reports: per-task metrics of a batch and the end-of-run accuracy summaries."""

from __future__ import annotations

from typing import Any

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.utils.perf import throughput_metrics
from nemo_like.utils.stats import paired_change


def per_task_metrics(batch: BatchedDataDict, prefix: str, threshold: float = 1.0) -> dict[str, float]:
    """`<prefix>/<task>/reward_mean`, `accuracy` (share of rewards >= ``threshold``, grpo.success_threshold),
    `turns_per_sample`, `truncation_rate` per task."""
    out: dict[str, float] = {}
    tasks = list(batch["task_name"])
    for task in sorted(set(tasks)):
        idx = torch.tensor([i for i, t in enumerate(tasks) if t == task])
        r = batch["total_reward"][idx].nan_to_num(0.0)
        out |= {f"{prefix}/{task}/reward_mean": float(r.mean()),
                f"{prefix}/{task}/accuracy": float((r >= threshold).float().mean()),
                f"{prefix}/{task}/turns_per_sample": float(batch["num_turns"][idx].float().mean()),
                f"{prefix}/{task}/truncation_rate": float(batch["truncated"][idx].float().mean()),
                f"{prefix}/{task}/num_samples": float(len(idx))}
    return out


def step_metrics(cfg: Any, batch: BatchedDataDict, train_data: BatchedDataDict, rewards: torch.Tensor,
                 advantages: torch.Tensor, rollout_metrics: dict[str, float], timings: dict[str, float], *,
                 train_metrics: dict[str, float], pass_metrics: dict[str, float], ppo_metrics: dict[str, float],
                 refit_metrics: dict[str, float], async_metrics: dict[str, float], epoch: int, warmup: bool,
                 reused: bool, lag: torch.Tensor | None, logprob_eff: float | None) -> dict[str, float]:
    """A GRPO step's metrics (docs/reference/metrics.md), from what the step's phases produced."""
    G, threshold = cfg.grpo.num_generations_per_prompt, cfg.grpo.success_threshold
    scorable = torch.isfinite(rewards)
    scored = rewards[scorable]
    grouped = rewards.nan_to_num(0.0).view(-1, G)
    metrics = {
        "train/reward_mean": float(scored.mean()) if scored.numel() else 0.0,
        "train/reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
        "train/accuracy": float((scored >= threshold).float().mean()) if scored.numel() else 0.0,
        # "advantage collapse": groups whose rewards are all equal give no gradient.
        "train/zero_std_group_frac": float((grouped.std(dim=1) == 0).float().mean()),
        "train/unscorable_frac": float((~scorable).float().mean()),
        "train/advantage_abs_mean": float(advantages.abs().mean() if advantages.dim() == 1 else
                                          advantages.abs().sum() / train_data["token_mask"].sum().clamp(min=1)),
        "train/loss_masked_frac": float((train_data["sample_mask"] == 0).float().mean()),
        # Prompts longer than data.max_input_seq_length: cut, and carry no loss.
        "train/prompt_cut_frac": float((batch["loss_multiplier"] == 0).float().mean()),
        "train/num_samples": float(rewards.numel()),
        "train/epoch": float(epoch),
    }
    metrics |= {(k if k.startswith(("rm/", "timing/")) else f"train/{k}"): v  # generation_s: timing/generation
                for k, v in rollout_metrics.items() if k != "generation_s"}
    if len(set(batch["task_name"])) > 1:
        metrics |= per_task_metrics(batch, "train", threshold)
    metrics |= {f"train/{k}": v for k, v in train_metrics.items()} | pass_metrics | ppo_metrics
    if warmup:
        metrics["critic/warmup"] = 1.0
    if logprob_eff is not None:
        metrics["train/logprob_padding_efficiency"] = logprob_eff
    timings = timings | {"generation": rollout_metrics.get("generation_s", 0.0)}
    metrics |= {f"timing/{k}": v for k, v in timings.items()}
    metrics |= throughput_metrics(timings, train_data, batch, train_metrics, cfg.grpo.ppo_epochs)
    metrics["train/prev_logprobs_reused"] = float(reused)
    if "skip_pass" in train_data:
        metrics["train/skipped_inert_frac"] = float(train_data["skip_pass"].float().mean())
    if lag is not None:
        metrics["train/policy_version_lag"] = float(lag.float().mean())
    metrics |= {k: v for k, v in refit_metrics.items() if not k.startswith("timing/")} | async_metrics
    if async_metrics:  # the trainer's share of the step: what it did not spend waiting for rollouts
        metrics["async/training_busy_frac"] = 1.0 - timings.get("wait_for_rollouts", 0.0) / max(timings["total"], 1e-9)
    return metrics


def success_hint(rewards: torch.Tensor, threshold: float) -> str | None:
    """A line for a first validation in which no reward reached the success threshold although some
    were positive: rewards on another scale (a [0, 1) score) would read as 0% accuracy for the whole run."""
    r = rewards[torch.isfinite(rewards)]
    if not r.numel() or bool((r >= threshold).any()) or float(r.max()) <= 0:
        return None
    return (f"[nemo_like] val/accuracy counts rewards >= grpo.success_threshold={threshold:g}, and no held-out "
            f"reward reached it (best {float(r.max()):.3g}, mean {float(r.mean()):.3g}): for rewards on another "
            "scale set grpo.success_threshold (val/reward_mean is logged beside it)")


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
