"""Reward functions as plain callables (the TRL convention), graded by an environment like any other.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``: ``completions``
are the texts of each sample's last assistant turn, ``columns`` the sample's hidden dataset columns
(``ground_truth``, ``problem``, ...; never shown to the model) as lists, plus ``prompts``. A function
that does not take ``**kwargs`` receives only the columns it names. Several weighted functions sum;
``None`` means "cannot score this one" (the sample gets advantage 0 when no function scores it).

A function that raises, returns something that is not a list of the right length (``None``, a
number, a string...), or runs past ``timeout_s`` scores 0 for every sample of that call and counts
once in ``<name>/num_errors`` / ``num_wrong_length`` / ``num_timeouts``. A single value that is not a
finite number or None (``inf``, ``nan``, ``10**400``, a string, a list...) scores 0 for that sample
only and counts in ``<name>/num_invalid_values`` (samples); the function's other values and the other
functions still count. Its first failure is printed once. ``step`` never raises: the run goes on.

Functions are registered by name (``@register_reward_fn("my_reward")``), given as import paths
(``"my_pkg.rewards:my_reward"``) in YAML, or passed as callables; a callable defined in a notebook
cell travels to the actor by cloudpickle (Ray's serializer). The config is typed
(:class:`RewardFnEnvConfig`); ``reward_fns`` entries built from code may hold callables.
"""

from __future__ import annotations

import inspect
import math
import threading
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.environments.env_config import EnvConfig, validate_env_config
from nemo_like.environments.grader_pool import resolve_callable
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn, normalize_step_inputs
from nemo_like.utils.registry import Registry

__all__ = ["REWARD_FN_REGISTRY", "RewardFnEnvironment", "RewardFnEnvConfig", "RewardFnSpec", "register_reward_fn",
           "get_reward_fn", "registered_reward_fns", "math_accuracy", "boxed_format"]

def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"reward function {name!r} must be callable, got {type(fn).__name__}")


# Tests keep their registrations local with ``with REWARD_FN_REGISTRY.isolated(): ...``.
REWARD_FN_REGISTRY: Registry[Callable[..., Any]] = Registry("reward function", check=_check_callable)


def register_reward_fn(name: str, fn: Callable | str | None = None, *, overwrite: bool = False):
    """Register ``fn`` (a callable, or an import path imported on first use) under ``name``; use as
    ``register_reward_fn("x", f)`` or ``@register_reward_fn("x")``. The same function again is a
    no-op; another one needs ``overwrite=True``."""
    return REWARD_FN_REGISTRY.register(name, fn, overwrite=overwrite)


def registered_reward_fns() -> list[str]:
    return REWARD_FN_REGISTRY.names()


def get_reward_fn(ref: str | Callable) -> Callable:
    """A callable from itself, a registered name, or an import path ``pkg.mod:fn`` / ``pkg.mod.fn``."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or not ref:
        raise TypeError(f"a reward function is a callable, a registered name or an import path, got {ref!r}")
    if ref in REWARD_FN_REGISTRY or "." not in ref.replace(":", "."):
        try:
            return REWARD_FN_REGISTRY.get(ref)
        except KeyError as e:
            raise KeyError(f"{e.args[0]}, or give an import path like 'my_pkg.rewards:my_reward'") from None
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


class RewardFnSpec(BaseModel):
    """One weighted function of ``env.reward_fn.reward_fns``: a bare entry means ``{"fn": entry}``."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # A callable (built from code: it travels to the actor by cloudpickle), a registered name or an
    # import path; Any because a pydantic union would report one error per member.
    fn: Any
    # Multiplies the function's score (negative: a penalty); a sample's reward is the weighted sum.
    weight: float = Field(default=1.0, strict=True, allow_inf_nan=False)
    # Label of its metrics (<name>/mean, <name>/num_errors, ...); None: the function's __name__.
    name: str | None = Field(default=None, strict=True, min_length=1)

    @field_validator("fn")
    @classmethod
    def _resolvable(cls, v: Any) -> Any:
        if not callable(v) and not (isinstance(v, str) and v):
            raise ValueError("must be a callable, a registered name or an import path 'pkg.mod:fn'")
        try:  # a typo in a path fails when the config is read, not as a run of zero rewards
            get_reward_fn(v)
        except KeyError as e:
            raise ValueError(e.args[0] if e.args else str(e)) from None
        except (ImportError, TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return v


class RewardFnEnvConfig(EnvConfig):
    """``env.reward_fn`` (and the config of a task graded by reward functions)."""

    timeout_s: float = Field(default=30.0, gt=0, strict=True, allow_inf_nan=False)  # per function call
    # The weighted functions that grade (a bare entry is its fn); a dataset's own reward_fns replace them.
    reward_fns: list[RewardFnSpec] = Field(default_factory=list)

    @field_validator("reward_fns", mode="before")
    @classmethod
    def _bare_entries(cls, v: Any) -> Any:
        if v is None:
            return []
        if not isinstance(v, (list, tuple)):
            raise ValueError("must be a list of reward functions ({fn, weight, name} or a bare fn)")
        return [e if isinstance(e, (dict, RewardFnSpec)) else {"fn": e} for e in v]


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


def _as_list(out: Any) -> list | None:
    """``out`` as a list of per-sample values, or None when it is not a sequence of them: a string,
    bytes or a mapping iterate, but are not a value per completion."""
    if out is None or isinstance(out, (str, bytes, dict)):
        return None
    try:
        it = iter(out)
    except TypeError:  # a number, an object
        return None
    return list(it)  # an iterator that fails half-way is the function's error


def _run_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> tuple[list | None, str]:
    """(``_as_list`` of ``fn(*args, **kwargs)``, the type name of what it returned), computed on a
    daemon thread so that a generator that hangs or raises while it is read is timed and reported
    like the call; raise _TimedOut if it is not done in ``timeout_s``. A thread cannot be killed, so
    a hung call keeps its thread (the caller holds it), but the step goes on."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            out = fn(*args, **kwargs)
            box["type"] = type(out).__name__
            box["value"] = _as_list(out)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box["error"], box["tb"] = e, traceback.format_exc()

    t = threading.Thread(target=target, daemon=True, name=f"reward_fn:{_name_of(fn)}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise _TimedOut(timeout_s, t)
    if "error" in box:
        raise _Failed(box["error"], box["tb"])
    return box.get("value"), box.get("type", "?")


class _Failed(Exception):
    """The function raised (anything, SystemExit included): its exception and traceback."""

    def __init__(self, error: BaseException, tb: str):
        super().__init__(repr(error))
        self.error, self.tb = error, tb


_INVALID = object()  # a per-sample value that is neither a finite number nor None
# Rewards travel as float32: a larger magnitude would become inf there and poison the advantages.
_FLOAT32_MAX = 3.4028234663852886e38


def _clean_value(v: Any) -> float | None | object:
    """A finite float, None ("cannot score this one"), or ``_INVALID``. Numpy/torch scalars count;
    bools and strings do not (``"1"`` is a bug in the function, not a score)."""
    if v is None:
        return None
    if isinstance(v, (str, bytes, bool)):
        return _INVALID
    try:
        f = float(v)  # OverflowError for 10**400, TypeError/ValueError/RuntimeError for lists, tensors...
    except Exception:
        return _INVALID
    return f if math.isfinite(f) and abs(f) <= _FLOAT32_MAX else _INVALID


def _completion(log: Any) -> str:
    """Content of the last assistant message; raises on a log that is not a list of dicts."""
    last = next((m for m in reversed(log) if m.get("role") == "assistant"), None)
    return str(last.get("content", "")) if last else ""


class RewardFnEnvironment(EnvironmentInterface):
    """Single-turn grader that sums weighted reward functions. Config (:class:`RewardFnEnvConfig`):
    ``reward_fns`` (a list of ``{fn, weight, name}`` or bare fns; ``fn`` a callable, registered name
    or import path) and ``timeout_s`` (per function call, default 30).

    Functions given in the constructor's config survive a restart of the actor (Ray re-runs
    ``__init__`` with the same arguments); ones added later by a remote ``add_reward_fn`` do not,
    which is why ``GRPOExperiment.add_reward_fn`` builds a new actor with the whole list instead."""

    config_model: ClassVar[type[EnvConfig]] = RewardFnEnvConfig

    def __init__(self, config: dict[str, Any] | None = None):
        parsed = validate_env_config("reward_fn", RewardFnEnvConfig, config)
        self.timeout_s = parsed.timeout_s
        self.entries: list[_Entry] = []
        for spec in parsed.reward_fns:
            self.add_reward_fn(spec.fn, spec.weight, spec.name)
        self._warned_empty = False

    # ---- managing the functions ------------------------------------------------------------------
    def add_reward_fn(self, fn: str | Callable, weight: float = 1.0, name: str | None = None) -> list[str]:
        fn = get_reward_fn(fn)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
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
    def _call(self, entry: _Entry, completions: list[str], columns: dict[str, list]) -> tuple[list[float | None], dict[str, float]]:
        """Values of one function for the batch, and its failure counts: a failed call (error, time-out,
        not a list of ``n`` values) scores 0 everywhere and counts 1; an invalid value scores 0 for its
        sample and counts that sample."""
        n = len(completions)
        kwargs = columns if entry.kwargs is None else {k: v for k, v in columns.items() if k in entry.kwargs}
        if entry.hung is not None and entry.hung.is_alive():
            # One stuck thread per function at most: a function that hangs on every call would
            # otherwise leave a thread behind at every step.
            self._report(entry, "its last call timed out and is still running; not called until it returns")
            return [0.0] * n, {"timeouts": 1.0}
        entry.hung = None
        try:
            values, returned = _run_with_timeout(entry.fn, (list(completions),), kwargs, self.timeout_s)
        except _TimedOut as e:
            entry.hung = e.thread
            self._report(entry, f"timed out: {e}")
            return [0.0] * n, {"timeouts": 1.0}
        except _Failed as e:
            self._report(entry, e.tb)
            return [0.0] * n, {"errors": 1.0}
        if values is None or len(values) != n:
            got = f"{len(values)} values" if values is not None else f"a {returned}"
            self._report(entry, f"returned {got} for {n} completions (expected a list of {n} floats or None)")
            return [0.0] * n, {"wrong_length": 1.0}
        clean = [_clean_value(v) for v in values]
        bad = [i for i, v in enumerate(clean) if v is _INVALID]
        if bad:
            shown = ", ".join(f"{values[i]!r}"[:40] for i in bad[:3])
            self._report(entry, f"returned {len(bad)} values that are not finite numbers or None ({shown}); "
                                "those samples scored 0")
            return [0.0 if v is _INVALID else v for v in clean], {"invalid_values": float(len(bad))}  # type: ignore[misc]
        return clean, {}  # type: ignore[return-value]

    def _report(self, entry: _Entry, text: str) -> None:
        if not entry.traceback_shown:
            entry.traceback_shown = True
            print(f"[nemo_like] reward function {entry.name!r} failed (scored 0; shown once):\n{text}", flush=True)

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        import torch

        batch, meta_in = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        total = [0.0] * n
        scored = [False] * n
        metrics: dict[str, float] = {"num_failures": 0.0}
        try:
            completions, prompts = [], []
            for log in batch:
                try:
                    completions.append(_completion(log))
                    prompts.append("".join(str(m.get("content", "")) for m in log if m.get("role") != "assistant"))
                except Exception:  # not a list of dicts: graded as an empty completion, and counted
                    completions.append("")
                    prompts.append("")
                    metrics["num_failures"] += 1
            keys = sorted({k for m in meta_in if isinstance(m, dict) for k in m})
            columns = {k: [m.get(k) if isinstance(m, dict) else None for m in meta_in] for k in keys}
            columns["prompts"] = prompts
            if not self.entries and not self._warned_empty:
                self._warned_empty = True
                print("[nemo_like] RewardFnEnvironment has no reward functions: every sample is unscorable", flush=True)
            for entry in self.entries:
                values, failures = self._call(entry, completions, columns)
                for kind, count in failures.items():
                    metrics[f"{entry.name}/num_{kind}"] = count
                good = [v for v in values if v is not None]
                if good:
                    metrics[f"{entry.name}/mean"] = sum(good) / len(good)
                metrics[f"{entry.name}/num_unscorable"] = float(n - len(good))
                for i, v in enumerate(values):
                    if v is not None:
                        total[i] += entry.weight * v
                        scored[i] = True
        except Exception as e:  # last line of defence: step must never raise into the trainer
            print(f"[nemo_like] RewardFnEnvironment.step failed; the batch is unscorable: {e!r}", flush=True)
            total, scored = [0.0] * n, [False] * n
            metrics["num_failures"] = float(n)
        # A weighted sum of valid values can still overflow float32: unscorable, not inf.
        rewards = [t if s and abs(t) <= _FLOAT32_MAX else float("nan") for t, s in zip(total, scored)]
        metrics["num_unscorable"] = float(sum(math.isnan(r) for r in rewards))
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(n)],
            metadata=list(meta_in),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics=metrics,
        )
