"""Environment registry: task/env name -> environment class -> restartable Ray actor.

Entries may be classes or import paths ("pkg.mod.Class" or "pkg.mod:Class"). Import paths are
resolved only when an environment is requested, so registering the built-ins costs nothing:
importing this module does not import sympy (math) or any sandbox machinery (code/tool), and
a user can register "my_pkg.my_env.MyEnvironment" before my_pkg is even importable here.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["register_env", "get_env_class", "env_config_model", "create_env_actor", "registered_envs"]

# name -> class or import path; resolved classes replace their paths on first use.
_REGISTRY: dict[str, type | str] = {
    "math": "nemo_like.environments.math_environment.MathEnvironment",
    "code": "nemo_like.environments.code_environment.CodeEnvironment",
    "tool": "nemo_like.environments.tool_environment.ToolEnvironment",
    "reward_fn": "nemo_like.environments.reward_fn_environment.RewardFnEnvironment",
}
_LOCK = threading.Lock()


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"environment name must be a non-empty string, got {name!r}")
    return name


def _check_target(name: str, target: Any) -> type | str:
    if isinstance(target, str):
        module, _, attr = target.replace(":", ".").rpartition(".")
        if not module or not attr:
            raise ValueError(
                f"environment {name!r}: import path {target!r} must look like 'pkg.module.ClassName'"
            )
        return target
    if isinstance(target, type):
        if not callable(getattr(target, "step", None)):
            raise TypeError(f"environment {name!r}: class {target.__qualname__} has no step() method")
        return target
    raise TypeError(
        f"environment {name!r}: expected a class or an import path string, got {type(target).__name__}"
    )


def _same_target(a: type | str, b: type | str) -> bool:
    def key(t: type | str) -> str:
        return t.replace(":", ".") if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"

    return a is b or key(a) == key(b)


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
    _check_name(name)
    if cls_or_import_path is None:

        def decorator(cls: type) -> type:
            register_env(name, cls, overwrite=overwrite)
            return cls

        return decorator

    target = _check_target(name, cls_or_import_path)
    with _LOCK:
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and not _same_target(old, target):
            raise ValueError(
                f"environment {name!r} is already registered to {_describe(old)}; "
                f"pass overwrite=True to replace it with {_describe(target)}"
            )
        _REGISTRY[name] = target
    return cls_or_import_path


def _describe(target: type | str) -> str:
    return repr(target) if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"


def registered_envs() -> list[str]:
    """Sorted names of all registered environments."""
    with _LOCK:
        return sorted(_REGISTRY)


def _resolve(name: str, path: str) -> type:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while executing the module
        raise ImportError(
            f"environment {name!r}: cannot import module {module_name!r} (from {path!r}): "
            f"{type(e).__name__}: {e}"
        ) from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ImportError(f"environment {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, type):
        raise TypeError(f"environment {name!r}: {path!r} is a {type(obj).__name__}, not a class")
    return obj


def get_env_class(name: str) -> type:
    """The class registered under ``name`` (import paths are imported now and cached)."""
    _check_name(name)
    with _LOCK:
        target = _REGISTRY.get(name)
        known = sorted(_REGISTRY)
    if target is None:
        raise KeyError(f"unknown environment {name!r}; registered environments: {known}")
    if isinstance(target, type):
        return target
    cls = _resolve(name, target)
    _check_target(name, cls)
    with _LOCK:
        if _REGISTRY.get(name) == target:  # unless re-registered meanwhile
            _REGISTRY[name] = cls
    return cls


def env_config_model(name: str) -> type | None:
    """The typed config (an ``EnvConfig`` subclass) the environment ``name`` declares as
    ``config_model``, or None: not registered (a user may register it later, before setup), or a
    class that takes its mapping unchecked."""
    with _LOCK:
        if name not in _REGISTRY:
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
    that wants real CPUs, or a ``name`` to look the actor up later).
    """
    import ray  # lazily: the registry is also imported by grader subprocesses that never need ray

    cls = get_env_class(name)
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"environment {name!r}: config must be a dict, got {type(config).__name__}")
    options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 2, "num_cpus": 0}
    options.update(actor_options or {})
    return ray.remote(cls).options(**options).remote(dict(config or {}))
