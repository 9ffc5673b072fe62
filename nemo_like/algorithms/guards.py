"""What the GRPO step uses to keep its batch worth training on and to stop a run that has collapsed:
DAPO's dynamic sampling (keep only groups whose rewards differ) and the collapse watch.

A group whose G rewards are all equal gives every sample advantage 0: it costs a generation and a
training pass and teaches nothing. When most groups are like that for many steps in a row (the
model solves everything, fails everything, or only produces truncated junk), the run has stopped
learning; the most common way runs die in peers' issue trackers is exactly this, unnoticed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict

__all__ = ["groups_with_spread", "merge_rounds", "CollapseWatch", "inert_samples"]


def inert_samples(train_data: BatchedDataDict, loss_fn: Any) -> torch.Tensor:
    """[B] bool: samples that cannot move the weights this step, so the training pass may leave them
    out: no loss at all (``sample_mask`` 0, or no loss token), or, with a loss that says a zero
    advantage is inert (``zero_advantage_is_inert``; no KL penalty), advantage 0 on every loss
    token (a group whose rewards were all equal)."""
    mask = train_data["token_mask"].bool() & (train_data["sample_mask"][:, None] > 0)
    out = ~mask.any(dim=1)
    if getattr(loss_fn, "zero_advantage_is_inert", False):
        adv = train_data["advantages"]
        adv = adv[:, None].expand_as(mask) if adv.dim() == 1 else adv
        out |= ~((adv != 0) & mask).any(dim=1)
    return out


def groups_with_spread(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """[N] rewards in groups of G consecutive samples -> [N // G] bool: the group's scorable rewards
    are not all equal (at least two scorable samples with different rewards)."""
    r = rewards.view(-1, G)
    ok = torch.isfinite(r)
    hi = torch.where(ok, r, torch.full_like(r, -torch.inf)).amax(dim=1)
    lo = torch.where(ok, r, torch.full_like(r, torch.inf)).amin(dim=1)
    return (ok.sum(dim=1) >= 2) & (hi > lo)


def merge_rounds(rounds: list[tuple[BatchedDataDict, dict[str, float]]], keep: list[torch.Tensor], G: int,
                 num_groups: int) -> tuple[BatchedDataDict, torch.Tensor, dict[str, float]]:
    """The first ``num_groups`` kept groups of all rounds, in order; if fewer were kept, the batch is
    filled with dropped groups carrying ``loss_multiplier`` 0 (the batch keeps its shape, they train
    nothing). Returns (batch, group ids, metrics): counters of the rollouts summed over rounds,
    rates averaged, plus ``dynamic_sampling/*``."""
    chosen: list[tuple[int, int]] = [(r, g) for r, k in enumerate(keep) for g in k.nonzero().flatten().tolist()]
    fill = max(0, num_groups - len(chosen))
    dropped = [(r, g) for r, k in enumerate(keep) for g in (~k).nonzero().flatten().tolist()]
    fillers = set(dropped[:fill])
    picked = chosen[:num_groups] + dropped[:fill]
    parts = []
    for r, g in picked:
        part = rounds[r][0].slice(g * G, (g + 1) * G)
        if (r, g) in fillers:
            part = BatchedDataDict(part)
            part["loss_multiplier"] = torch.zeros_like(part["loss_multiplier"])
        parts.append(part)
    batch = BatchedDataDict.from_batches(parts)
    metrics: dict[str, float] = {}
    for _, m in rounds:
        for k, v in m.items():
            metrics.setdefault(k, []).append(v)  # type: ignore[arg-type]
    out: dict[str, float] = {}
    for k, vs in metrics.items():
        leaf = k.rsplit("/", 1)[-1]
        summed = leaf.startswith("num_") or leaf in ("step_errors", "step_timeouts", "generation_s", "reward_model")
        out[k] = float(sum(vs)) if summed else float(sum(vs) / len(vs))  # type: ignore[arg-type]
    generated = sum(len(k) for k in keep)
    out["dynamic_sampling/gen_batches"] = float(len(rounds))
    out["dynamic_sampling/kept_group_frac"] = len(chosen) / generated if generated else 0.0
    out["dynamic_sampling/filled_groups"] = float(fill)
    return batch, torch.arange(len(picked)).repeat_interleave(G), out


class CollapseWatch:
    """Counts consecutive steps showing a collapse signature; ``observe`` returns the reason once a
    signature lasted ``patience`` steps, else None. Its state (counters, the best gold) is saved in
    checkpoints.

    - generation collapse: truncation rate >= ``truncation_rate`` and mean reward <= ``reward_floor``
      (the model only produces junk that runs to the length cap);
    - advantage collapse: the fraction of groups with equal rewards >= ``zero_std_group_frac``
      (nothing left that gives a gradient);
    - reward hacking (with a reward model): the environments' reward (the gold, ``rm/env_reward_mean``)
      at most ``gold_drop`` of its best so far while the reward model's score (``rm/score_mean``) is
      above its value at that best: the policy learns what the reward model likes, not the task.
    """

    SIGNATURES = ("generation_collapse", "advantage_collapse", "reward_hacking")

    def __init__(self, config: Any) -> None:
        self.config = config
        self.counts = dict.fromkeys(self.SIGNATURES, 0)
        self.best_gold: tuple[float, float, int] | None = None  # (gold, score then, step)

    def _hacking(self, metrics: dict[str, float], step: int) -> bool:
        gold, score = metrics.get("rm/env_reward_mean"), metrics.get("rm/score_mean")
        if self.config.gold_drop is None or gold is None or score is None or not (
                math.isfinite(gold) and math.isfinite(score)):
            return False
        if self.best_gold is None or gold > self.best_gold[0]:
            self.best_gold = (gold, score, step)
            return False
        best, score_then, _ = self.best_gold
        return best > 0 and gold <= self.config.gold_drop * best and score > score_then

    def observe(self, metrics: dict[str, float], step: int) -> str | None:
        c = self.config
        if not c.enabled:
            return None
        seen = {
            "generation_collapse": metrics.get("train/truncation_rate", 0.0) >= c.truncation_rate
            and metrics.get("train/reward_mean", 0.0) <= c.reward_floor,
            "advantage_collapse": metrics.get("train/zero_std_group_frac", 0.0) >= c.zero_std_group_frac,
            "reward_hacking": self._hacking(metrics, step),
        }
        for sig, hit in seen.items():
            self.counts[sig] = self.counts[sig] + 1 if hit else 0
        for sig in self.SIGNATURES:
            if self.counts[sig] >= c.patience:
                if sig == "generation_collapse":
                    why = (f"truncation rate {metrics.get('train/truncation_rate', 0.0):.2f} >= {c.truncation_rate} "
                           f"and mean reward {metrics.get('train/reward_mean', 0.0):.3f} <= {c.reward_floor}")
                elif sig == "advantage_collapse":
                    why = (f"{metrics.get('train/zero_std_group_frac', 0.0):.2f} of groups have equal rewards "
                           f"(>= {c.zero_std_group_frac})")
                else:
                    best, score_then, best_step = self.best_gold
                    why = (f"the environments' reward (rm/env_reward_mean) is {metrics['rm/env_reward_mean']:.3f}, "
                           f"at most {c.gold_drop} of its best {best:.3f} (step {best_step}), while the reward "
                           f"model's score (rm/score_mean) rose from {score_then:.3f} to {metrics['rm/score_mean']:.3f}")
                return (f"{sig} at step {step}: {why} for {self.counts[sig]} consecutive steps "
                        f"(grpo.stop_on_collapse.patience={c.patience}"
                        + (f", gold_drop={c.gold_drop}; null turns this check off)" if sig == "reward_hacking" else ")"))
        return None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.counts) | {"best_gold": list(self.best_gold) if self.best_gold is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {sig: int(state.get(sig, 0)) for sig in self.SIGNATURES}
        best = state.get("best_gold")  # absent in checkpoints from before the reward-hacking watch
        self.best_gold = (float(best[0]), float(best[1]), int(best[2])) if best is not None else None
