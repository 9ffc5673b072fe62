"""Environment registry: task/env name -> environment class -> restartable Ray actor.

Entries may be classes or import paths ("pkg.mod.Class" or "pkg.mod:Class"). Import paths are
resolved only when an environment is requested, so registering the built-ins costs nothing:
importing this module does not import sympy (math) or any sandbox machinery (code/tool), and
a user can register "my_pkg.my_env.MyEnvironment" before my_pkg is even importable here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from nemo_like.utils.registry import Registry

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["ENV_REGISTRY", "register_env", "get_env_class", "env_config_model", "create_env_actor",
           "registered_envs"]


def _check_env_class(name: str, obj: Any) -> None:
    # Runs on registration (a class) and on first lookup (what an import path resolved to).
    if not isinstance(obj, type):
        raise TypeError(f"environment {name!r}: {obj!r} is a {type(obj).__name__}, not a class "
                        "(register a class or an import path 'pkg.module.ClassName')")
    if not callable(getattr(obj, "step", None)):
        raise TypeError(f"environment {name!r}: class {obj.__qualname__} has no step() method")


# Tests and notebooks keep their registrations local with ``with ENV_REGISTRY.isolated(): ...``.
ENV_REGISTRY: Registry[type] = Registry("environment", check=_check_env_class, builtins={
    "math": "nemo_like.environments.math_environment.MathEnvironment",
    "code": "nemo_like.environments.code_environment.CodeEnvironment",
    "tool": "nemo_like.environments.tool_environment.ToolEnvironment",
    "reward_fn": "nemo_like.environments.reward_fn_environment.RewardFnEnvironment",
    "reasoning_gym": "nemo_like.environments.reasoning_gym_environment.ReasoningGymEnvironment",
    "agent": "nemo_like.environments.agent_environment.AgentEnvironment",
    # Environments of other libraries and services (docs/guides/environments.md).
    "verifiers": "nemo_like.environments.verifiers_environment.VerifiersEnvironment",
    "textarena": "nemo_like.environments.textarena_environment.TextArenaEnvironment",
    "http": "nemo_like.environments.http_environment.HttpEnvironment",
})


@overload
def register_env(name: str, cls_or_import_path: type | str, *, overwrite: bool = False) -> type | str: ...
@overload
def register_env(name: str, cls_or_import_path: None = None, *, overwrite: bool = False) -> Callable[[type], type]: ...


def register_env(
    name: str, cls_or_import_path: type | str | None = None, *, overwrite: bool = False
) -> type | str | Callable[[type], type]:
    """Register an environment under ``name``.

    ``register_env("my_task", "my_pkg.my_env.MyEnvironment")`` or ``register_env("my_task", MyEnv)``,
    or as a class decorator ``@register_env("my_task")``. Re-registering a name with the same
    target is a no-op; a different target needs ``overwrite=True`` (a silent swap of the grader
    behind a task name would change the reward without anybody noticing).
    """
    return ENV_REGISTRY.register(name, cls_or_import_path, overwrite=overwrite)


def registered_envs() -> list[str]:
    """Sorted names of all registered environments."""
    return ENV_REGISTRY.names()


def get_env_class(name: str) -> type:
    """The class registered under ``name`` (import paths are imported now and cached)."""
    return ENV_REGISTRY.get(name)


def env_config_model(name: str) -> type | None:
    """The typed config (an ``EnvConfig`` subclass) the environment ``name`` declares as
    ``config_model``, or None: not registered (a user may register it later, before setup), or a
    class that takes its mapping unchecked."""
    if name not in ENV_REGISTRY:
        return None
    return getattr(get_env_class(name), "config_model", None)


def create_env_actor(
    name: str, config: dict | None = None, *, actor_options: dict[str, Any] | None = None
) -> ActorHandle:
    """Start the environment ``name`` as a Ray actor constructed with ``config``.

    ``max_restarts=-1``/``max_task_retries=2``: a grader that dies (OOM, a killed node) is
    restarted and the in-flight ``step`` retried, so one bad sample cannot end a training run; the
    retries are bounded so a batch that kills its grader every time fails (and scores 0 in the
    trainer) instead of hanging the run.
    ``num_cpus=0``: graders are mostly idle and must never keep the policy workers from being
    scheduled on a small machine. ``actor_options`` overrides any of these (e.g. a code sandbox
    that wants real CPUs, or a ``name`` to look the actor up later). Reward functions and tools
    registered in the driver are registered in the actor too (``user_registrations``).
    """
    import ray  # lazily: the registry is also imported by grader subprocesses that never need ray

    from nemo_like.environments.user_registrations import user_registrations, with_registrations

    cls = get_env_class(name)
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"environment {name!r}: config must be a dict, got {type(config).__name__}")
    options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 2, "num_cpus": 0}
    if getattr(cls, "max_concurrent_steps", 1) > 1:  # a thread-safe step: calls may overlap
        options["max_concurrency"] = int(cls.max_concurrent_steps)
    options.update(actor_options or {})
    # The reward functions and tools the driver registered (a user's module, script or notebook) go
    # along: the actor's fresh process knows only the built-ins.
    actor_cls = with_registrations(cls, user_registrations())
    return ray.remote(actor_cls).options(**options).remote(dict(config or {}))


def step_concurrency(task_envs: dict[str, str]) -> dict[str, int]:
    """Per task, how many ``step`` calls its environment's actor runs at once
    (``EnvironmentInterface.max_concurrent_steps``; 1 for a name that is not registered)."""
    out = {}
    for task, name in task_envs.items():
        try:
            out[task] = max(1, int(getattr(get_env_class(name), "max_concurrent_steps", 1)))
        except KeyError:
            out[task] = 1
    return out
