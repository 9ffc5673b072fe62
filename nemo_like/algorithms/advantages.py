"""Advantage estimators (GRPO group-relative advantages) and their registry.

An estimator is ``fn(rewards: Tensor[N], group_ids: Tensor[N], **kwargs) -> Tensor[N]``; samples
generated from the same prompt share a group id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

AdvantageEstimator = Callable[..., torch.Tensor]
_STD_SCALES = ("group", "batch", None)


def _as_1d(name: str, values: torch.Tensor | Sequence[Any]) -> torch.Tensor:
    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(tensor.shape)}")
    return tensor


def compute_grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    *,
    leave_one_out: bool = True,
    std_scale: str | None = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: reward minus a group baseline, optionally divided by a std.

    - Baseline: the group mean, or with ``leave_one_out`` the mean of the group's *other* members
      (``A_i = n/(n-1) * (r_i - mean)``). A group of one always gets advantage 0.
    - ``std_scale="group"``: divide by the group's unbiased std + eps, only where that std is > 0.
      With ``leave_one_out`` the std is still that of *all* the group's rewards (not of the
      other members). A group whose rewards are all equal (max == min) gets exactly 0.
    - ``std_scale="batch"``: divide by the unbiased std of all N rewards + eps (unchanged when it is
      0 or N < 2 — then every advantage is 0 anyway).
    - ``std_scale=None``: no division.

    Groups may have any size and appear in any order (ids are arbitrary integers). Computed in
    float64 and returned in the rewards' dtype (float32 for integer/bool rewards). No gradient.
    """
    if std_scale not in _STD_SCALES:
        raise ValueError(f"std_scale must be 'group', 'batch' or None, got {std_scale!r}")
    if not (eps >= 0.0 and eps != float("inf")):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    rewards_t = _as_1d("rewards", rewards)
    ids = _as_1d("group_ids", group_ids)
    if rewards_t.shape[0] != ids.shape[0]:
        raise ValueError(
            f"rewards has {rewards_t.shape[0]} entries but group_ids has {ids.shape[0]}; "
            "they must match (one group id per sample)"
        )
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"group_ids must be integers, got dtype {ids.dtype}")
    out_dtype = rewards_t.dtype if rewards_t.is_floating_point() else torch.float32
    r = rewards_t.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite at indices {bad}")
    n_total = r.shape[0]
    if n_total == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_t.device)

    _, inverse = torch.unique(ids.to(r.device), return_inverse=True)
    num_groups = int(inverse.max()) + 1
    zeros = torch.zeros(num_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    total = zeros.index_add(0, inverse, r)
    g_count, g_mean = count[inverse], (total / count)[inverse]
    # Exact constancy test: a float mean of equal values can differ from them by an ulp, which
    # would otherwise give tiny nonzero advantages and a ~0/eps blow-up under std scaling.
    g_max = zeros.scatter_reduce(0, inverse, r, reduce="amax", include_self=False)[inverse]
    g_min = zeros.scatter_reduce(0, inverse, r, reduce="amin", include_self=False)[inverse]
    constant = g_max == g_min  # also true for groups of one

    centred = r - g_mean
    if leave_one_out:
        # r_i - (sum - r_i)/(n-1) == n/(n-1) * (r_i - mean); singletons are masked below.
        adv = centred * g_count / (g_count - 1).clamp_min(1)
    else:
        adv = centred
    adv = torch.where(constant, torch.zeros_like(adv), adv)

    if std_scale == "group":
        sq = zeros.index_add(0, inverse, centred * centred)[inverse]
        std = torch.sqrt(sq / (g_count - 1).clamp_min(1))
        adv = torch.where(constant, adv, adv / (std + eps))
    elif std_scale == "batch" and n_total > 1:
        std = float(r.std(unbiased=True))
        if std > 0:
            adv = adv / (std + eps)
    return adv.to(out_dtype)


_E = TypeVar("_E", bound=AdvantageEstimator)
_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[_E], _E]:
    """Decorator registering ``fn(rewards, group_ids, **kwargs) -> Tensor[N]`` under ``name``.

    A different object under a taken name raises ValueError (re-importing the same definition is
    allowed).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"advantage estimator name must be a non-empty string, got {name!r}")

    def decorator(fn: _E) -> _E:
        existing = _ESTIMATORS.get(name)
        if existing is not None and _qualified(existing) != _qualified(fn):
            raise ValueError(
                f"advantage estimator {name!r} is already registered to {_qualified(existing)}"
            )
        _ESTIMATORS[name] = fn
        return fn

    return decorator


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; KeyError listing the registered names if unknown."""
    if name not in _ESTIMATORS:
        raise KeyError(
            f"unknown advantage estimator {name!r}; registered: {sorted(_ESTIMATORS)}"
        )
    return _ESTIMATORS[name]


def registered_advantage_estimators() -> list[str]:
    return sorted(_ESTIMATORS)


register_advantage_estimator("grpo")(compute_grpo_advantages)
