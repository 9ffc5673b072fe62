"""Trajectory-level policy gradient (REINFORCE on whole trajectories), registered as ``trajectory_pg``.

The loss of trajectory-level GRPO for agents on step environments (trackmania_rl's GRPO learner):
each trajectory ``i`` has one advantage ``A_i`` (its return against its group's), and its log-
likelihood is the sum of its per-step log-probs, ``log pi(tau_i) = sum_t log pi(a_t | s_t)``:

    loss = -mean_i A_i log pi(tau_i) - ent_coef * mean_t H_t + ref_kl_coef * mean_t (log pi - log pi_ref)

It has the worker-facing contract of every registered loss (``loss_fn(curr_logprobs, data,
global_valid_seqs, global_valid_toks) -> (loss, metrics)``), so a language-model run can select it
too (tokens are its steps; ``advantages`` may be per token ``[B, T]``, and then the policy term is
``-sum_t A_t log pi_t``, equal to the above when A is constant along a sequence).

The value term of an agent whose value head is trained (``grpo.advantage_estimator: gae``) is
:func:`value_loss_term`: ``vf_coef * clipped_value_loss(V_new, V_old, returns, mask, cliprange_value)``,
added by the gym trainer to whichever policy loss ``loss_fn.name`` picks, in the same backward pass
(as SB3's PPO sums its policy and value losses; here the two heads also share the network's trunk). Its keys (``loss_fn.vf_coef``,
``loss_fn.cliprange_value``) are not the policy loss's options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_like.algorithms.loss_functions import _effective_mask, _get, _global_normalise
from nemo_like.algorithms.pg_terms import check_2d, num_valid_seqs, token_sum
from nemo_like.algorithms.ppo_terms import clipped_value_loss

__all__ = ["VALUE_LOSS_KEYS", "TrajectoryPGLossConfig", "TrajectoryPGLossFn", "ValueLossConfig", "value_loss_term"]


class ValueLossConfig(BaseModel):
    """``loss_fn.vf_coef`` and ``loss_fn.cliprange_value`` of a gym run with ``grpo.advantage_estimator: gae``.

    ``cliprange_value`` defaults to None (no clipping), as SB3's PPO (``clip_range_vf=None``) and the
    zoo's tuned CartPole do: the targets are unnormalised discounted returns (up to ~1/(1-gamma), 50 on
    CartPole at gamma 0.98), and a clip of 0.2 around the pre-update values would let the value move at
    most 0.2 per update, so the critic would lag the returns for hundreds of updates. Set it for a
    reward scale near 1."""

    model_config = ConfigDict(extra="forbid")

    vf_coef: float = Field(0.5, ge=0, allow_inf_nan=False)
    cliprange_value: float | None = Field(None, ge=0, allow_inf_nan=False)


VALUE_LOSS_KEYS = tuple(ValueLossConfig.model_fields)


def value_loss_term(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                    config: ValueLossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """``vf_coef * clipped_value_loss(...)`` (differentiable w.r.t. ``values``; all [B, T], the mean over
    the mask's steps) and its metrics ``value_loss`` (before ``vf_coef``) and ``vf_clipfrac``. The
    per-step terms are the critic worker's (:func:`~nemo_like.algorithms.ppo_terms.clipped_value_loss_terms`),
    so the same inputs give the same numbers in both trainers."""
    loss, clipfrac = clipped_value_loss(values, old_values, returns, mask, cliprange_value=config.cliprange_value)
    return config.vf_coef * loss, {"value_loss": float(loss.detach()), "vf_clipfrac": float(clipfrac)}


class TrajectoryPGLossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "trajectory_pg"
    ent_coef: float = Field(0.0, ge=0)
    ref_kl_coef: float = Field(0.0, ge=0)


def _resolve(config: Any) -> TrajectoryPGLossConfig:
    if config is None:
        return TrajectoryPGLossConfig()
    if isinstance(config, TrajectoryPGLossConfig):
        return config
    if isinstance(config, Mapping):
        try:
            return TrajectoryPGLossConfig.model_validate(dict(config))
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                raise ValueError(f"trajectory_pg has no option {key!r} (it takes ent_coef, ref_kl_coef)") from None
            raise ValueError(f"trajectory_pg option {key!r}: {err['msg']} (got {err.get('input')!r})") from None
    # Another loss's config (a language-model run's loss_fn section): read what applies, by name.
    return TrajectoryPGLossConfig(
        ent_coef=float(getattr(config, "ent_coef", 0.0)),
        ref_kl_coef=float(getattr(config, "ref_kl_coef", getattr(config, "reference_policy_kl_penalty", 0.0))),
    )


class TrajectoryPGLossFn:
    """``curr_logprobs`` [B, T] (a trajectory's per-step log-probs under the live weights, padded);
    ``data``: ``advantages`` [B] or [B, T], ``token_mask`` [B, T] (1 on real steps), optional
    ``sample_mask`` [B], ``entropy`` [B, T] (needed when ent_coef > 0; it carries the gradient) and
    ``reference_policy_logprobs`` [B, T] (needed when ref_kl_coef > 0).

    Normalised by the global counts (``global_valid_seqs`` trajectories, ``global_valid_toks``
    steps), so micro-batch losses sum to the batch's. Metrics: ``pg_loss``, ``entropy``, ``ref_kl``
    (means over valid steps), ``traj_logprob_mean``, ``loss``, ``num_valid_seqs``, ``num_valid_tokens``.
    """

    loss_type = "sequence"

    def __init__(self, config: Any = None) -> None:
        self.config = _resolve(config)

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_2d("curr_logprobs", curr_logprobs, None)
        mask = _effective_mask(curr_logprobs, data)
        (adv,) = _get(data, ("advantages",))
        adv = adv.to(device=curr_logprobs.device, dtype=curr_logprobs.dtype)
        if adv.dim() == 1:
            if adv.shape[0] != curr_logprobs.shape[0]:
                raise ValueError(f"data['advantages'] has {adv.shape[0]} entries for {curr_logprobs.shape[0]} sequences")
            adv = adv[:, None]
        else:
            check_2d("data['advantages']", adv, curr_logprobs.shape)
        # Off-mask advantages may be anything (a padded step, a masked-out sample): never NaN * 0.
        adv = torch.where(mask != 0, adv.expand_as(curr_logprobs), torch.zeros((), dtype=adv.dtype))
        num_seqs, num_toks = num_valid_seqs(mask), float(mask.sum())
        # Padding may hold anything (even -inf): where() keeps it out of the sum and of the gradient.
        curr = torch.where(mask != 0, curr_logprobs, torch.zeros_like(curr_logprobs))
        pg_total = token_sum(-adv * curr, mask)
        loss = _global_normalise(pg_total, num_seqs, global_valid_seqs, "global_valid_seqs")
        metrics = {"pg_loss": float(loss.detach()),
                   "traj_logprob_mean": float(token_sum(curr.detach(), mask)) / num_seqs if num_seqs else 0.0}
        cfg = self.config
        if cfg.ent_coef > 0 or "entropy" in data:
            (entropy,) = _get(data, ("entropy",))
            check_2d("data['entropy']", entropy, curr_logprobs.shape)
            ent = _global_normalise(token_sum(torch.where(mask != 0, entropy, 0.0), mask), num_toks,
                                    global_valid_toks, "global_valid_toks")
            loss = loss - cfg.ent_coef * ent
            metrics["entropy"] = float(ent.detach()) * float(global_valid_toks) / num_toks if num_toks else 0.0
        if cfg.ref_kl_coef > 0:
            (ref,) = _get(data, ("reference_policy_logprobs",))
            check_2d("data['reference_policy_logprobs']", ref, curr_logprobs.shape)
            diff = torch.where(mask != 0, curr - ref.to(curr.dtype), 0.0)
            kl = _global_normalise(token_sum(diff, mask), num_toks, global_valid_toks, "global_valid_toks")
            loss = loss + cfg.ref_kl_coef * kl
            metrics["ref_kl"] = float(kl.detach()) * float(global_valid_toks) / num_toks if num_toks else 0.0
        metrics.update(loss=float(loss.detach()), num_valid_seqs=num_seqs, num_valid_tokens=num_toks)
        return loss, metrics
