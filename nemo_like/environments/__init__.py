"""Environments: graders and interactive tasks, run as restartable Ray actors.

Kept import-light on purpose (no torch, ray or sympy here): the math grader's worker processes
import this package and must start quickly.
"""

from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.environments.registry import create_env_actor, get_env_class, register_env, registered_envs

__all__ = [
    "EnvironmentInterface",
    "EnvironmentReturn",
    "create_env_actor",
    "get_env_class",
    "register_env",
    "registered_envs",
]
