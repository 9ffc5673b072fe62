"""Losses for RL post-training (GRPO policy gradient) and SFT (NLL), and their registry.

Two layers:
- ``clipped_pg_loss``: a pure function of tensors that normalises by *its own* mask (what the
  issue specifies; handy for tests and notebooks).
- Loss objects (``ClippedPGLossFn``, ``NLLLossFn``) implementing the worker-facing contract
  ``loss_fn(curr_logprobs, data, global_valid_seqs, global_valid_toks) -> (loss, metrics)``. They
  normalise by the *global* counts so that summing micro-batch losses over all micro-batches and
  workers gives exactly the global-batch loss (gradient accumulation is then a plain sum).
  ``curr_logprobs`` is computed where ``data["token_mask"]`` is 1 and is 0 elsewhere
  (``models.policy.selected_logits``): read it through that mask.

The config lives in ``loss_config.py`` and the per-token arithmetic in ``pg_terms.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from nemo_like.algorithms.loss_config import ClippedPGLossConfig, resolve_pg_loss_config
from nemo_like.algorithms.pg_terms import (
    check_2d,
    num_valid_seqs,
    pg_token_terms,
    safe_div,
    sequence_mean_sum,
    token_sum,
)
from nemo_like.algorithms.policy_losses import (
    LOSSES,
    POLICY_LOSSES,
    check_loss_name,
    get_loss_fn,
    get_policy_loss,
    register_loss,
    register_policy_loss,
    registered_losses,
)

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "LOSSES",
    "LossFunction",
    "NLLLossFn",
    "POLICY_LOSSES",
    "check_loss_name",
    "clipped_pg_loss",
    "get_loss_fn",
    "get_policy_loss",
    "register_loss",
    "register_policy_loss",
    "registered_losses",
]


def clipped_pg_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ClippedPGLossConfig | Mapping[str, Any],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with k3 KL penalty, reduced over ``mask`` itself.

    Logprob tensors and ``mask`` are [B, T]; ``advantages`` is [B] (broadcast over tokens) or
    [B, T]. Per token, by ``policy_loss`` (clamp to [1 - ratio_clip_min, 1 + ratio_clip_max]):
    - "ppo_clip": ``r = exp(curr - prev)``, ``r_c = clamp(r)``, ``pg = max(-A r, -A r_c)``; dual
      clip (``ratio_clip_c``): where A < 0, ``pg = min(pg, -A c)``;
    - "gspo": ``r`` is the sequence's ``s = exp(sum_t mask (curr - prev) / sum_t mask)``, the same
      for all its tokens (gradient through s), ``pg = max(-A s, -A clamp(s))``;
    - "cispo": ``pg = -A * sg(clamp(r)) * curr`` (sg: no gradient, so every token has one).
    IS correction: ``pg *= w``, ``w = exp(prev - gen)`` (non-finite -> 0, no gradient), 0 outside
    ``importance_sampling_mask`` [low, high], then ``min(w, truncated_importance_sampling_ratio)``;
    ``d = clamp(ref - curr, -20, 20)``, ``kl = min(exp(d) - d - 1, 10)``, times ``exp(curr - gen)``
    (no gradient) with the on-policy approximation; ``l = pg + reference_policy_kl_penalty * kl``.

    Reduction: ``loss_length_normalizer`` L set (Dr.GRPO) -> ``sum(l * mask) / (n_seq * L)``, with
    n_seq the sequences with at least one masked token; else ``token_level_loss`` ->
    ``sum(l * mask) / sum(mask)``; else the mean over those sequences of
    ``sum_t(l * mask) / sum_t(mask)``. Tokens the IS mask zeroes stay in every denominator. An
    all-zero mask gives a loss of 0.0 still connected to ``curr_logprobs`` (zero gradients).

    Metrics are plain floats, masked means over valid tokens (0.0 when there are none):
    ``probs_ratio`` (r), ``probs_ratio_clamped`` (r_c), ``kl_penalty`` (coefficient * kl, as
    added), ``token_mult_prob_error`` (exp|gen - prev|), ``sampling_importance_ratio``
    (exp(prev - gen)), ``approx_entropy`` (-exp(curr - gen) * curr) and ``clip_fraction``: the
    fraction of valid tokens where the clamp changed the ratio (``r != r_c``, i.e. r lies outside
    [1 - ratio_clip_min, 1 + ratio_clip_max]), regardless of which side of the max won or the sign
    of A; dual clipping is not counted. Under "gspo" the three ratio metrics use the sequence
    ratio s of each token's sequence. With ``importance_sampling_mask``: ``is_masked_fraction``
    (weight zeroed by the mask, non-finite ratios included); with
    ``truncated_importance_sampling_ratio``: ``is_truncated_fraction`` (weight capped).

    Raises ValueError for a bad config (unknown key, ``ratio_clip_c <= 1``, ...) or mismatched
    shapes, TypeError for non-tensor inputs.
    """
    cfg = resolve_pg_loss_config(config)
    token_loss, fmask, metrics = pg_token_terms(
        curr_logprobs,
        prev_logprobs,
        generation_logprobs,
        reference_logprobs,
        advantages,
        mask,
        cfg,
    )
    if cfg.loss_length_normalizer is not None:
        loss = safe_div(token_sum(token_loss, fmask), num_valid_seqs(fmask) * cfg.loss_length_normalizer)
    elif cfg.token_level_loss:
        loss = safe_div(token_sum(token_loss, fmask), fmask.sum())
    else:
        loss = safe_div(sequence_mean_sum(token_loss, fmask), num_valid_seqs(fmask))
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Loss objects for the policy worker
# ---------------------------------------------------------------------------------------------


class LossFunction(Protocol):
    """What the policy worker calls once per micro-batch. A sample whose ``sample_mask`` is 0
    carries no loss: it must add nothing to the loss nor to its gradient, and the loss must divide
    by the global counts it is given, not by its micro-batch's (the trainer leaves such samples out
    of the pass, ``grpo.skip_inert_samples``)."""

    @property
    def loss_type(self) -> str: ...  # "token" or "sequence"

    # Optional: True when a sample whose advantages are all 0 adds nothing to the loss nor to its
    # gradient, so the trainer may leave it out of the pass (grpo.skip_inert_samples). Absent: False.
    # zero_advantage_is_inert: bool

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def _get(data: Mapping[str, Any], keys: tuple[str, ...]) -> list[Any]:
    missing = [k for k in keys if k not in data]
    if missing:
        raise KeyError(f"loss data is missing keys {missing}; it has {sorted(data.keys())}")
    return [data[k] for k in keys]


def _effective_mask(curr: torch.Tensor, data: Mapping[str, Any]) -> torch.Tensor:
    """token_mask * sample_mask[:, None]; sample_mask is optional (defaults to all ones)."""
    (token_mask,) = _get(data, ("token_mask",))
    check_2d("data['token_mask']", token_mask, curr.shape)
    mask = token_mask.to(device=curr.device, dtype=curr.dtype)
    sample_mask = data.get("sample_mask")
    if sample_mask is not None:
        if not isinstance(sample_mask, torch.Tensor) or sample_mask.shape != (curr.shape[0],):
            got = tuple(sample_mask.shape) if isinstance(sample_mask, torch.Tensor) else type(sample_mask)
            raise ValueError(f"data['sample_mask'] must be a tensor of shape [{curr.shape[0]}], got {got}")
        mask = mask * sample_mask.to(device=curr.device, dtype=curr.dtype)[:, None]
    return mask


def _global_normalise(
    numerator: torch.Tensor, local_count: float, global_count: torch.Tensor | float, name: str
) -> torch.Tensor:
    """numerator / global_count, refusing counts that cannot be the global batch's."""
    g = float(global_count)
    if g < 0 or g != g:
        raise ValueError(f"{name} must be a non-negative number, got {g}")
    # A global count smaller than this micro-batch's own count means the caller passed a
    # per-micro-batch or per-worker count: the loss scale would silently be wrong.
    if g < local_count * (1 - 1e-6) - 1e-6:
        raise ValueError(
            f"{name}={g} is smaller than this micro-batch's own count {local_count}; it must "
            "count the whole global batch on all workers"
        )
    return safe_div(numerator, g)


class ClippedPGLossFn:
    """GRPO/PPO loss object: ``clipped_pg_loss`` normalised by the global batch counts.

    Reads ``token_mask``, ``sample_mask`` (optional, [B]), ``advantages`` ([B] or [B, T]),
    ``prev_logprobs``, ``generation_logprobs`` and ``reference_policy_logprobs`` from ``data``;
    with ``proximal_is_current`` ([B], set when the batch is a single optimizer step) and no
    ``prev_logprobs``, the previous (and, if absent, reference) log-probs are ``curr_logprobs``
    detached: the same numbers a separate forward pass before the update would give. Token level: ``sum(l * mask) / global_valid_toks``; sequence level: ``sum over this
    micro-batch's valid sequences of their masked mean / global_valid_seqs`` — equal to the local
    loss times ``mb_count / global_count``; Dr.GRPO (``loss_length_normalizer`` L):
    ``sum(l * mask) / (global_valid_seqs * L)``. Metrics: those of ``clipped_pg_loss`` (local), plus
    ``loss`` (the returned value), ``num_valid_tokens`` and ``num_valid_seqs`` (this micro-batch).
    """

    def __init__(self, config: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        self.config = resolve_pg_loss_config(config if config is not None else ClippedPGLossConfig())
        # Resolved here, in the process that builds the loss: the object then carries the function to
        # the workers, where a surrogate registered only in the driver (a notebook cell) is unknown.
        self.surrogate = get_policy_loss(self.config.policy_loss)

    @property
    def zero_advantage_is_inert(self) -> bool:
        # Every policy-gradient form (ppo_clip, gspo, cispo, IS-weighted or not) is A times a
        # factor; only the KL penalty acts on a sample whatever its advantage.
        return self.config.reference_policy_kl_penalty == 0

    @property
    def loss_type(self) -> str:
        # Dr.GRPO divides by the global sequence count (times a constant).
        if self.config.loss_length_normalizer is not None or not self.config.token_level_loss:
            return "sequence"
        return "token"

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_2d("curr_logprobs", curr_logprobs, None)
        mask = _effective_mask(curr_logprobs, data)
        if "prev_logprobs" not in data and "proximal_is_current" in data:
            # The batch is one optimizer step: the weights being trained are the proximal policy
            # (the weights before this update), so their log-probs are curr's, with no extra pass.
            cur = curr_logprobs.detach()
            data = {"prev_logprobs": cur, "reference_policy_logprobs": cur, **data}
        adv, prev, gen, ref = _get(
            data,
            ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"),
        )
        token_loss, fmask, metrics = pg_token_terms(
            curr_logprobs, prev, gen, ref, adv, mask, self.config, self.surrogate
        )
        num_toks = float(fmask.sum())
        num_seqs = num_valid_seqs(fmask)
        if self.config.loss_length_normalizer is not None:
            # The global sequence count is what makes the micro-batch losses sum to the batch's.
            loss = _global_normalise(
                token_sum(token_loss, fmask), num_seqs, global_valid_seqs, "global_valid_seqs"
            ) / self.config.loss_length_normalizer
        elif self.config.token_level_loss:
            loss = _global_normalise(
                token_sum(token_loss, fmask), num_toks, global_valid_toks, "global_valid_toks"
            )
        else:
            loss = _global_normalise(
                sequence_mean_sum(token_loss, fmask), num_seqs, global_valid_seqs, "global_valid_seqs"
            )
        metrics.update(loss=float(loss.detach()), num_valid_tokens=num_toks, num_valid_seqs=num_seqs)
        return loss, metrics


class NLLLossFn:
    """SFT loss: ``-sum(curr_logprobs * mask) / global_valid_toks`` with mask = token_mask *
    sample_mask. Metrics: ``nll`` (this micro-batch's per-token mean), ``num_valid_tokens``,
    ``loss`` (the returned value)."""

    loss_type = "token"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        # Accepts an empty config so get_loss_fn(name, config) can treat every loss alike.
        if config:
            raise ValueError(f"the nll loss takes no config, got {dict(config)}")

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_2d("curr_logprobs", curr_logprobs, None)
        mask = _effective_mask(curr_logprobs, data)
        token_nll = torch.where(mask != 0, -curr_logprobs, torch.zeros_like(curr_logprobs))
        total = token_sum(token_nll, mask)
        num_toks = float(mask.sum())
        loss = _global_normalise(total, num_toks, global_valid_toks, "global_valid_toks")
        nll = float(total.detach()) / num_toks if num_toks else 0.0
        return loss, {"nll": nll, "num_valid_tokens": num_toks, "loss": float(loss.detach())}


# The registries (``loss_fn.name`` and ``loss_fn.policy_loss``) live in ``policy_losses.py``, where the
# config can check names without importing the loss objects; re-exported here.
