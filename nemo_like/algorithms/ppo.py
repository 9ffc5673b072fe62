"""The PPO parts of a GRPO step (driver side): what an advantage estimator declared it needs (a
critic's values, token-level rewards, a greedy baseline), the KL penalty folded into the reward with
a fixed or adaptive coefficient, the critic's update, and the critic warm-up.

The step (``GRPOTrainer.step``) stays in ``grpo.py``; this holds the arithmetic it calls, so that a
run without a critic or a KL-in-reward pays nothing: ``PPOStage.active`` is False and the step takes
the GRPO path unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_like.algorithms.advantages import estimator_needs, get_advantage_estimator
from nemo_like.algorithms.ppo_terms import (
    explained_variance,
    kl_per_token,
    make_kl_controller,
    masked_mean,
    token_level_rewards,
)
from nemo_like.distributed.batched_data_dict import BatchedDataDict

__all__ = ["PPOStage"]


class PPOStage:
    """A run's critic (a ``Critic`` facade, or None) and KL-in-reward controller, and the step's PPO
    arithmetic."""

    def __init__(self, config: Any, critic: Any | None = None):
        self.config = config
        self.critic = critic
        self.needs = estimator_needs(config.grpo.advantage_estimator)
        k = config.grpo.kl_in_reward
        self.kl_ctl = make_kl_controller(k.controller, k.init_coef, k.target_kl, k.horizon) if k.enabled else None

    @property
    def active(self) -> bool:
        return bool(self.needs) or self.kl_ctl is not None

    @property
    def needs_reference(self) -> bool:
        return self.kl_ctl is not None

    @property
    def needs_greedy(self) -> bool:
        return "greedy_rewards" in self.needs

    def in_warmup(self, step_count: int) -> bool:
        """The first ``critic.warmup_steps`` steps train the critic only: no actor update, no refit."""
        return self.critic is not None and step_count < self.config.critic.warmup_steps

    # ---- advantages ---------------------------------------------------------------------------------
    def advantages(self, train_data: BatchedDataDict, rewards: torch.Tensor, group_ids: torch.Tensor,
                   timer: Any, greedy_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The estimator's advantages ([N] or [N, T]) over the scorable samples (0 for the others), and
        ``extras``: ``mask`` (the response tokens that count), ``values``/``returns`` when a critic is
        used, and the metrics of this stage (``metrics``)."""
        cfg = self.config
        scorable = torch.isfinite(rewards)
        mask = train_data["token_mask"].float() * train_data["sample_mask"].float()[:, None] * scorable.float()[:, None]
        extras: dict[str, Any] = {"mask": mask, "metrics": {}}
        inputs: dict[str, torch.Tensor] = {}
        if "values" in self.needs:
            with timer.time("compute_values"):
                values = self.critic.compute_values(self._rows(train_data))["values"].float()
            if not bool(torch.isfinite(values[mask > 0]).all()):
                raise RuntimeError("critic: non-finite values on response tokens; the critic has diverged (lower "
                                   "critic.optimizer.lr, set critic.max_grad_norm) or its checkpoint is damaged")
            inputs["values"] = extras["values"] = values
        scores = rewards.nan_to_num(0.0).float()
        if "token_rewards" in self.needs or self.kl_ctl is not None:
            kl = None
            coef = 0.0
            if self.kl_ctl is not None:
                # The old policy's log-probs (the sampler's when the batch is trained as its own proximal policy).
                lp = train_data["prev_logprobs"] if "prev_logprobs" in train_data else train_data["generation_logprobs"]
                kl = kl_per_token(lp, train_data["reference_policy_logprobs"], cfg.grpo.kl_in_reward.estimator)
                kl = torch.where(mask > 0, kl, torch.zeros_like(kl))  # padding never enters the measured KL
                rows = mask.sum(-1) > 0
                per_sample = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
                measured = float(per_sample[rows].mean()) if bool(rows.any()) else 0.0
                coef = self.kl_ctl.coef  # the coefficient before this batch's update is the one applied
                extras["metrics"] |= {"kl_in_reward/coef": coef, "kl_in_reward/kl": measured}
            token_rewards = token_level_rewards(scores, mask, kl, coef)
            if "token_rewards" in self.needs:
                inputs["token_rewards"] = token_rewards
            else:  # a sequence-level estimator sees each sample's reward minus its summed KL penalty
                scores = token_rewards.sum(-1)
            if self.kl_ctl is not None:
                self.kl_ctl.update(measured, int(scorable.sum()))
        if self.needs_greedy:
            if greedy_rewards is None:
                raise ValueError(f"grpo.advantage_estimator={cfg.grpo.advantage_estimator!r} needs greedy_rewards")
            inputs["greedy_rewards"] = greedy_rewards.nan_to_num(0.0).float()

        estimator = get_advantage_estimator(cfg.grpo.advantage_estimator)
        advantages = torch.zeros_like(scores)  # [N], or [N, T] when the estimator is token-level
        if bool(scorable.any()):
            out = estimator(scores[scorable], group_ids[scorable], config=cfg.grpo, token_mask=mask[scorable],
                            **{k: v[scorable] for k, v in inputs.items()})
            adv, more = out if isinstance(out, tuple) else (out, {})
            if adv.dim() == 2:
                advantages = torch.zeros_like(mask)
            advantages[scorable] = adv.to(advantages.dtype)
            if "returns" in more:
                returns = torch.zeros_like(mask)
                returns[scorable] = more["returns"].float()
                extras["returns"] = returns
        return advantages, extras

    # ---- the critic -----------------------------------------------------------------------------------
    @staticmethod
    def _rows(train_data: BatchedDataDict) -> BatchedDataDict:
        # token_mask: critic packing lays a prompt's samples after one copy of it (as the policy's does).
        return BatchedDataDict({k: train_data[k] for k in ("input_ids", "input_lengths", "token_mask")})

    def update_critic(self, train_data: BatchedDataDict, extras: dict[str, Any], timer: Any) -> dict[str, float]:
        """One critic update on the step's returns; ``critic/`` metrics (explained variance of the
        values it was given, before the update)."""
        values, returns, mask = extras["values"], extras["returns"], extras["mask"]
        data = self._rows(train_data)
        data["token_mask"], data["values"], data["returns"] = mask, values, returns
        gbs = self.config.critic.train_global_batch_size or self.config.policy.train_global_batch_size
        with timer.time("update_critic"):
            m = self.critic.train(data, global_batch_size=gbs)
        loss = m.get("value_loss", float("nan"))
        if not math.isfinite(loss):
            raise RuntimeError(f"critic: non-finite value loss ({loss}); lower critic.optimizer.lr or set "
                               "critic.max_grad_norm")
        out = {f"critic/{k}": float(v) for k, v in m.items()}
        out |= {"critic/vf_explained_var": explained_variance(values, returns, mask),
                "critic/values_mean": float(masked_mean(values, mask)),
                "critic/returns_mean": float(masked_mean(returns, mask))}
        return out

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict() if self.kl_ctl is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and self.kl_ctl is not None and state.get("kl_ctl") is not None:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
