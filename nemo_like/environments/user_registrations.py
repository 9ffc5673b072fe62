"""The driver's own registrations of reward functions and tools, carried to the environment actors.

An environment actor is a fresh process: it has the built-in registrations and nothing a user's module
(``imports:``, ``--import``), script or notebook cell registered in the driver, so a reward function or
tool named in the config would be unknown there. ``create_env_actor`` takes a snapshot of those
registrations and replays it in the actor before the environment is constructed (and again after a
restart). A function pickles by reference when its module can be imported, which imports the user's
module in the actor too; one defined in ``__main__`` or a notebook pickles by value.

Imports ray's cloudpickle: only ``create_env_actor`` imports this module, never a grader subprocess.
"""

from __future__ import annotations

from typing import Any

from ray import cloudpickle

from nemo_like.environments.reward_fn_environment import REWARD_FN_REGISTRY
from nemo_like.environments.tools import TOOL_REGISTRY
from nemo_like.utils.registry import Registry

__all__ = ["Registrations", "user_registrations", "with_registrations"]

_REGISTRIES: dict[str, Registry[Any]] = {"reward_fn": REWARD_FN_REGISTRY, "tool": TOOL_REGISTRY}

# registry key -> [(name, target)], targets as registered (an import path stays a string).
Registrations = dict[str, list[tuple[str, Any]]]


def _ours(target: Any) -> bool:
    """A built-in: the actor registers it itself when it imports our modules."""
    if isinstance(target, str):
        return target.startswith("nemo_like.")
    module = getattr(getattr(target, "fn", target), "__module__", None) or ""  # a Tool's function
    return module.startswith("nemo_like.")


def user_registrations() -> Registrations:
    """What the driver registered beyond the built-ins. An entry that cannot be pickled (a closure over
    a lock, an open file) stays behind: taking it along would fail every environment actor, also those
    that never use it; an actor that does use it reports the name as unknown."""
    out: Registrations = {}
    for key, registry in _REGISTRIES.items():
        entries = []
        for name, target in registry.items():
            if _ours(target):
                continue
            try:
                cloudpickle.dumps(target)
            except Exception:
                continue
            entries.append((name, target))
        if entries:
            out[key] = entries
    return out


def _replay(registrations: Registrations) -> None:
    for key, entries in registrations.items():
        for name, target in entries:
            # overwrite: the driver's registration is the one the run was checked against.
            _REGISTRIES[key].register(name, target, overwrite=True)


def with_registrations(cls: type, registrations: Registrations) -> type:
    """``cls``, or a subclass whose constructor first replays ``registrations`` (Ray re-runs the
    constructor on a restart, so a restarted actor has them too)."""
    if not registrations:
        return cls

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _replay(registrations)
        cls.__init__(self, *args, **kwargs)

    # The same name in Ray's logs and actor listings as the class itself.
    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})
