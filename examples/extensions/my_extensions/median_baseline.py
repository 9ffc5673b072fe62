"""An advantage estimator with an option of its own: reward minus the group's median, scaled.

    --import my_extensions.median_baseline grpo.advantage_estimator=median_baseline grpo.median_scale=2.0
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from my_extensions._trace import trace
from nemo_like.algorithms.advantages import register_advantage_estimator


class MedianOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    median_scale: float = Field(1.0, gt=0)


@register_advantage_estimator("median_baseline", options=MedianOptions)
def median_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, *, config, token_mask=None) -> torch.Tensor:
    """rewards, group_ids: [N]; returns advantages [N]."""
    advantages = torch.zeros(rewards.shape, dtype=torch.float32)
    for g in torch.unique(group_ids):
        members = group_ids == g
        advantages[members] = (rewards[members].float() - rewards[members].float().median()) * config.median_scale
    trace("estimator", f"median_scale={config.median_scale}")
    return advantages
