"""One registry shape for every extension point: environments, data processors, tools, reward
functions, losses and advantage estimators.

The same rules everywhere:
- a name is a non-empty string; registering a name again with the same target is a no-op, with a
  different one it needs ``overwrite=True`` (a silent swap of a grader or a loss behind a name would
  change a run without anybody noticing);
- a target may be the object itself or an import path (``"pkg.mod.attr"`` or ``"pkg.mod:attr"``),
  imported only when first asked for, so registering built-ins costs nothing and a user can register
  a module that is not importable yet;
- an unknown name is a ``KeyError`` that lists what is registered and suggests the closest name.

Imports nothing heavy: grader subprocesses import registries.
"""

from __future__ import annotations

import difflib
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, overload

__all__ = ["Registry", "import_from_path", "worker_class_check"]

T = TypeVar("T")


def _split_path(path: str) -> tuple[str, str]:
    module, _, attr = path.replace(":", ".").rpartition(".")
    return module, attr


def import_from_path(path: str, *, what: str = "object") -> Any:
    """``"pkg.mod.attr"`` / ``"pkg.mod:attr"`` imported; errors name the path."""
    module_name, attr = _split_path(path)
    if not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'pkg.module.name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while executing the module
        raise ImportError(f"{what} {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None


def worker_class_check(kind: str, methods: tuple[str, ...], role: str) -> Callable[[str, Any], None]:
    """A ``check`` for a registry of worker classes: each target is a class offering ``methods``
    (``role`` names what such a class is, in the error)."""

    def check(name: str, obj: Any) -> None:
        if not isinstance(obj, type):
            raise TypeError(f"{kind} {name!r}: {obj!r} is a {type(obj).__name__}, not a class "
                            "(register a worker class or an import path 'pkg.module.ClassName')")
        missing = [m for m in methods if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(f"{kind} {name!r}: class {obj.__qualname__} lacks {missing} (a {role} needs {list(methods)})")

    return check


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return repr(target)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _same(a: Any, b: Any) -> bool:
    """Whether registering ``b`` where ``a`` is counts as "the same again" (a no-op)."""
    if a is b:
        return True

    def key(t: Any) -> str | None:
        # A path and a module-level definition are the same thing named twice (a re-imported module
        # gives a new object with the same name). Objects without a name of their own (a tuple, a
        # dataclass instance) and names that are not unique (lambdas, closures: "<lambda>",
        # "f.<locals>.g") have no such key: they are compared by value below, or two different
        # lambdas would silently replace each other.
        if isinstance(t, str):
            return t.replace(":", ".")
        qualname = getattr(t, "__qualname__", None)
        if not isinstance(qualname, str) or "<" in qualname:
            return None
        return f"{getattr(t, '__module__', '?')}.{qualname}"

    ka, kb = key(a), key(b)
    if ka is not None or kb is not None:
        return ka == kb
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that returns an array, or raises
        return False


class Registry(Generic[T]):
    """``name -> T`` with lazy import paths. ``kind`` names the entries in messages ("loss",
    "environment"); ``check(name, obj)`` validates an object when registered or resolved (raise
    ``TypeError`` naming the problem)."""

    def __init__(self, kind: str, *, check: Callable[[str, Any], None] | None = None,
                 builtins: dict[str, T | str] | None = None) -> None:
        self.kind = kind
        self._check = check
        self._lock = threading.Lock()
        self._entries: dict[str, T | str] = {}
        self._options: dict[str, Any] = {}
        for name, target in (builtins or {}).items():
            self.register(name, target)

    # ---- registering ------------------------------------------------------------------------
    @overload
    def register(self, name: str, target: None = None, *, overwrite: bool = False,
                 options: Any = None) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, target: T | str, *, overwrite: bool = False, options: Any = None) -> T | str: ...

    def register(self, name: str, target: T | str | None = None, *, overwrite: bool = False,
                 options: Any = None) -> Any:
        """``register(name, obj_or_path)``, or ``@registry.register(name)`` as a decorator.
        ``options``: the pydantic model of the entry's own config keys (or its import path), see
        ``nemo_like.utils.options``."""
        self._check_name(name)
        if target is None:
            def decorator(obj: T) -> T:
                self.register(name, obj, overwrite=overwrite, options=options)
                return obj

            return decorator
        if isinstance(target, str):
            module, attr = _split_path(target)
            if not module or not attr:
                raise ValueError(f"{self.kind} {name!r}: import path {target!r} must look like 'pkg.module.name'")
        elif self._check is not None:
            self._check(name, target)
        if options is not None and not isinstance(options, str):
            self._check_options(name, options)
        with self._lock:
            old = self._entries.get(name)
            if old is not None and not overwrite and not _same(old, target):
                raise ValueError(f"{self.kind} {name!r} is already registered to {_describe(old)}; "
                                 f"pass overwrite=True to replace it with {_describe(target)}")
            self._entries[name] = target
            self._options[name] = options
        return target

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)
            self._options.pop(name, None)

    # ---- looking up -------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object registered under ``name`` (an import path is imported now and cached)."""
        self._check_name(name)
        with self._lock:
            target = self._entries.get(name)
            known = sorted(self._entries)
        if target is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"unknown {self.kind} {name!r}{hint}; registered: {known}")
        if not isinstance(target, str):
            return target
        obj = import_from_path(target, what=f"{self.kind} {name!r}")
        if self._check is not None:
            self._check(name, obj)
        with self._lock:
            if self._entries.get(name) == target:  # unless re-registered meanwhile
                self._entries[name] = obj
        return obj

    def options(self, name: str) -> Any:
        """The options model registered with ``name`` (a pydantic model class), or None."""
        if name not in self:
            self.get(name)  # the did-you-mean KeyError; a known entry is not imported for its options
        with self._lock:
            model = self._options.get(name)
        if isinstance(model, str):
            model = import_from_path(model, what=f"options of {self.kind} {name!r}")
            with self._lock:
                self._options[name] = model
        if model is not None:
            self._check_options(name, model)
        return model

    def _check_options(self, name: str, model: Any) -> None:
        # By shape: this module must not import pydantic (grader subprocesses import registries).
        if not (isinstance(model, type) and hasattr(model, "model_validate") and hasattr(model, "model_fields")):
            raise TypeError(f"{self.kind} {name!r}: options must be a pydantic model class, got {model!r}")

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def items(self) -> list[tuple[str, T | str]]:
        """Entries as registered (unresolved import paths stay strings)."""
        with self._lock:
            return sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    @contextmanager
    def isolated(self) -> Iterator[Registry[T]]:
        """Registrations made inside the block are undone at its end (tests, notebook experiments)."""
        with self._lock:
            saved, saved_options = dict(self._entries), dict(self._options)
        try:
            yield self
        finally:
            with self._lock:
                self._entries, self._options = saved, saved_options

    def _check_name(self, name: Any) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
