"""Environment registry: task/env name -> environment class -> restartable Ray actor.

Entries may be classes or import paths ("pkg.mod.Class" or "pkg.mod:Class"). Import paths are
resolved only when an environment is requested, so registering the built-ins costs nothing:
importing this module does not import sympy (math) or any sandbox machinery (code/tool), and
a user can register "my_pkg.my_env.MyEnvironment" before my_pkg is even importable here.

Installed packages add environments through the entry-point group ``nemo_like.environments``
(``my_env = "my_pkg.env:MyEnvironment"`` in their pyproject.toml), so installing one makes its
names work in a config with no ``imports:``. The group is read on the first lookup, not on import
(reading every installed package's metadata costs ~40 ms, and grader subprocesses import this
module), and each package is imported only when one of its environments is asked for.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, overload

from nemo_like.utils.registry import Registry

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["ENV_REGISTRY", "ENTRY_POINT_GROUP", "EnvRegistry", "EnvironmentLoadError", "register_env",
           "get_env_class", "env_config_model", "create_env_actor", "registered_envs", "builtin_envs",
           "entry_point_package"]

ENTRY_POINT_GROUP = "nemo_like.environments"


class EnvironmentLoadError(ImportError, ValueError):
    """An environment that cannot be imported (a broken package, a library that is not installed). An
    ``ImportError`` for the callers that already treat an unimportable environment as such; a
    ``ValueError`` so that config validation reports it as one line about the config, before Ray starts."""


def _check_env_class(name: str, obj: Any) -> None:
    # Runs on registration (a class) and on first lookup (what an import path resolved to).
    if not isinstance(obj, type):
        raise TypeError(f"environment {name!r}: {obj!r} is a {type(obj).__name__}, not a class "
                        "(register a class or an import path 'pkg.module.ClassName')")
    if not callable(getattr(obj, "step", None)):
        raise TypeError(f"environment {name!r}: class {obj.__qualname__} has no step() method")


def _entry_points(group: str) -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=group))


def _package_of(ep: Any) -> str:
    """"name version" of the distribution that declares ``ep``."""
    try:
        return f"{ep.dist.metadata['Name'] or ep.dist.name} {ep.dist.version}"
    except Exception:  # no distribution (an entry point made by hand) or unreadable metadata
        return "an unknown package"


def _target_of(ep: Any) -> str | None:
    """The import path an entry point names ("pkg.mod:Class" or "pkg.mod.Class"; extras ignored), or None."""
    value = str(ep.value).split("[", 1)[0].strip()  # "pkg.mod:Class [extra]"
    module, colon, attr = value.partition(":")
    if not colon:
        module, _, attr = value.rpartition(".")
    if not module or not attr or not all(p.isidentifier() for p in f"{module}.{attr}".split(".")):
        return None
    return f"{module}:{attr}"


def _warn_about(ep: Any, message: str) -> None:
    """A RuntimeWarning shown at the line of the package's ``entry_points.txt`` that declares ``ep``
    (the line a warning would otherwise show is ours, and says nothing about the package)."""
    filename, lineno = "<entry points>", 0
    try:
        found = [f for f in ep.dist.files or () if f.name == "entry_points.txt"]
        if found:
            filename = str(found[0].locate())
            with open(filename, encoding="utf-8") as f:
                lineno = next((i for i, line in enumerate(f, 1) if line.split("=", 1)[0].strip() == ep.name), 0)
    except Exception:  # no files listed (a distribution made by hand), unreadable: the message alone says it
        pass
    warnings.warn_explicit(message, RuntimeWarning, filename, lineno, module=ENTRY_POINT_GROUP)


class EnvRegistry(Registry[type]):
    """The environment registry: built-ins, names registered in code (``register_env``, modules in
    ``imports:``) and the entry points of installed packages (``group``), read once, on first use.

    An entry point never replaces a name that is already taken (a built-in, or a name registered in
    code before the group was read): it is skipped with a warning naming its package. One that cannot
    be loaded (its module fails to import, its target is not an environment class) raises
    :class:`EnvironmentLoadError` naming the package when that name is looked up, and only then: a
    run that does not use it never imports it."""

    def __init__(self, *, group: str | None = ENTRY_POINT_GROUP, builtins: dict[str, str] | None = None) -> None:
        self._builtins = dict(builtins or {})
        self._group = group
        self._discovery = threading.RLock()
        self._reading = False
        self._discovered = True  # until the built-ins are in: they are registered through ``register``
        self._packages: dict[str, tuple[str, str]] = {}  # entry-point name -> ("package version", import path)
        self._broken: dict[str, str] = {}  # entry-point name -> why it cannot be loaded
        super().__init__("environment", check=_check_env_class, builtins=builtins)
        self._discovered = group is None

    # ---- the entry points ---------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered:
            return
        with self._discovery:  # another thread waits until every entry point is in
            if self._discovered or self._reading:  # _reading: this thread, back here from inside
                return
            self._reading = True
            try:
                self._read_entry_points()
            finally:
                self._reading, self._discovered = False, True

    def _read_entry_points(self) -> None:
        try:
            found = _entry_points(self._group)  # type: ignore[arg-type]
        except Exception as e:  # a corrupt installed package's metadata must not end every run
            warnings.warn(f"cannot read the {self._group!r} entry points of the installed packages: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            return
        # In package order: which of two packages that claim one name wins must not depend on sys.path.
        for ep in sorted(found, key=lambda e: (_package_of(e), e.name)):
            try:
                self._add_entry_point(ep)
            except Exception as e:  # one package's odd metadata must not hide the others
                _warn_about(ep, f"environment entry point {getattr(ep, 'name', '?')!r} of package "
                                f"{_package_of(ep)} is skipped: {type(e).__name__}: {e}")

    def _add_entry_point(self, ep: Any) -> None:
        name, package, target = ep.name, _package_of(ep), _target_of(ep)
        where = f"environment entry point {name!r} of package {package}"
        if target is None or not name.strip():
            _warn_about(ep, f"{where} is skipped: {ep.value!r} is not an import path 'pkg.module:ClassName'")
            return
        with self._lock:
            old = self._entries.get(name)
        if old is not None:
            if _same_path(old, target):
                return  # the package also registers it in code: the same environment twice
            owner = ("a built-in environment" if name in self._builtins
                     else f"taken by package {self._packages[name][0]}" if name in self._packages
                     else f"registered in code to {_describe(old)}")
            _warn_about(ep, f"{where} ({target}) is skipped: {name!r} is {owner}, which is kept; the package "
                            "must use another name")
            return
        Registry.register(self, name, target)
        self._packages[name] = (package, target)

    def package(self, name: str) -> str | None:
        """"package version" of the installed package whose entry point provides ``name``, or None."""
        self._discover()
        entry = self._packages.get(name)
        return entry[0] if entry else None

    def builtin_names(self) -> list[str]:
        return sorted(self._builtins)

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is a built-in that still has its own class (not replaced in code)."""
        with self._lock:
            current = self._entries.get(name)
        return name in self._builtins and current is not None and _same_path(current, self._builtins[name])

    def _load_entry_point(self, name: str, package: str, target: str) -> None:
        """Import an entry point's class; ``EnvironmentLoadError`` naming the package when it cannot be."""
        if name in self._broken:
            raise EnvironmentLoadError(self._broken[name])
        module_name, _, attr = target.replace(":", ".").rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as e:  # anything the package's module raises while importing
            detail = f"importing {module_name} raised {type(e).__name__}: {e}"
        else:
            obj = getattr(module, attr, None)
            if obj is None:
                detail = f"module {module_name} has no attribute {attr!r}"
            elif not isinstance(obj, type):
                detail = f"{attr} is a {type(obj).__name__}, not an environment class"
            elif not callable(getattr(obj, "step", None)):
                detail = f"class {obj.__qualname__} has no step() method"
            else:
                return
        self._broken[name] = (f"environment {name!r} of the installed package {package} ({target}) cannot be "
                              f"loaded: {detail}; fix or uninstall that package, or use another env_name")
        raise EnvironmentLoadError(self._broken[name])

    # ---- the Registry, with the entry points read first -----------------------------------------
    def register(self, name: str, target: Any = None, *, overwrite: bool = False, options: Any = None) -> Any:
        # Read the group first: that a package's name is taken must not depend on whether something
        # looked an environment up before this call.
        self._discover()
        entry = self._packages.get(name)
        if entry is not None and target is not None and not overwrite and not _same_path(target, entry[1]):
            raise ValueError(f"environment {name!r} is already registered by the installed package {entry[0]} "
                             f"({entry[1]}); pass overwrite=True to replace it with {_describe(target)}")
        out = super().register(name, target, overwrite=overwrite, options=options)
        if entry is not None and target is not None and not _same_path(target, entry[1]):
            self._packages.pop(name, None)  # replaced in code: no longer the package's
            self._broken.pop(name, None)
        return out

    def unregister(self, name: str) -> None:
        self._discover()
        super().unregister(name)
        self._packages.pop(name, None)
        self._broken.pop(name, None)

    def get(self, name: str) -> type:
        self._discover()
        entry = self._packages.get(name)
        if entry is not None:
            with self._lock:
                unresolved = isinstance(self._entries.get(name), str)
            if unresolved:
                self._load_entry_point(name, *entry)
        try:
            return super().get(name)
        except EnvironmentLoadError:
            raise
        except ImportError as e:  # a built-in whose library is missing, a path registered in code
            raise EnvironmentLoadError(str(e)) from e

    def names(self) -> list[str]:
        self._discover()
        return super().names()

    def items(self) -> list[tuple[str, Any]]:
        self._discover()
        return super().items()

    def options(self, name: str) -> Any:
        self._discover()
        return super().options(name)

    def __contains__(self, name: object) -> bool:
        self._discover()
        return super().__contains__(name)

    @contextmanager
    def isolated(self) -> Iterator[EnvRegistry]:
        self._discover()  # read before the block: what the packages provide must outlive it
        saved = dict(self._packages), dict(self._broken)
        with super().isolated():
            try:
                yield self
            finally:
                self._packages, self._broken = dict(saved[0]), dict(saved[1])


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _same_path(a: Any, b: Any) -> bool:
    return _describe(a).replace(":", ".") == _describe(b).replace(":", ".")


# Tests and notebooks keep their registrations local with ``with ENV_REGISTRY.isolated(): ...``.
ENV_REGISTRY = EnvRegistry(builtins={
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
    """Sorted names of all registered environments (with those of installed packages)."""
    return ENV_REGISTRY.names()


def builtin_envs() -> list[str]:
    """Sorted names of the environments that ship with nemo_like (the config reference documents these:
    what else is installed differs from one machine to the next)."""
    return ENV_REGISTRY.builtin_names()


def entry_point_package(name: str) -> str | None:
    """"package version" of the installed package that provides the environment ``name``, or None."""
    return ENV_REGISTRY.package(name)


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
