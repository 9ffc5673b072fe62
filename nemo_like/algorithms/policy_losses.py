"""Policy-gradient surrogates (``loss_fn.policy_loss``) and their registry.

Every surrogate has one signature::

    surrogate(curr, prev, advantages, mask, config) -> (pg, ratio, ratio_clamped)

- ``curr`` [B, T]: the trained policy's log-probs of the sampled tokens (with gradient);
- ``prev`` [B, T]: the old (proximal) policy's log-probs, no gradient;
- ``advantages`` [B, T]: already broadcast over tokens;
- ``mask`` [B, T] float: 1 on the tokens that count; all four are 0 off the mask already;
- ``config``: the ``loss_fn`` section (``ClippedPGLossConfig``), with the surrogate's own options
  as attributes (``config.tau``) when it declared an options model;
- returns the per-token loss ``pg`` [B, T] (to be minimised; the IS weight, KL term, mask and
  reduction are applied by the caller, ``pg_terms.pg_token_terms``), and the ratio before and after
  clipping [B, T] for the metrics (``clip_fraction`` counts ``ratio != ratio_clamped``).

A new surrogate is one function and one registration, with no edit to a schema::

    class SapoOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        tau: float = Field(1.0, gt=0)

    @register_policy_loss("sapo", options=SapoOptions)
    def sapo(curr, prev, advantages, mask, config):
        ...

then ``loss_fn.policy_loss=sapo loss_fn.tau=0.5``. The surrogate is resolved in the driver and
travels to the workers with the loss object, so a surrogate registered in a notebook cell or a
``--import``-ed module reaches them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nemo_like.utils.registry import Registry

__all__ = ["LOSSES", "POLICY_LOSSES", "PolicyLossFn", "check_loss_name", "get_loss_fn", "get_policy_loss",
           "register_loss", "register_policy_loss", "registered_losses"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _check(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"policy loss {name!r} must be callable as fn(curr, prev, advantages, mask, config), "
                        f"got {type(fn).__name__}")


# Tests keep their registrations local with ``with POLICY_LOSSES.isolated(): ...``.
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", check=_check)


def register_policy_loss(name: str, fn: PolicyLossFn | str | None = None, *, options: Any = None,
                         overwrite: bool = False) -> Any:
    """``@register_policy_loss(name, options=Model)`` on a surrogate, or
    ``register_policy_loss(name, fn_or_import_path)``. ``options``: a pydantic model of the keys it
    reads from ``loss_fn`` (checked before Ray starts). The same definition again is a no-op; another
    one needs ``overwrite=True``."""
    return POLICY_LOSSES.register(name, fn, overwrite=overwrite, options=options)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The surrogate registered under ``name``; KeyError with a did-you-mean if unknown."""
    return POLICY_LOSSES.get(name)


# ---- losses (``loss_fn.name``): factories of loss objects ------------------------------------------
def _check_factory(name: str, obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"loss {name!r} must be a class or factory called as factory(config), "
                        f"got {type(obj).__name__}")


LOSSES: Registry[Callable[..., Any]] = Registry("loss", check=_check_factory, builtins={
    "clipped_pg": "nemo_like.algorithms.loss_functions.ClippedPGLossFn",
    "nll": "nemo_like.algorithms.loss_functions.NLLLossFn",
    # REINFORCE on whole trajectories (trajectory-level GRPO for step-environment agents).
    "trajectory_pg": "nemo_like.gym.loss.TrajectoryPGLossFn",
})


def register_loss(name: str, target: Any = None, *, options: Any = None, overwrite: bool = False) -> Any:
    """``@register_loss(name)`` on a loss class or factory, or ``register_loss(name, obj_or_path)``.

    The factory is called as ``factory(config)`` when ``get_loss_fn`` gets a config, else
    ``factory()``; the trainer passes the ``loss_fn`` section, whose keys beyond its own are the
    ``options`` model's (checked before Ray starts). Another object under a taken name needs
    ``overwrite=True`` (ValueError otherwise; re-registering the same definition is a no-op).
    """
    return LOSSES.register(name, target, overwrite=overwrite, options=options)


def get_loss_fn(name: str, config: Any = None) -> Any:
    """Build the loss registered under ``name`` (the trainer: ``get_loss_fn(cfg.loss_fn.name,
    cfg.loss_fn)``); KeyError naming the registered losses and the closest one if unknown."""
    factory = LOSSES.get(name)
    return factory(config) if config is not None else factory()


def check_loss_name(name: str) -> None:
    """KeyError (with a did-you-mean) unless a loss is registered under ``name``; for config
    validation, before anything is built."""
    if name not in LOSSES:
        LOSSES.get(name)  # raises the registry's KeyError


def registered_losses() -> list[str]:
    return LOSSES.names()


# ---- the built-in surrogates -----------------------------------------------------------------------
def _clip_bounds(config: Any) -> tuple[float, float]:
    return 1.0 - config.ratio_clip_min, 1.0 + config.ratio_clip_max


@register_policy_loss("ppo_clip")
def ppo_clip(curr: torch.Tensor, prev: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped surrogate per token: ``max(-A r, -A clamp(r))`` with
    ``r = exp(curr - prev)``; dual clip (``ratio_clip_c``): where A < 0, at most ``-A c``."""
    ratio = torch.exp(curr - prev)
    ratio_clamped = ratio.clamp(*_clip_bounds(config))
    pg = torch.maximum(-advantages * ratio, -advantages * ratio_clamped)
    if config.ratio_clip_c is not None:
        # Dual clip: bound the loss of negative-advantage tokens whose ratio exploded.
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * config.ratio_clip_c), pg)
    return pg, ratio, ratio_clamped


@register_policy_loss("gspo")
def gspo(curr: torch.Tensor, prev: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO: one ratio per sequence, the exp of its mask-weighted mean token log-ratio (gradient
    through it), clipped as a whole: ``max(-A s, -A clamp(s))`` on each of its tokens."""
    seq_len = mask.sum(dim=-1, keepdim=True)
    # Rows without tokens divide 0 by 1.
    seq_log_ratio = ((curr - prev) * mask).sum(dim=-1, keepdim=True) / torch.where(
        seq_len != 0, seq_len, torch.ones_like(seq_len))
    ratio = torch.exp(seq_log_ratio).expand_as(curr)
    ratio_clamped = ratio.clamp(*_clip_bounds(config))
    return torch.maximum(-advantages * ratio, -advantages * ratio_clamped), ratio, ratio_clamped


@register_policy_loss("cispo")
def cispo(curr: torch.Tensor, prev: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: ``-A * sg(clamp(r)) * curr``; the clipped ratio is only a weight, so every token keeps
    its gradient through ``curr`` (unlike PPO, where a clipped token's gradient is 0)."""
    ratio = torch.exp(curr - prev)
    ratio_clamped = ratio.clamp(*_clip_bounds(config))
    return -advantages * ratio_clamped.detach() * curr, ratio, ratio_clamped
