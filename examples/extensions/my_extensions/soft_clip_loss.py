"""A policy-loss surrogate with an option of its own: the ratio is squashed smoothly instead of clipped,
``s = 1 + tau * tanh((r - 1) / tau)``, so far-off tokens keep a shrinking gradient instead of none.

    --import my_extensions.soft_clip_loss loss_fn.policy_loss=soft_clip loss_fn.tau=0.5
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from my_extensions._trace import trace
from nemo_like.algorithms.policy_losses import register_policy_loss


class SoftClipOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau: float = Field(0.2, gt=0)  # half-width of the soft band around ratio 1


@register_policy_loss("soft_clip", options=SoftClipOptions)
def soft_clip(curr: torch.Tensor, prev: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """curr, prev, advantages, mask: [B, T]; returns the per-token loss and the ratio before/after."""
    ratio = torch.exp(curr - prev)
    soft = 1.0 + config.tau * torch.tanh((ratio - 1.0) / config.tau)
    trace("policy_loss", f"tau={config.tau}")
    return -advantages * soft, ratio, soft
