"""The ``loss_fn:`` config section of the GRPO/PPO policy-gradient loss, and its validation.

Kept apart from the loss arithmetic (``pg_terms.py``) so that the config schema and its rules can be
read in one place; ``loss_functions.py`` re-exports ``ClippedPGLossConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from nemo_like.algorithms.policy_losses import LOSSES, POLICY_LOSSES
from nemo_like.utils.options import apply_registered_options

__all__ = ["ClippedPGLossConfig", "resolve_pg_loss_config"]


class ClippedPGLossConfig(BaseModel):
    """The ``loss_fn:`` config section (policy-gradient surrogate + k3 KL to a reference).

    ``name`` picks the registered loss (``get_loss_fn(name, config)``); ``policy_loss`` the
    registered surrogate (``policy_losses.py``): "ppo_clip" (token ratio, clipped), "gspo" (sequence
    ratio, clipped), "cispo" (clipped ratio as a constant weight on the logprob), or one of yours.
    Keys this model does not define are the options the selected loss and surrogate declared
    (``nemo_like.utils.options``), checked and typed here. ``truncated_importance_sampling_ratio``
    caps and ``importance_sampling_mask`` filters the IS weight of
    ``use_importance_sampling_correction``; ``loss_length_normalizer`` selects the Dr.GRPO
    reduction (a constant length instead of the token or sequence counts).
    """

    # "allow": a registered loss's or surrogate's own options; _combinations checks them.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    # The registered loss: clipped_pg (policy-gradient surrogate + KL to the reference), nll, trajectory_pg,
    # or one of yours (register_loss).
    name: str = Field("clipped_pg", min_length=1)
    # The registered surrogate: ppo_clip (token ratio, clipped), gspo (sequence ratio, clipped), cispo
    # (clipped ratio as a constant weight on the log-prob), or one of yours (register_policy_loss).
    policy_loss: str = Field("ppo_clip", min_length=1)
    # The probability ratio is clipped below at 1 - this (epsilon low).
    ratio_clip_min: float = Field(0.2, ge=0.0, allow_inf_nan=False)
    # The probability ratio is clipped above at 1 + this (epsilon high; DAPO's clip-higher raises it).
    ratio_clip_max: float = Field(0.2, ge=0.0, allow_inf_nan=False)
    # Dual clip (ppo_clip only, > 1): a negative-advantage token's loss is at most -A x this. null: off.
    ratio_clip_c: float | None = Field(None, allow_inf_nan=False)
    # Coefficient of the per-token k3 KL to the reference policy (the initial weights) added to the loss;
    # 0 turns the term off and skips the reference model and its log-prob pass.
    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, allow_inf_nan=False)
    # Weight the KL term by exp(current - generation log-prob) (no gradient): an estimate of the KL under
    # the current policy rather than under the sampler that generated the tokens.
    use_on_policy_kl_approximation: bool = False
    # Weight each token's policy-gradient loss by exp(old - generation log-prob) (no gradient): corrects
    # for the sampler's log-probs differing from the trainer's (other numerics, or older weights).
    use_importance_sampling_correction: bool = False
    # Cap the importance-sampling weight at this (truncated IS); needs use_importance_sampling_correction.
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # [low, high]: tokens whose importance-sampling weight lies outside get weight 0 (they stay in the
    # loss's denominators); needs use_importance_sampling_correction.
    importance_sampling_mask: tuple[float, float] | None = None
    # True: the loss is the mean over the batch's tokens (every token counts the same). False: the mean
    # of each sample's token mean (every sample counts the same). Ignored with loss_length_normalizer.
    token_level_loss: bool = True
    # Dr.GRPO reduction: the summed token loss divided by (samples x this constant length) instead of by
    # token or sample counts; null: off. Strict: a bool or a float such as 1e3 here is more likely a slip.
    loss_length_normalizer: int | None = Field(None, ge=1, strict=True)

    @field_validator("ratio_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        # c <= 1 would cap the loss of negative-advantage tokens at or below the ordinary clip,
        # silently turning the surrogate into something else.
        if value is not None and not value > 1.0:
            raise ValueError(f"ratio_clip_c (dual-clip bound) must be > 1 when set, got {value}")
        return value

    @field_validator("importance_sampling_mask")
    @classmethod
    def _mask_bounds(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is None:
            return None
        low, high = value
        # inf would not survive a JSON dump of the run config; NaN makes every comparison false.
        if not all(abs(b) < float("inf") for b in value):
            raise ValueError(f"importance_sampling_mask bounds must be finite, got {list(value)}")
        if not 0.0 <= low < high:
            raise ValueError(
                f"importance_sampling_mask must be [low, high] with 0 <= low < high, got {list(value)}"
            )
        return value

    @model_validator(mode="after")
    def _combinations(self) -> ClippedPGLossConfig:
        try:
            POLICY_LOSSES.get(self.policy_loss)
        except KeyError as e:
            raise ValueError(f"loss_fn.policy_loss: {e.args[0]}") from None
        apply_registered_options(self, "loss_fn", [(LOSSES, self.name), (POLICY_LOSSES, self.policy_loss)])
        # Each of these would otherwise be silently ignored by the loss.
        if self.ratio_clip_c is not None and self.policy_loss != "ppo_clip":
            raise ValueError(
                f"ratio_clip_c (dual clip) applies to policy_loss 'ppo_clip' only; got "
                f"policy_loss={self.policy_loss!r} with ratio_clip_c={self.ratio_clip_c}"
            )
        if not self.use_importance_sampling_correction:
            for key in ("truncated_importance_sampling_ratio", "importance_sampling_mask"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{key} acts on the importance-sampling weight: it needs "
                        "use_importance_sampling_correction: true"
                    )
        return self


def resolve_pg_loss_config(config: ClippedPGLossConfig | Mapping[str, Any]) -> ClippedPGLossConfig:
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
