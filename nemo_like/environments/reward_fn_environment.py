"""Reward functions as plain callables (the TRL convention), graded by an environment like any other.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``: ``completions``
are the texts of each sample's last assistant turn, ``columns`` the sample's hidden dataset columns
(``ground_truth``, ``problem``, ...; never shown to the model) as lists, plus ``prompts``. A function
that does not take ``**kwargs`` receives only the columns it names. Several weighted functions sum;
``None`` means "cannot score this one" (the sample gets advantage 0 when no function scores it).

A function that raises, returns the wrong number of values, returns something that is not a finite
number, or runs past ``timeout_s`` scores 0 for that call and is counted in the metrics; its first
traceback is printed once. The run goes on.

Functions are registered by name (``@register_reward_fn("my_reward")``), given as import paths
(``"my_pkg.rewards:my_reward"``) in YAML, or passed as callables; a callable defined in a notebook
cell travels to the actor by cloudpickle (Ray's serializer).
"""

from __future__ import annotations

import inspect
import math
import threading
import traceback
from collections.abc import Callable
from typing import Any

from nemo_like.environments.grader_pool import resolve_callable
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn

__all__ = ["RewardFnEnvironment", "register_reward_fn", "get_reward_fn", "registered_reward_fns",
           "math_accuracy", "boxed_format"]

_REWARD_FNS: dict[str, Callable[..., Any]] = {}


def register_reward_fn(name: str, fn: Callable | None = None, *, overwrite: bool = False):
    """Register ``fn`` under ``name``; use as ``register_reward_fn("x", f)`` or ``@register_reward_fn("x")``."""
    if fn is None:
        return lambda f: register_reward_fn(name, f, overwrite=overwrite)
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward function name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"reward function {name!r} must be callable, got {type(fn).__name__}")
    if name in _REWARD_FNS and _REWARD_FNS[name] is not fn and not overwrite:
        raise ValueError(f"reward function {name!r} is already registered; pass overwrite=True to replace it")
    _REWARD_FNS[name] = fn
    return fn


def registered_reward_fns() -> list[str]:
    return sorted(_REWARD_FNS)


def get_reward_fn(ref: str | Callable) -> Callable:
    """A callable from itself, a registered name, or an import path ``pkg.mod:fn`` / ``pkg.mod.fn``."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or not ref:
        raise TypeError(f"a reward function is a callable, a registered name or an import path, got {ref!r}")
    if ref in _REWARD_FNS:
        return _REWARD_FNS[ref]
    if "." not in ref.replace(":", "."):
        raise KeyError(f"unknown reward function {ref!r}; registered: {registered_reward_fns()}, "
                       "or give an import path like 'my_pkg.rewards:my_reward'")
    return resolve_callable(ref)


@register_reward_fn("math_accuracy")
def math_accuracy(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
    """1.0 when the boxed (or ``####``) answer equals the ground truth mathematically, else 0.0."""
    from nemo_like.environments.math_environment import verify_math_answer

    return [verify_math_answer(c, str(g)) for c, g in zip(completions, ground_truth, strict=True)]


@register_reward_fn("boxed_format")
def boxed_format(completions: list[str], **_: Any) -> list[float]:
    """1.0 when the completion contains exactly one ``\\boxed{...}``: a format reward."""
    return [1.0 if c.count("\\boxed{") == 1 else 0.0 for c in completions]


def _accepted_kwargs(fn: Callable) -> set[str] | None:
    """Names ``fn`` takes by keyword, or None when it takes ``**kwargs`` (then it gets everything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def _name_of(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class _Entry:
    def __init__(self, fn: Callable, weight: float, name: str):
        self.fn, self.weight, self.name = fn, float(weight), name
        self.kwargs = _accepted_kwargs(fn)
        self.traceback_shown = False
        self.hung: threading.Thread | None = None  # the thread of a call that timed out, if still running


class _TimedOut(TimeoutError):
    def __init__(self, timeout_s: float, thread: threading.Thread):
        super().__init__(f"took longer than {timeout_s} s")
        self.thread = thread


def _run_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """Run ``fn`` in a daemon thread; raise _TimedOut if it is not done in ``timeout_s``. A thread
    cannot be killed, so a hung call keeps its thread (the caller holds it), but the step goes on."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box["error"], box["tb"] = e, traceback.format_exc()

    t = threading.Thread(target=target, daemon=True, name=f"reward_fn:{_name_of(fn)}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise _TimedOut(timeout_s, t)
    if "error" in box:
        box["error"].__nemo_like_tb__ = box["tb"]
        raise box["error"]
    return box.get("value")


class RewardFnEnvironment(EnvironmentInterface):
    """Single-turn grader that sums weighted reward functions. Config: ``reward_fns`` (a list of
    ``{fn, weight, name}``; ``fn`` a callable, registered name or import path) and ``timeout_s``
    (per function call, default 30)."""

    def __init__(self, config: dict[str, Any] | None = None):
        config = dict(config or {})
        self.timeout_s = float(config.get("timeout_s", 30.0))
        self.entries: list[_Entry] = []
        for spec in config.get("reward_fns") or []:
            spec = dict(spec) if isinstance(spec, dict) else {"fn": spec}
            self.add_reward_fn(spec["fn"], spec.get("weight", 1.0), spec.get("name"))
        self._warned_empty = False

    # ---- managing the functions (called remotely by GRPOExperiment) -----------------------------
    def add_reward_fn(self, fn: str | Callable, weight: float = 1.0, name: str | None = None) -> list[str]:
        fn = get_reward_fn(fn)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward function weight must be a finite number, got {weight!r}")
        name = name or _name_of(fn)
        taken = {e.name for e in self.entries}
        base, k = name, 2
        while name in taken:  # two lambdas are both "<lambda>"
            name, k = f"{base}_{k}", k + 1
        self.entries.append(_Entry(fn, weight, name))
        return self.reward_fn_names()

    def clear_reward_fns(self) -> None:
        self.entries.clear()

    def reward_fn_names(self) -> list[str]:
        return [e.name for e in self.entries]

    # ---- grading ----------------------------------------------------------------------------------
    def _call(self, entry: _Entry, completions: list[str], columns: dict[str, list]) -> tuple[list[float | None], str | None]:
        """Values of one function for the batch and the failure kind, if any (then all zeros)."""
        n = len(completions)
        kwargs = columns if entry.kwargs is None else {k: v for k, v in columns.items() if k in entry.kwargs}
        if entry.hung is not None and entry.hung.is_alive():
            # One stuck thread per function at most: a function that hangs on every call would
            # otherwise leave a thread behind at every step.
            self._report(entry, "its last call timed out and is still running; not called until it returns")
            return [0.0] * n, "timeouts"
        entry.hung = None
        try:
            out = _run_with_timeout(entry.fn, (list(completions),), kwargs, self.timeout_s)
        except _TimedOut as e:
            entry.hung = e.thread
            self._report(entry, f"timed out: {e}")
            return [0.0] * n, "timeouts"
        except Exception as e:
            self._report(entry, getattr(e, "__nemo_like_tb__", None) or repr(e))
            return [0.0] * n, "errors"
        try:
            values = list(out)
        except TypeError:
            values = None
        if values is None or len(values) != n:
            got = f"{len(values)} values" if values is not None else type(out).__name__
            self._report(entry, f"returned {got} for {n} completions (expected a list of {n} floats or None)")
            return [0.0] * n, "wrong_length"
        clean: list[float | None] = []
        bad = False
        for v in values:
            if v is None:
                clean.append(None)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                clean.append(float(v))
            else:
                try:  # numpy / torch scalars
                    f = float(v)
                    ok = math.isfinite(f) and not isinstance(v, (str, bytes, bool))
                except (TypeError, ValueError):
                    ok = False
                clean.append(f if ok else 0.0)
                bad |= not ok
        if bad:
            self._report(entry, "returned values that are not finite numbers or None; those scored 0")
        return clean, ("invalid_values" if bad else None)

    def _report(self, entry: _Entry, text: str) -> None:
        if not entry.traceback_shown:
            entry.traceback_shown = True
            print(f"[nemo_like] reward function {entry.name!r} failed (scored 0; shown once):\n{text}", flush=True)

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        import torch

        n = len(message_log_batch)
        completions = []
        for log in message_log_batch:
            last = next((m for m in reversed(log) if m.get("role") == "assistant"), None)
            completions.append(str(last.get("content", "")) if last else "")
        prompts = ["".join(str(m.get("content", "")) for m in log if m.get("role") != "assistant")
                   for log in message_log_batch]
        keys = sorted({k for m in metadata if isinstance(m, dict) for k in m})
        columns = {k: [m.get(k) if isinstance(m, dict) else None for m in metadata] for k in keys}
        columns["prompts"] = prompts
        total = [0.0] * n
        scored = [False] * n
        metrics: dict[str, float] = {}
        if not self.entries and not self._warned_empty:
            self._warned_empty = True
            print("[nemo_like] RewardFnEnvironment has no reward functions: every sample is unscorable", flush=True)
        for entry in self.entries:
            values, failure = self._call(entry, completions, columns)
            if failure:
                metrics[f"{entry.name}/num_{failure}"] = 1.0
            good = [v for v in values if v is not None]
            if good:
                metrics[f"{entry.name}/mean"] = sum(good) / len(good)
            metrics[f"{entry.name}/num_unscorable"] = float(n - len(good))
            for i, v in enumerate(values):
                if v is not None:
                    total[i] += entry.weight * v
                    scored[i] = True
        rewards = torch.tensor([t if s else float("nan") for t, s in zip(total, scored)], dtype=torch.float32)
        metrics["num_unscorable"] = float(n - sum(scored))
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics=metrics,
        )
