"""Per-token terms of the policy-gradient loss (surrogate, importance weight, KL, metrics) and the
reductions ``loss_functions.py`` builds its losses from.

Masked positions are replaced by 0 *before* any arithmetic: padding may hold -inf/NaN logprobs,
and ``x * 0`` would still turn those into NaN values or NaN gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_like.algorithms.loss_config import ClippedPGLossConfig
from nemo_like.algorithms.policy_losses import PolicyLossFn, get_policy_loss

# k3 KL guards: clamp the log-ratio so exp() cannot overflow to inf (inf - inf = NaN in the value
# and 0 * inf = NaN in the gradient), and cap the per-token KL so one wild token cannot dominate.
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0

# Always reported; ``is_masked_fraction`` / ``is_truncated_fraction`` only when their option is set.
PG_METRIC_NAMES = (
    "probs_ratio",
    "probs_ratio_clamped",
    "kl_penalty",
    "token_mult_prob_error",
    "sampling_importance_ratio",
    "approx_entropy",
    "clip_fraction",
)


def check_2d(name: str, tensor: Any, shape: torch.Size | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if shape is None:
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(tensor.shape)}")
    elif tensor.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (same as curr_logprobs)"
        )


def _check_inputs(
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    ref: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    check_2d("curr_logprobs", curr, None)
    if not curr.is_floating_point():
        raise TypeError(f"curr_logprobs must be a floating tensor, got dtype {curr.dtype}")
    for name, t in (
        ("prev_logprobs", prev),
        ("generation_logprobs", gen),
        ("reference_logprobs", ref),
        ("mask", mask),
    ):
        check_2d(name, t, curr.shape)
    if not isinstance(adv, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(adv).__name__}")
    batch = curr.shape[0]
    if adv.shape != (batch,) and adv.shape != curr.shape:
        raise ValueError(
            f"advantages has shape {tuple(adv.shape)}, expected [B]={[batch]} or "
            f"[B, T]={list(curr.shape)}"
        )
    if bool((mask < 0).any()):
        raise ValueError("mask must be non-negative (1 on tokens that count, 0 elsewhere)")


def _masked_mean_value(x: torch.Tensor, mask: torch.Tensor, denom: float) -> float:
    """Masked mean as a plain float (0.0 when nothing is masked in); x is already zeroed off-mask."""
    if denom == 0.0:
        return 0.0
    return float((x * mask).sum()) / denom


def _importance_weight(
    prev: torch.Tensor, gen: torch.Tensor, keep: torch.Tensor, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IS weight exp(prev - gen) for the generation engine's numerics differing from the trainer's;
    a constant, like in off-policy PG, so it gets no gradient. Non-finite weights become 0; then
    the mask (weight 0 outside [low, high]) and the cap (min(w, C)). Returns the per-token flags
    behind the metrics of the options that are set."""
    zero = torch.zeros((), dtype=prev.dtype, device=prev.device)
    raw = torch.exp(prev - gen).detach()
    weight = torch.where(torch.isfinite(raw), raw, zero)
    flags: dict[str, torch.Tensor] = {}
    if cfg.importance_sampling_mask is not None:
        low, high = cfg.importance_sampling_mask
        inside = (raw >= low) & (raw <= high)  # False for NaN and inf: those are masked too
        flags["is_masked_fraction"] = ~inside & keep
        weight = torch.where(inside, weight, zero)
    if cfg.truncated_importance_sampling_ratio is not None:
        cap = cfg.truncated_importance_sampling_ratio
        # Counted after masking: a token masked out is not also reported as truncated.
        flags["is_truncated_fraction"] = (weight > cap) & keep
        weight = weight.clamp(max=cap)
    return weight, flags


def pg_token_terms(
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    ref: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
    surrogate: PolicyLossFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token loss ``l`` [B, T] (0 off-mask), the float mask, and the metrics. ``surrogate``: the
    ``loss_fn.policy_loss`` function already resolved (a loss object resolves it where it is built,
    so a surrogate registered only in the driver works in the workers); None: looked up now."""
    _check_inputs(curr, prev, gen, ref, adv, mask)
    mask = mask.to(device=curr.device, dtype=curr.dtype)
    keep = mask != 0
    zero = torch.zeros((), dtype=curr.dtype, device=curr.device)

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t.to(device=curr.device, dtype=curr.dtype), zero)

    curr, prev, gen, ref = clean(curr), clean(prev), clean(gen), clean(ref)
    adv = adv.to(device=curr.device, dtype=curr.dtype)
    adv = clean(adv[:, None].expand_as(curr) if adv.dim() == 1 else adv)

    surrogate = surrogate if surrogate is not None else get_policy_loss(cfg.policy_loss)
    pg, ratio, ratio_clamped = surrogate(curr, prev, adv, mask, cfg)
    if pg.shape != curr.shape:
        raise ValueError(f"policy loss {cfg.policy_loss!r} returned a loss of shape {tuple(pg.shape)}, "
                         f"expected {tuple(curr.shape)} (one value per token)")
    flags: dict[str, torch.Tensor] = {}
    if cfg.use_importance_sampling_correction:
        weight, flags = _importance_weight(prev, gen, keep, cfg)
        pg = pg * weight

    log_ratio_ref = (ref - curr).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    kl = torch.clamp(torch.exp(log_ratio_ref) - log_ratio_ref - 1.0, max=KL_VALUE_CLAMP)
    if cfg.use_on_policy_kl_approximation:
        # The samples came from the generation policy; reweight to estimate KL under the
        # current policy. The weight is a constant (no gradient), as in NeMo RL.
        kl = kl * torch.exp(curr - gen).detach()
    kl_term = cfg.reference_policy_kl_penalty * kl
    token_loss = torch.where(keep, pg + kl_term, zero)

    with torch.no_grad():
        n = float(mask.sum())
        metrics = {
            "probs_ratio": _masked_mean_value(ratio, mask, n),
            "probs_ratio_clamped": _masked_mean_value(ratio_clamped, mask, n),
            "kl_penalty": _masked_mean_value(kl_term, mask, n),
            "token_mult_prob_error": _masked_mean_value(torch.exp((gen - prev).abs()), mask, n),
            "sampling_importance_ratio": _masked_mean_value(torch.exp(prev - gen), mask, n),
            "approx_entropy": _masked_mean_value(-torch.exp(curr - gen) * curr, mask, n),
            "clip_fraction": _masked_mean_value((ratio != ratio_clamped).to(curr.dtype), mask, n),
        }
        for name, flag in flags.items():
            metrics[name] = _masked_mean_value(flag.to(curr.dtype), mask, n)
    return token_loss, mask, metrics


def token_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_loss * mask).sum()


def sequence_mean_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over sequences with >= 1 masked token of that sequence's masked mean."""
    seq_den = mask.sum(dim=-1)
    valid = seq_den != 0
    seq_mean = (token_loss * mask).sum(dim=-1) / torch.where(valid, seq_den, torch.ones_like(seq_den))
    return torch.where(valid, seq_mean, torch.zeros_like(seq_mean)).sum()


def num_valid_seqs(mask: torch.Tensor) -> float:
    """Sequences with at least one masked token (the worker's ``global_valid_seqs`` counts these)."""
    return float((mask.sum(dim=-1) != 0).sum())


def safe_div(numerator: torch.Tensor, denom: torch.Tensor | float) -> torch.Tensor:
    # numerator is exactly 0 (but still in the graph) whenever denom is 0, so dividing by 1
    # instead keeps loss.backward() working on an empty mask.
    denom_f = float(denom)
    return numerator / (denom_f if denom_f != 0.0 else 1.0)
