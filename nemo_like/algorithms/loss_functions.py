"""Losses for RL post-training (GRPO clipped policy gradient) and SFT (NLL).

Two layers:
- ``clipped_pg_loss``: a pure function of tensors that normalises by *its own* mask (what the
  issue specifies; handy for tests and notebooks).
- Loss objects (``ClippedPGLossFn``, ``NLLLossFn``) implementing the worker-facing contract
  ``loss_fn(curr_logprobs, data, global_valid_seqs, global_valid_toks) -> (loss, metrics)``. They
  normalise by the *global* counts so that summing micro-batch losses over all micro-batches and
  workers gives exactly the global-batch loss (gradient accumulation is then a plain sum).

Masked positions are replaced by 0 *before* any arithmetic: padding may hold -inf/NaN logprobs,
and ``x * 0`` would still turn those into NaN values or NaN gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# k3 KL guards: clamp the log-ratio so exp() cannot overflow to inf (inf - inf = NaN in the value
# and 0 * inf = NaN in the gradient), and cap the per-token KL so one wild token cannot dominate.
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0

PG_METRIC_NAMES = (
    "probs_ratio",
    "probs_ratio_clamped",
    "kl_penalty",
    "token_mult_prob_error",
    "sampling_importance_ratio",
    "approx_entropy",
    "clip_fraction",
)


class ClippedPGLossConfig(BaseModel):
    """The ``loss_fn:`` config section (PPO/GRPO clipped surrogate + k3 KL to a reference)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    ratio_clip_min: float = Field(0.2, ge=0.0, allow_inf_nan=False)
    ratio_clip_max: float = Field(0.2, ge=0.0, allow_inf_nan=False)
    ratio_clip_c: float | None = Field(None, allow_inf_nan=False)
    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, allow_inf_nan=False)
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    token_level_loss: bool = True

    @field_validator("ratio_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        # c <= 1 would cap the loss of negative-advantage tokens at or below the ordinary clip,
        # silently turning the surrogate into something else.
        if value is not None and not value > 1.0:
            raise ValueError(f"ratio_clip_c (dual-clip bound) must be > 1 when set, got {value}")
        return value


def _resolve_config(config: ClippedPGLossConfig | Mapping[str, Any]) -> ClippedPGLossConfig:
    """Validate ``config`` (model or plain dict) into a ClippedPGLossConfig; ValueError if bad."""
    if isinstance(config, ClippedPGLossConfig):
        data: Any = config.model_dump()  # re-validate: model_construct() bypasses validators
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(
            "clipped PG loss config must be a ClippedPGLossConfig or a dict, "
            f"got {type(config).__name__}"
        )
    try:
        return ClippedPGLossConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid clipped PG loss config: {exc}") from exc


def _check_2d(name: str, tensor: Any, shape: torch.Size | None) -> None:
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
    _check_2d("curr_logprobs", curr, None)
    if not curr.is_floating_point():
        raise TypeError(f"curr_logprobs must be a floating tensor, got dtype {curr.dtype}")
    for name, t in (
        ("prev_logprobs", prev),
        ("generation_logprobs", gen),
        ("reference_logprobs", ref),
        ("mask", mask),
    ):
        _check_2d(name, t, curr.shape)
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


def _pg_token_terms(
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    ref: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token loss ``l`` [B, T] (0 off-mask), the float mask, and the metrics."""
    _check_inputs(curr, prev, gen, ref, adv, mask)
    mask = mask.to(device=curr.device, dtype=curr.dtype)
    keep = mask != 0
    zero = torch.zeros((), dtype=curr.dtype, device=curr.device)

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t.to(device=curr.device, dtype=curr.dtype), zero)

    curr, prev, gen, ref = clean(curr), clean(prev), clean(gen), clean(ref)
    adv = adv.to(device=curr.device, dtype=curr.dtype)
    adv = clean(adv[:, None].expand_as(curr) if adv.dim() == 1 else adv)

    ratio = torch.exp(curr - prev)
    ratio_clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    # Pessimistic (max of losses) PPO surrogate.
    pg = torch.maximum(-adv * ratio, -adv * ratio_clamped)
    if cfg.ratio_clip_c is not None:
        # Dual clip: bound the loss of negative-advantage tokens whose ratio exploded.
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)
    if cfg.use_importance_sampling_correction:
        # Corrects for the generation engine's numerics differing from the trainer's; a
        # constant weight, like in off-policy PG, so it gets no gradient.
        weight = torch.exp(prev - gen).detach()
        weight = torch.where(torch.isfinite(weight), weight, zero)
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
    return token_loss, mask, metrics


def _token_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_loss * mask).sum()


def _sequence_mean_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over sequences with >= 1 masked token of that sequence's masked mean."""
    seq_den = mask.sum(dim=-1)
    valid = seq_den != 0
    seq_mean = (token_loss * mask).sum(dim=-1) / torch.where(valid, seq_den, torch.ones_like(seq_den))
    return torch.where(valid, seq_mean, torch.zeros_like(seq_mean)).sum()


def _safe_div(numerator: torch.Tensor, denom: torch.Tensor | float) -> torch.Tensor:
    # numerator is exactly 0 (but still in the graph) whenever denom is 0, so dividing by 1
    # instead keeps loss.backward() working on an empty mask.
    denom_f = float(denom)
    return numerator / (denom_f if denom_f != 0.0 else 1.0)


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
    [B, T]. Per token: ``r = exp(curr - prev)``, ``r_c = clamp(r, 1 - ratio_clip_min,
    1 + ratio_clip_max)``, ``pg = max(-A r, -A r_c)``; dual clip (``ratio_clip_c``): where A < 0,
    ``pg = min(pg, -A c)``; IS correction: ``pg *= w``, ``w = exp(prev - gen)`` (non-finite -> 0,
    no gradient); ``d = clamp(ref - curr, -20, 20)``, ``kl = min(exp(d) - d - 1, 10)``, times
    ``exp(curr - gen)`` (no gradient) with the on-policy approximation;
    ``l = pg + reference_policy_kl_penalty * kl``.

    Reduction: ``token_level_loss`` -> ``sum(l * mask) / sum(mask)``; else the mean over sequences
    with at least one masked token of ``sum_t(l * mask) / sum_t(mask)``. An all-zero mask gives a
    loss of 0.0 that is still connected to ``curr_logprobs`` (backward yields zero gradients).

    Metrics are plain floats, masked means over valid tokens (0.0 when there are none):
    ``probs_ratio`` (r), ``probs_ratio_clamped`` (r_c), ``kl_penalty`` (coefficient * kl, as
    added), ``token_mult_prob_error`` (exp|gen - prev|), ``sampling_importance_ratio``
    (exp(prev - gen)), ``approx_entropy`` (-exp(curr - gen) * curr) and ``clip_fraction``: the
    fraction of valid tokens where the clamp changed the ratio (``r != r_c``, i.e. r lies outside
    [1 - ratio_clip_min, 1 + ratio_clip_max]), regardless of which side of the max won or the sign
    of A; dual clipping is not counted.

    Raises ValueError for a bad config (unknown key, ``ratio_clip_c <= 1``, ...) or mismatched
    shapes, TypeError for non-tensor inputs.
    """
    cfg = _resolve_config(config)
    token_loss, fmask, metrics = _pg_token_terms(
        curr_logprobs,
        prev_logprobs,
        generation_logprobs,
        reference_logprobs,
        advantages,
        mask,
        cfg,
    )
    if cfg.token_level_loss:
        loss = _safe_div(_token_sum(token_loss, fmask), fmask.sum())
    else:
        loss = _safe_div(_sequence_mean_sum(token_loss, fmask), (fmask.sum(-1) != 0).sum())
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Loss objects for the policy worker
# ---------------------------------------------------------------------------------------------


class LossFunction(Protocol):
    """What the policy worker calls once per micro-batch."""

    @property
    def loss_type(self) -> str: ...  # "token" or "sequence"

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
    _check_2d("data['token_mask']", token_mask, curr.shape)
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
    return _safe_div(numerator, g)


class ClippedPGLossFn:
    """GRPO/PPO loss object: ``clipped_pg_loss`` normalised by the global batch counts.

    Reads ``token_mask``, ``sample_mask`` (optional, [B]), ``advantages`` ([B] or [B, T]),
    ``prev_logprobs``, ``generation_logprobs`` and ``reference_policy_logprobs`` from ``data``.
    Token level: ``sum(l * mask) / global_valid_toks``; sequence level: ``sum over this
    micro-batch's valid sequences of their masked mean / global_valid_seqs`` — equal to the local
    loss times ``mb_count / global_count``. Metrics: those of ``clipped_pg_loss`` (local), plus
    ``loss`` (the returned value), ``num_valid_tokens`` and ``num_valid_seqs`` (this micro-batch).
    """

    def __init__(self, config: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        self.config = _resolve_config(config if config is not None else ClippedPGLossConfig())

    @property
    def loss_type(self) -> str:
        return "token" if self.config.token_level_loss else "sequence"

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        _check_2d("curr_logprobs", curr_logprobs, None)
        mask = _effective_mask(curr_logprobs, data)
        adv, prev, gen, ref = _get(
            data,
            ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"),
        )
        token_loss, fmask, metrics = _pg_token_terms(
            curr_logprobs, prev, gen, ref, adv, mask, self.config
        )
        num_toks = float(fmask.sum())
        num_seqs = float((fmask.sum(-1) != 0).sum())
        if self.config.token_level_loss:
            loss = _global_normalise(
                _token_sum(token_loss, fmask), num_toks, global_valid_toks, "global_valid_toks"
            )
        else:
            loss = _global_normalise(
                _sequence_mean_sum(token_loss, fmask), num_seqs, global_valid_seqs, "global_valid_seqs"
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
        _check_2d("curr_logprobs", curr_logprobs, None)
        mask = _effective_mask(curr_logprobs, data)
        token_nll = torch.where(mask != 0, -curr_logprobs, torch.zeros_like(curr_logprobs))
        total = _token_sum(token_nll, mask)
        num_toks = float(mask.sum())
        loss = _global_normalise(total, num_toks, global_valid_toks, "global_valid_toks")
        nll = float(total.detach()) / num_toks if num_toks else 0.0
        return loss, {"nll": nll, "num_valid_tokens": num_toks, "loss": float(loss.detach())}


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

LossFactory = Callable[..., LossFunction]
_F = TypeVar("_F", bound=Callable[..., Any])
_LOSS_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_loss(name: str) -> Callable[[_F], _F]:
    """Decorator registering a loss class or factory under ``name``.

    The factory is called as ``factory(config)`` when ``get_loss_fn`` gets a config, else
    ``factory()``. Registering a different object under a taken name raises ValueError (a
    re-import of the same definition is allowed).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss name must be a non-empty string, got {name!r}")

    def decorator(factory: _F) -> _F:
        existing = _LOSS_REGISTRY.get(name)
        if existing is not None and _qualified(existing) != _qualified(factory):
            raise ValueError(f"loss {name!r} is already registered to {_qualified(existing)}")
        _LOSS_REGISTRY[name] = factory
        return factory

    return decorator


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def get_loss_fn(name: str, config: Any = None) -> LossFunction:
    """Build the loss registered under ``name``; KeyError listing the registered names if unknown."""
    if name not in _LOSS_REGISTRY:
        raise KeyError(f"unknown loss {name!r}; registered losses: {sorted(_LOSS_REGISTRY)}")
    factory = _LOSS_REGISTRY[name]
    return factory(config) if config is not None else factory()


def registered_losses() -> list[str]:
    return sorted(_LOSS_REGISTRY)


register_loss("clipped_pg")(ClippedPGLossFn)
register_loss("nll")(NLLLossFn)
