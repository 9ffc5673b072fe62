"""Typed environment configs: what ``env.<name>.*`` may hold, checked before Ray starts.

An environment class declares ``config_model = MyEnvConfig`` (a subclass of :class:`EnvConfig`);
``nemo_like.config`` validates ``env.<name>`` against it with the rest of the config, so a typo
(``env.math.timeout``) or a wrong type (``env.math.timeout_s=abc``) fails in a second with the
key's full name instead of inside an actor after the cluster started. An environment without a
``config_model`` keeps receiving its mapping unchecked.

Imports pydantic only (no torch, no ray): the grader processes import environment modules.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_like.utils.options import format_option_errors

__all__ = ["EnvConfig", "TRAINER_SIDE_KEYS", "validate_env_config", "env_config_errors"]

# Keys read by the trainer, not by the environment: they are stripped before the actor is built.
TRAINER_SIDE_KEYS = ("step_timeout_s",)


class EnvConfig(BaseModel):
    """Base of every typed environment config: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # Wall-clock limit of one ``step`` call as the trainer waits for it; past it the samples are
    # unscorable and the actor is restarted. None: ``grpo.env_step_timeout_s``.
    step_timeout_s: float | None = Field(default=None, gt=0)


class EpisodeEnvConfig(EnvConfig):
    """What every environment whose episodes talk to the trainer's server (agent programs, verifiers)
    is configured with besides its own keys."""

    # Where the trainer's OpenAI-compatible server listens: 127.0.0.1 (this machine), or a node's
    # address for environments on other nodes (a warning is printed).
    host: str = "127.0.0.1"
    # Its port; 0: a free one. A port already taken stops the run before training, in one line.
    port: int = Field(0, ge=0, le=65535)
    # A step in which more than this fraction of the task's episodes failed counts towards
    # grpo.max_consecutive_env_failures (the run stops with one line saying why).
    max_failed_fraction: float = Field(0.5, ge=0, le=1)


def env_config_errors(name: str, model: type[BaseModel], e: ValidationError) -> str:
    """One line naming each bad key as ``env.<name>.<key>``, with a did-you-mean for typos."""
    return format_option_errors(f"env.{name}", e, model.model_fields)


def validate_env_config(name: str, model: type[EnvConfig], config: Any) -> EnvConfig:
    """``config`` parsed by ``model``; raises ``ValueError`` with one line naming ``env.<name>.<key>``
    (``TypeError`` when ``config`` is not a dict at all)."""
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise TypeError(f"env.{name}: expected a dict of options, got {type(config).__name__}")
    try:
        return model.model_validate(config)
    except ValidationError as e:
        raise ValueError(env_config_errors(name, model, e)) from None
