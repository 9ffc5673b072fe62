"""Advantage estimators and their registry.

Every registered estimator is called by the trainer as::

    estimator(rewards: Tensor[N], group_ids: Tensor[N], *, config, token_mask: Tensor[N, T] | None = None)
        -> Tensor[N]

``config`` is the run's ``grpo`` config section: an estimator reads what it needs with ``getattr``
and a default, so a new estimator is one decorated function (``@register_advantage_estimator("x")``)
and no edit to the trainer. ``token_mask`` is for estimators that need the sequence lengths; the
built-ins are sequence-level and ignore it. Samples generated from the same prompt share a group id;
groups may have any size and appear in any order.

Rewards must be finite: the trainer passes only the samples some reward function could score. A
sample whose reward is NaN stays out of every baseline and gets advantage 0 — the trainer does that
masking, not the estimators, which raise ValueError on a non-finite reward. The built-ins compute in
float64, return the rewards' dtype (float32 for integer/bool rewards) and carry no gradient.

Estimators that need more than rewards declare it when registered (``needs=(...)``), and the trainer
passes exactly those, as keyword arguments: ``values`` [N, T] (a critic's, ``values[:, t]`` for the
state that chose token t), ``token_rewards`` [N, T] (the score on each sample's last response token,
minus the KL penalty when ``grpo.kl_in_reward`` is on) and ``greedy_rewards`` [N] (the reward of one
greedy sample of the sample's prompt). Such an estimator may return token-level advantages [N, T]
(zero off ``token_mask``), and a pair ``(advantages, extras)`` where ``extras["returns"]`` [N, T] are
the critic's regression targets.

Built-ins: ``mean`` (= ``dr_grpo``) and ``mean_std`` (group mean and std, no leave-one-out: what
trajectory-level GRPO uses), ``grpo`` (:func:`compute_grpo_advantages` with ``use_leave_one_out_baseline`` and
``std_scale``), ``dr_grpo`` (reward minus group mean, no std: Dr. GRPO), ``rloo`` (reward minus the
mean of the group's other members) and ``reinforce_pp`` (group-centred, then normalised over the
batch: REINFORCE++ baseline); ``gae`` (needs values and token rewards: generalised advantage
estimation with ``grpo.gae``'s gamma and lam, returns for the critic, advantages whitened over the
batch's response tokens) and ``remax`` (needs token rewards and greedy rewards: reward-to-go minus
the greedy sample's reward, no critic, no whitening).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from nemo_like.algorithms.ppo_terms import compute_gae, masked_whiten, remax_advantages
from nemo_like.utils.registry import Registry

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


def compute_rloo_advantages(
    rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """RLOO: ``r_i`` minus the mean of the *other* members of its group; a group of one gets 0."""
    return compute_grpo_advantages(rewards, group_ids, leave_one_out=True, std_scale=None)


def compute_reinforce_pp_advantages(
    rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int], *, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: ``a = r - group mean``, then over the whole batch
    ``(a - mean(a)) / (std(a) + eps)`` with the unbiased std; only ``a - mean(a)`` when that std is
    0 or N < 2 (nothing to scale by)."""
    if not (eps >= 0.0 and eps != float("inf")):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    rewards_t = _as_1d("rewards", rewards)
    out_dtype = rewards_t.dtype if rewards_t.is_floating_point() else torch.float32
    # Centred in float64 (compute_grpo_advantages returns its input's dtype) so that the batch
    # normalisation does not amplify float32 rounding.
    a = compute_grpo_advantages(rewards_t.detach().to(torch.float64), group_ids, leave_one_out=False,
                                std_scale=None)
    if a.shape[0] == 0:
        return a.to(out_dtype)
    a = a - a.mean()
    if a.shape[0] > 1:
        std = float(a.std(unbiased=True))
        if std > 0:
            a = a / (std + eps)
    return a.to(out_dtype)


_E = TypeVar("_E", bound=AdvantageEstimator)


def _check_estimator(name: str, fn: Any) -> None:
    # Checked when registered, so a wrong signature fails at import, not at the first training step.
    if not callable(fn):
        raise TypeError(f"advantage estimator {name!r} must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to inspect
        return
    try:
        signature.bind(None, None, config=None, token_mask=None)
    except TypeError as e:
        raise TypeError(f"advantage estimator {name!r} must accept (rewards, group_ids, *, config, "
                        f"token_mask=None): {e}") from None


# Tests keep their registrations local with ``with ADVANTAGE_ESTIMATORS.isolated(): ...``.
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", check=_check_estimator)


# What each estimator needs beyond (rewards, group_ids, config, token_mask); see the module docstring.
ESTIMATOR_INPUTS = ("values", "token_rewards", "greedy_rewards")
_NEEDS: dict[str, tuple[str, ...]] = {}


def register_advantage_estimator(name: str, fn: AdvantageEstimator | str | None = None, *,
                                 needs: Sequence[str] = (), options: Any = None, overwrite: bool = False) -> Any:
    """Register ``fn(rewards, group_ids, *, config, token_mask=None, **needed) -> Tensor[N]`` (or
    [N, T], or ``(advantages, extras)``) under ``name``: ``@register_advantage_estimator("x")`` or
    ``register_advantage_estimator("x", fn_or_import_path)``. ``needs``: inputs from
    ``ESTIMATOR_INPUTS`` the trainer must compute and pass. ``options``: a pydantic model of the
    estimator's own keys, written under ``grpo:`` and read as ``config.<key>`` (checked before Ray
    starts, see ``nemo_like.utils.options``). The same definition again is a no-op; another one needs
    ``overwrite=True``."""
    needs = tuple(needs)
    if unknown := [n for n in needs if n not in ESTIMATOR_INPUTS]:
        raise ValueError(f"advantage estimator {name!r}: unknown inputs {unknown}; an estimator may need "
                         f"{list(ESTIMATOR_INPUTS)}")
    registered = ADVANTAGE_ESTIMATORS.register(name, fn, overwrite=overwrite, options=options)
    _NEEDS[name] = needs
    return registered


def estimator_needs(name: str) -> tuple[str, ...]:
    """The inputs estimator ``name`` declared (KeyError with a did-you-mean if unknown)."""
    get_advantage_estimator(name)
    return _NEEDS.get(name, ())


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; KeyError with a did-you-mean if unknown."""
    return ADVANTAGE_ESTIMATORS.get(name)


def registered_advantage_estimators() -> list[str]:
    return ADVANTAGE_ESTIMATORS.names()


@register_advantage_estimator("grpo")
def grpo_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                   token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`compute_grpo_advantages` with ``config.use_leave_one_out_baseline`` (default True) and
    ``config.std_scale`` (default "group")."""
    return compute_grpo_advantages(rewards, group_ids,
                                   leave_one_out=getattr(config, "use_leave_one_out_baseline", True),
                                   std_scale=getattr(config, "std_scale", "group"))


@register_advantage_estimator("dr_grpo")
def dr_grpo_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                      token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reward minus the group mean: no std division (its per-group scaling biases toward groups
    that are nearly all right or all wrong) and no leave-one-out; ignores the config."""
    return compute_grpo_advantages(rewards, group_ids, leave_one_out=False, std_scale=None)


# The names trajectory-level GRPO uses (``grpo.advantage_estimator`` of a gym config): ``mean`` is dr_grpo.
register_advantage_estimator("mean", dr_grpo_estimator)


@register_advantage_estimator("mean_std")
def mean_std_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                       token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` (unbiased std; a group with equal rewards gets 0), no
    leave-one-out; ``eps`` from ``config.adv_eps`` (default 1e-6)."""
    return compute_grpo_advantages(rewards, group_ids, leave_one_out=False, std_scale="group",
                                   eps=getattr(config, "adv_eps", 1e-6))


@register_advantage_estimator("rloo")
def rloo_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                   token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`compute_rloo_advantages`; ignores the config."""
    return compute_rloo_advantages(rewards, group_ids)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                           token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`compute_reinforce_pp_advantages` with its default eps; ignores the config."""
    return compute_reinforce_pp_advantages(rewards, group_ids)


@register_advantage_estimator("gae", needs=("values", "token_rewards"))
def gae_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                  token_mask: torch.Tensor | None = None, values: torch.Tensor | None = None,
                  token_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Generalised advantage estimation over the response tokens (``token_mask``; environment tokens
    between turns are skipped, so the recursion runs over the assistant's tokens across turns), with
    ``config.gae``'s ``gamma``, ``lam`` and ``whiten_advantages``. The value past a sample's last token
    is 0, also when the sample was cut at the length limit (no bootstrap). Returns the advantages
    [N, T] and ``{"returns": advantages + values}`` (before whitening) for the critic."""
    if values is None or token_rewards is None or token_mask is None:
        raise ValueError("the gae estimator needs values, token_rewards and token_mask")
    gae = getattr(config, "gae", None)
    advantages, returns = compute_gae(token_rewards, values, token_mask, gamma=getattr(gae, "gamma", 1.0),
                                      lam=getattr(gae, "lam", 0.95))
    if getattr(gae, "whiten_advantages", True):
        advantages = masked_whiten(advantages, token_mask)
    return advantages, {"returns": returns}


@register_advantage_estimator("remax", needs=("token_rewards", "greedy_rewards"))
def remax_estimator(rewards: torch.Tensor, group_ids: torch.Tensor, *, config: Any = None,
                    token_mask: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None,
                    greedy_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """ReMax: each token's reward-to-go minus the reward of the prompt's greedy sample (no critic,
    no whitening)."""
    if token_rewards is None or greedy_rewards is None or token_mask is None:
        raise ValueError("the remax estimator needs token_rewards, greedy_rewards and token_mask")
    return remax_advantages(token_rewards, token_mask, greedy_rewards)
