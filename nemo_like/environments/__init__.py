"""Environments: graders and interactive tasks, run as restartable Ray actors.

Kept import-light on purpose (no torch, ray or sympy here): the math grader's worker processes
import this package and must start quickly.
"""

from nemo_like.environments.env_config import EnvConfig
from nemo_like.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    assistant_turns,
    last_assistant_text,
    normalize_step_inputs,
    required_assistant_text,
)
from nemo_like.environments.registry import create_env_actor, get_env_class, register_env, registered_envs

__all__ = [
    "EnvConfig",
    "EnvironmentInterface",
    "EnvironmentReturn",
    "assistant_turns",
    "last_assistant_text",
    "normalize_step_inputs",
    "required_assistant_text",
    "create_env_actor",
    "get_env_class",
    "register_env",
    "registered_envs",
]
