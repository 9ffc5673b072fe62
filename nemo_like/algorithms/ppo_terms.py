"""Tensor arithmetic for PPO with a critic: per-token KL, token-level rewards, GAE, ReMax, whitening,
the clipped value loss, explained variance and the KL-in-reward coefficient controllers.

Conventions (N samples, T token positions):
- ``mask`` [N, T] (bool, or numbers that are all 0 or 1) is 1 on the response (assistant) tokens that
  carry loss; padding and environment/observation tokens between turns are 0.
- ``values[:, t]`` is the value of the state that chose token t (the caller does the shift).
- Positions where the mask is 0 never enter a result: they are replaced by 0 *before* any arithmetic,
  so padding may hold anything (NaN, inf) and still changes nothing. Non-finite numbers on mask
  tokens raise ValueError (all but the live values given to :func:`clipped_value_loss_terms`).
- Computed in float64; returned in the inputs' floating dtype (float32 when none is floating).
  Nothing carries a gradient except :func:`clipped_value_loss` and :func:`clipped_value_loss_terms`
  (w.r.t. ``values``) and :func:`masked_mean` (w.r.t. ``x``).
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Any

import torch

_KL_FUNCTIONS = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.exp(-d) - 1.0 + d,
    "abs": torch.abs,
}
KL_ESTIMATORS = tuple(_KL_FUNCTIONS)
KL_CONTROLLERS = ("fixed", "adaptive")
ADAPTIVE_KL_ERROR_CLIP = 0.2  # the adaptive controller's proportional error is clipped to [-0.2, 0.2]


# ---- helpers ---------------------------------------------------------------------------------------
def _out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    return reduce(torch.promote_types, floats) if floats else torch.float32


def _valid(mask: Any) -> torch.Tensor:
    """The mask as bool [N, T], after checking its type, shape and values."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [N, T], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1 (1 on the response tokens that carry loss)")
    return mask.bool()


def _masked64(name: str, x: Any, valid: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 with 0 off the mask; checks its shape against the mask and finiteness on it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != valid.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(valid.shape)} (the mask's)")
    x64 = torch.where(valid, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    if not bool(torch.isfinite(x64).all()):
        bad = torch.nonzero(~torch.isfinite(x64))[:3].tolist()
        raise ValueError(f"{name} must be finite on mask tokens; non-finite at [row, col] {bad}")
    return x64


def _check_rows(name: str, x: Any, n: int) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != (n,):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape [N]={[n]}, got {got}")


def _check_horizon(horizon: Any) -> None:
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
        raise ValueError(f"horizon must be an int > 0, got {horizon!r}")


def _check_number(name: str, value: Any, what: str = "", test: Any = lambda v: True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not test(value):
        raise ValueError(f"{name} must be a finite number{what}, got {value!r}")


# ---- KL and rewards --------------------------------------------------------------------------------
@torch.no_grad()
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate [N, T] from ``d = logprobs - ref_logprobs`` (both [N, T]):
    ``k1 = d``, ``k2 = d**2 / 2``, ``k3 = exp(-d) - 1 + d``, ``abs = |d|``.

    Elementwise, with no mask: whatever padding holds comes out at its positions (mask it afterwards,
    as :func:`token_level_rewards` does). No clamping: k3 of a very negative d overflows to inf."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {list(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)} but ref_logprobs has "
                         f"{tuple(ref_logprobs.shape)}; they must match")
    kl = _KL_FUNCTIONS[estimator](logprobs.to(torch.float64) - ref_logprobs.to(torch.float64))
    return kl.to(_out_dtype(logprobs, ref_logprobs))


@torch.no_grad()
def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        coef: float = 0.0) -> torch.Tensor:
    """Token rewards [N, T]: ``scores[i]`` [N] on row i's last mask=1 token, minus ``coef * kl`` [N, T]
    on every mask=1 token, 0 elsewhere. A row with no mask=1 token gets all zeros (its score is not
    read, so it may be NaN). ``coef`` is the coefficient *before* this batch's controller update."""
    valid = _valid(mask)
    n, t = valid.shape
    _check_rows("scores", scores, n)
    _check_number("coef", coef)
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    s = torch.where(valid.any(dim=1), scores.to(torch.float64), zero)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"scores must be finite for rows with a response token; non-finite at rows "
                         f"{torch.nonzero(~torch.isfinite(s)).flatten()[:5].tolist()}")
    last = valid & (valid.flip(1).cumsum(1).flip(1) == 1)  # no mask token after this one
    rewards = torch.where(last, s[:, None].expand(n, t), zero)
    if kl is not None:
        rewards = rewards - coef * _masked64("kl", kl, valid)
    return rewards.to(_out_dtype(scores, *([] if kl is None else [kl])))


# ---- advantages ------------------------------------------------------------------------------------
@torch.no_grad()
def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, both [N, T], unwhitened,
    0 where the mask is 0; ``returns = advantages + values`` on mask tokens.

    Backwards over t from ``next_value = 0, g = 0``: on a mask token ``delta = r_t + gamma * next_value
    - V_t``, ``g = delta + gamma * lam * g``, ``A_t = g``, then ``next_value = V_t``; tokens off the mask
    (environment tokens between turns, padding) leave both unchanged, so the recursion runs over the
    assistant's tokens across turns and the value after a gap is the next assistant token's. The value
    past a row's last mask token is 0 (also for a truncated response: no bootstrap). Rewards and values
    off the mask are ignored."""
    _check_number("gamma", gamma, " in [0, 1]", lambda v: 0 <= v <= 1)
    _check_number("lam", lam, " in [0, 1]", lambda v: 0 <= v <= 1)
    valid = _valid(mask)
    r = _masked64("token_rewards", token_rewards, valid)
    v = _masked64("values", values, valid)
    next_value = torch.zeros(valid.shape[0], dtype=torch.float64, device=v.device)
    g = torch.zeros_like(next_value)
    adv = torch.zeros_like(v)
    for t in reversed(range(valid.shape[1])):
        m = valid[:, t]
        g = torch.where(m, r[:, t] + gamma * next_value - v[:, t] + gamma * lam * g, g)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, g, torch.zeros_like(g))
    returns = torch.where(valid, adv + v, torch.zeros_like(adv))
    dtype = _out_dtype(token_rewards, values)
    return adv.to(dtype), returns.to(dtype)


@torch.no_grad()
def remax_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """ReMax [N, T]: on each mask token the sum of the row's mask-token rewards from t on (gamma 1)
    minus ``baseline[i]`` [N] (the greedy sample's reward); 0 where the mask is 0. No whitening.
    A row with no mask token is all 0 and its baseline is not read."""
    valid = _valid(mask)
    r = _masked64("token_rewards", token_rewards, valid)
    _check_rows("baseline", baseline, valid.shape[0])
    b = _masked64("baseline", baseline[:, None].expand_as(r), valid)
    to_go = r.flip(1).cumsum(1).flip(1)
    adv = torch.where(valid, to_go - b, torch.zeros_like(r))
    return adv.to(_out_dtype(token_rewards, baseline))


@torch.no_grad()
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the mask tokens of the whole batch (unbiased variance),
    0 where the mask is 0. ``shift_mean=False`` adds the mean back (rescale only).

    Fewer than 2 mask tokens (no variance): no scaling; with one token ``shift_mean`` gives 0 there
    (``x - mean``) and ``shift_mean=False`` gives ``x`` unchanged; with none, all zeros."""
    _check_number("eps", eps, " >= 0", lambda v: v >= 0)
    valid = _valid(mask)
    x64 = _masked64("x", x, valid)
    n = int(valid.sum())
    mean = x64[valid].sum() / max(n, 1)  # sums over x[mask] only: padding cannot change even the rounding
    centred = torch.where(valid, x64 - mean, torch.zeros_like(x64))
    if n >= 2:
        centred = centred * torch.rsqrt((centred[valid] ** 2).sum() / (n - 1) + eps)
    out = centred if shift_mean else torch.where(valid, centred + mean, torch.zeros_like(x64))
    return out.to(_out_dtype(x))


# ---- statistics and the value loss -----------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` [N, T] over the mask tokens, a scalar in x's floating dtype (0 for an empty
    mask); differentiable w.r.t. ``x`` (0 gradient off the mask)."""
    valid = _valid(mask)
    x64 = _masked64("x", x, valid)
    return (x64[valid].sum() / max(int(valid.sum()), 1)).to(_out_dtype(x))


def clipped_value_loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                             mask: torch.Tensor, *, cliprange_value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token [N, T]: the value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)`` with
    ``v_clip = clamp(v, v_old - eps, v_old + eps)``, and a bool that is True where the clipped term is
    strictly larger (those tokens get a zero gradient); both 0 / False where the mask is 0.
    ``cliprange_value`` None: ``0.5 * (v - R)^2`` and nothing clipped. A caller sums or averages the
    terms as its loss aggregation and micro-batching need (:func:`clipped_value_loss` is the token mean).

    The value itself is clamped: a value inside the band comes back bit for bit, so it is never
    counted as clipped (``v_old + clamp(v - v_old)`` rounds away from ``v`` when ``|v|`` is small
    beside ``|v - v_old|``, and such a token would look clipped).

    The loss terms (values' dtype) are differentiable w.r.t. ``values``; the flags carry no gradient.
    ``old_values`` and ``returns`` must be finite on mask tokens (ValueError). A non-finite value on a
    mask token is not refused here: its term comes out non-finite, so that workers that step together
    can flag it and skip the step on every rank rather than one of them raising alone."""
    if cliprange_value is not None:
        _check_number("cliprange_value", cliprange_value, " >= 0", lambda v: v >= 0)
    valid = _valid(mask)
    if not isinstance(values, torch.Tensor) or values.shape != valid.shape:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"values has shape {got}, expected {tuple(valid.shape)} (the mask's)")
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    v = torch.where(valid, values.to(torch.float64), zero)
    old = _masked64("old_values", old_values, valid).detach()
    ret = _masked64("returns", returns, valid).detach()
    unclipped = (v - ret) ** 2
    if cliprange_value is None:
        per_token, clipped_more = unclipped, torch.zeros_like(valid)
    else:
        v_clip = torch.minimum(torch.maximum(v, old - cliprange_value), old + cliprange_value)
        clipped = (v_clip - ret) ** 2
        clipped_more = (clipped > unclipped) & valid
        per_token = torch.where(clipped_more, clipped, unclipped)
    terms = torch.where(valid, 0.5 * per_token, zero)
    return terms.to(_out_dtype(values)), clipped_more


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       *, cliprange_value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token mean over the mask of :func:`clipped_value_loss_terms`, and the clip fraction: the
    share of mask tokens whose clipped term is strictly larger. Summed in float64.

    All [N, T]. The loss (values' dtype) is differentiable w.r.t. ``values``; an empty mask gives 0,
    still connected to ``values``. The clip fraction is a scalar without gradient. Unlike the terms,
    non-finite values on mask tokens raise ValueError here."""
    valid = _valid(mask)
    _masked64("values", values, valid)
    terms, clipped_more = clipped_value_loss_terms(values.to(torch.float64), old_values, returns, mask,
                                                   cliprange_value=cliprange_value)
    n = max(int(valid.sum()), 1)
    loss = terms[valid].sum() / n
    clipfrac = clipped_more.to(torch.float64).sum() / n
    return loss.to(_out_dtype(values)), clipfrac.to(_out_dtype(values))


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over the mask tokens (both variances unbiased); NaN when there are
    fewer than 2 mask tokens or ``Var[R] == 0``."""
    valid = _valid(mask)
    v = _masked64("values", values, valid)[valid]
    r = _masked64("returns", returns, valid)[valid]
    if r.numel() < 2 or (var_r := float(r.var(unbiased=True))) == 0.0:
        return float("nan")
    return 1.0 - float((r - v).var(unbiased=True)) / var_r


# ---- KL coefficient controllers --------------------------------------------------------------------
class FixedKLController:
    """A constant KL-in-reward coefficient. ``update`` only checks its inputs; ``load_state_dict``
    checks the dict and keeps the configured coefficient (a resumed run uses its config's)."""

    name = "fixed"

    def __init__(self, init_coef: float):
        _check_number("init_coef", init_coef, " >= 0", lambda v: v >= 0)
        self.coef = float(init_coef)

    def update(self, measured_kl: float, n_samples: int) -> None:
        _check_number("measured_kl", measured_kl, " (the coefficient is kept)")
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
            raise ValueError(f"n_samples must be an int >= 0, got {n_samples!r}")

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.name, "coef": self.coef}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if not isinstance(d, dict) or "coef" not in d:
            raise ValueError(f"a KL controller state must be a dict with 'coef', got {d!r}")
        _check_number("coef in the KL controller state", d["coef"], " >= 0", lambda v: v >= 0)


class AdaptiveKLController(FixedKLController):
    """Proportional control of the coefficient towards ``target_kl``: after a batch of ``n_samples``
    samples whose KL was ``measured_kl``, ``e = clip(measured_kl / target_kl - 1, -0.2, 0.2)`` and
    ``coef *= 1 + e * n_samples / horizon`` (floored at 0). ``load_state_dict`` restores the coefficient."""

    name = "adaptive"

    def __init__(self, init_coef: float, target_kl: float, horizon: int):
        super().__init__(init_coef)
        _check_number("target_kl", target_kl, " > 0", lambda v: v > 0)
        _check_horizon(horizon)
        self.target_kl, self.horizon = float(target_kl), horizon

    def update(self, measured_kl: float, n_samples: int) -> None:
        super().update(measured_kl, n_samples)  # checks the inputs
        error = min(max(measured_kl / self.target_kl - 1.0, -ADAPTIVE_KL_ERROR_CLIP), ADAPTIVE_KL_ERROR_CLIP)
        self.coef = max(self.coef * (1.0 + error * n_samples / self.horizon), 0.0)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.coef = float(d["coef"])


def make_kl_controller(controller: str, init_coef: float, target_kl: float | None,
                       horizon: int) -> FixedKLController:
    """``"fixed"`` or ``"adaptive"``. ``target_kl`` (> 0; None only for "fixed") and ``horizon`` (> 0)
    are checked for both, so a bad config fails whichever controller it names."""
    if controller not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {controller!r}; allowed: {list(KL_CONTROLLERS)}")
    if target_kl is not None:
        _check_number("target_kl", target_kl, " > 0", lambda v: v > 0)
    _check_horizon(horizon)
    if controller == "fixed":
        return FixedKLController(init_coef)
    if target_kl is None:
        raise ValueError("the adaptive KL controller needs target_kl")
    return AdaptiveKLController(init_coef, target_kl, horizon)
