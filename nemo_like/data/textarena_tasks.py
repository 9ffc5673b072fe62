"""TextArena games as a task source (``generator: {kind: textarena, ...}``): one row per episode.

Placeholder written by the integrator; the TextArena helper replaces the body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["TextArenaConfig", "generate_textarena_dataset"]


class TextArenaConfig(BaseModel):
    """``data.<split>.generator`` for TextArena games."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["textarena"]
    game: str  # a TextArena environment id, e.g. "GuessTheNumber-v0"
    options: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of the game
    split: Literal["train", "validation"]
    num_samples: int = Field(gt=0)
    seed: int = 0


def generate_textarena_dataset(cfg: TextArenaConfig) -> Any:
    raise NotImplementedError("textarena rows")
