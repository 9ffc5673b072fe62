"""DPO's loss as two halves: the exact loss and per-sequence weights on the driver, and a weighted
log-likelihood surrogate on the workers whose gradient is DPO's.

Why split it: the policy worker cuts a global batch into micro-batches by length (or packs rows), so
the chosen and the rejected side of a pair may be in different micro-batches, and a loss object only
sees its own micro-batch's log-probs. DPO's gradient is separable, though. With ``s_i`` the log-prob
of sequence i's response (summed over its response tokens) and a per-pair loss ``L(m)`` of a margin
``m`` that is a function of the pair's two ``s``, the chain rule gives

    dL/dtheta = sum_i  dL/ds_i * grad s_i

So ``dpo_terms`` computes ``w_i = dL/ds_i`` (autograd over the few numbers ``s``, at the weights the
step trains), and ``DPOLossFn`` returns ``sum_i w_i * s_i`` over its micro-batch with ``w`` a constant:
its gradient is ``sum_i w_i grad s_i``, DPO's exactly, however the batch is cut (the test compares it
with autograd through a direct DPO loss on a tiny model). The surrogate's value is not DPO's loss;
the driver reports the real one.

Loss types (``h`` is the pair's log-ratio margin, ``beta`` the strength):

- ``sigmoid`` (DPO): ``h = (s_c - ref_c) - (s_r - ref_r)`` with ``s`` summed over response tokens,
  ``L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (``eps``: ``label_smoothing``,
  conservative DPO; 0 is plain DPO);
- ``ipo``: as TRL computes it, ``s`` is the per-token *mean* log-prob of the response,
  ``L = (h - 1 / (2 beta))^2``.

``sft_weight`` > 0 adds ``sft_weight`` times the chosen side's per-token NLL (RPO / TRL's
``rpo_alpha``). Rewards (for the metrics) are ``beta * (s - ref)`` in the loss type's ``s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from nemo_like.algorithms.policy_losses import register_loss

__all__ = ["DPOLossConfig", "DPOLossFn", "DPOPairLossFn", "dpo_terms", "sequence_logprobs"]


class DPOLossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # How far the policy may move from the reference: larger is closer (the KL's inverse weight).
    beta: float = Field(0.1, gt=0)
    # sigmoid: DPO (log-probs summed over the response); ipo: IPO (per-token mean log-probs, squared loss).
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    # sigmoid only: the share of pairs assumed mislabelled (conservative DPO); 0 is plain DPO.
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    # Weight of the chosen side's per-token NLL added to the loss (RPO); 0: none.
    sft_weight: float = Field(0.0, ge=0)
    # When a step's pairs are one micro-batch on one worker, compute DPO's loss in the training pass
    # itself (DPOPairLossFn), without the log-prob pass before it; false: always the two passes.
    one_pass: bool = True


def sequence_logprobs(token_logprobs: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[N]: each sequence's log-prob summed over its response tokens (``token_mask``)."""
    return (token_logprobs.float() * token_mask.float()).sum(dim=1)


def _pair_losses(s: torch.Tensor, ref: torch.Tensor, n_tokens: torch.Tensor, cfg: DPOLossConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and the chosen and rejected rewards; ``s``, ``ref``, ``n_tokens`` are [2P]
    with the chosen side at even rows."""
    if cfg.loss_type == "ipo":
        s_used, ref_used = s / n_tokens, ref / n_tokens
    else:
        s_used, ref_used = s, ref
    ratio = s_used - ref_used
    h = ratio[0::2] - ratio[1::2]
    if cfg.loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * cfg.beta)) ** 2
    else:
        eps = cfg.label_smoothing
        loss = -(1.0 - eps) * F.logsigmoid(cfg.beta * h) - eps * F.logsigmoid(-cfg.beta * h)
    if cfg.sft_weight:
        loss = loss - cfg.sft_weight * s[0::2] / n_tokens[0::2]
    return loss, cfg.beta * ratio[0::2].detach(), cfg.beta * ratio[1::2].detach()


def dpo_terms(seq_logprobs: torch.Tensor, ref_seq_logprobs: torch.Tensor, n_tokens: torch.Tensor,
              cfg: DPOLossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """For one batch of pairs (chosen at even rows, rejected at odd; [2P] each): ``dpo_weight`` [2P],
    each sequence's ``d(sum of pair losses)/d s_i`` (what ``DPOLossFn`` takes), and the metrics of
    the batch: ``loss`` (the mean pair loss), ``reward_accuracy`` (share of pairs whose chosen
    reward is higher, a tie counting half), ``reward_margin``, ``chosen_reward``, ``rejected_reward`` (means)."""
    if seq_logprobs.shape != ref_seq_logprobs.shape or seq_logprobs.numel() % 2:
        raise ValueError(f"paired sequence log-probs need equal, even shapes; got {tuple(seq_logprobs.shape)} and "
                         f"{tuple(ref_seq_logprobs.shape)}")
    s = seq_logprobs.detach().double().requires_grad_(True)
    loss, chosen, rejected = _pair_losses(s, ref_seq_logprobs.double(), n_tokens.double().clamp(min=1), cfg)
    (weight,) = torch.autograd.grad(loss.sum(), s)
    margin = chosen - rejected
    # A tie counts half (chance): at the reference every margin is 0, which is no preference either way.
    accuracy = (margin > 0).double() + 0.5 * (margin == 0).double()
    return weight.float(), {"loss": float(loss.detach().mean()), "reward_accuracy": float(accuracy.mean()),
                            "reward_margin": float(margin.mean()), "chosen_reward": float(chosen.mean()),
                            "rejected_reward": float(rejected.mean())}


class DPOLossFn:
    """The workers' half: ``sum_i dpo_weight_i * s_i * 2 / global_valid_seqs`` over this micro-batch
    (``s_i``: the response log-prob summed over ``token_mask * sample_mask``). Every side has response
    tokens, so the global sequence count is twice the pairs: the micro-batch losses add up to the mean
    over pairs, and the gradient is the mean DPO loss's. Metrics: ``loss`` (the surrogate's value,
    meaningless as a loss: the driver logs DPO's)."""

    loss_type = "sequence"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        # The weights carry the loss type and beta; the object itself has nothing to configure.
        if config:
            raise ValueError(f"the dpo loss takes its settings through dpo_weight, not a config; got {dict(config)}")

    def __call__(self, curr_logprobs: torch.Tensor, data: Mapping[str, Any], global_valid_seqs: torch.Tensor | float,
                 global_valid_toks: torch.Tensor | float) -> tuple[torch.Tensor, dict[str, float]]:
        if "dpo_weight" not in data or "token_mask" not in data:
            raise KeyError(f"the dpo loss needs dpo_weight and token_mask in the batch; it has {sorted(data)}")
        mask = data["token_mask"].to(curr_logprobs.device, curr_logprobs.dtype)
        if "sample_mask" in data:
            mask = mask * data["sample_mask"].to(curr_logprobs.device, curr_logprobs.dtype)[:, None]
        seqs = float(global_valid_seqs)
        if seqs <= 0:
            raise ValueError(f"global_valid_seqs must be positive, got {seqs}")
        s = (torch.where(mask != 0, curr_logprobs, torch.zeros_like(curr_logprobs)) * mask).sum(dim=1)
        w = data["dpo_weight"].to(curr_logprobs.device, curr_logprobs.dtype).detach()
        loss = (w * s).sum() * (2.0 / seqs)
        return loss, {"loss": float(loss.detach())}


class DPOPairLossFn:
    """One pass: DPO's loss itself, when both sides of every pair are in this micro-batch (the trainer
    uses it only when a step's pairs are one micro-batch on one worker). Reads ``pair_index`` and
    ``pair_side`` (0 chosen, 1 rejected) [B], ``reference_seq_logprobs`` [B] and ``response_tokens``
    [B]; returns ``sum of pair losses * 2 / global_valid_seqs`` (the mean over the batch's pairs) and
    the pairs' metrics (``dpo_loss``, ``reward_accuracy``, ``reward_margin``, ``chosen_reward``,
    ``rejected_reward``, means over this micro-batch's pairs). ValueError when a pair is split."""

    loss_type = "sequence"

    def __init__(self, config: DPOLossConfig) -> None:
        self.config = config

    def __call__(self, curr_logprobs: torch.Tensor, data: Mapping[str, Any], global_valid_seqs: torch.Tensor | float,
                 global_valid_toks: torch.Tensor | float) -> tuple[torch.Tensor, dict[str, float]]:
        dev, dt = curr_logprobs.device, curr_logprobs.dtype
        mask = data["token_mask"].to(dev, dt)
        s = (torch.where(mask != 0, curr_logprobs, torch.zeros_like(curr_logprobs)) * mask).sum(dim=1)
        key = data["pair_index"].long().to(dev) * 2 + data["pair_side"].long().to(dev)
        order = torch.argsort(key)
        k = key[order]
        if len(k) % 2 or bool((k[0::2] % 2 != 0).any()) or not torch.equal(k[0::2] + 1, k[1::2]):
            raise ValueError("the dpo_pair loss needs both sides of every pair in one micro-batch; train with "
                             "dpo.one_pass=false")
        ref = data["reference_seq_logprobs"].to(dev, torch.float64)[order]
        n = data["response_tokens"].to(dev, torch.float64)[order].clamp(min=1)
        losses, chosen, rejected = _pair_losses(s[order].double(), ref, n, self.config)
        loss = (losses.sum() * (2.0 / float(global_valid_seqs))).to(dt)
        margin = chosen - rejected
        accuracy = (margin > 0).double() + 0.5 * (margin == 0).double()
        return loss, {"loss": float(loss.detach()), "dpo_loss": float(losses.detach().mean()),
                      "reward_accuracy": float(accuracy.mean()), "reward_margin": float(margin.mean()),
                      "chosen_reward": float(chosen.mean()), "rejected_reward": float(rejected.mean())}


register_loss("dpo", DPOLossFn)
register_loss("dpo_pair", DPOPairLossFn)
