"""verifiers environments as a task source (``generator: {kind: verifiers, ...}``).

Placeholder written by the integrator; the verifiers helper replaces the body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["VerifiersConfig", "generate_verifiers_dataset"]


class VerifiersConfig(BaseModel):
    """``data.<split>.generator`` for a verifiers environment's dataset."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["verifiers"]
    # An installed environment package (what verifiers' load_environment takes) or a factory
    # "pkg.module:load_environment".
    environment: str
    args: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of the factory
    split: Literal["train", "validation"]
    num_samples: int | None = Field(default=None, gt=0)
    seed: int = 0


def generate_verifiers_dataset(cfg: VerifiersConfig) -> Any:
    raise NotImplementedError("verifiers rows")
