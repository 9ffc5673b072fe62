"""Keeping graders honest from the trainer's side: an environment that cannot start fails the run
at setup, and one whose grading keeps failing stops it, instead of a run that trains on zeros.

Environments are Ray actors (see :mod:`nemo_like.environments.registry`); the per-call time limit
and the restart of a hung actor live in :func:`nemo_like.experience.rollouts.calculate_rewards`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["EnvironmentStartError", "EnvironmentFailureError", "wait_for_env_actors", "FailureWatch",
           "first_line_of_error", "step_timeouts", "START_TIMEOUT_S"]

# An environment's constructor (a sandbox probe, a tool import) is fast; minutes mean it is stuck.
START_TIMEOUT_S = 300.0


class EnvironmentStartError(RuntimeError):
    """An environment actor could not be constructed. The CLI prints it on one line."""


class EnvironmentFailureError(RuntimeError):
    """Grading failed for every sample of a task for too many steps in a row: the run cannot learn."""


def first_line_of_error(e: BaseException) -> str:
    """The cause of a Ray error in one line: Ray wraps the actor's exception with a traceback, whose
    last line ("RuntimeError: bubblewrap not found") is what a user needs to read."""
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[-1] if len(lines) > 1 else f"{type(e).__name__}: {lines[0]}"


def wait_for_env_actors(actors: dict[str, Any], env_names: dict[str, str], *,
                        timeout_s: float = START_TIMEOUT_S) -> None:
    """Block until every environment actor has run its constructor; raise
    :class:`EnvironmentStartError` naming the environment, its task and the cause if one failed.

    Ray starts actors asynchronously and keeps a failed constructor's error until the first call,
    so without this wait a broken environment only shows as every sample scoring 0."""
    import ray

    pending = {task: actor.__ray_ready__.remote() for task, actor in actors.items()}
    for task, ref in pending.items():
        name = env_names.get(task, task)
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise EnvironmentStartError(
                f"environment {name!r} (task {task!r}) did not start within {timeout_s:.0f} s") from None
        except Exception as e:  # ActorDiedError carrying the constructor's exception
            raise EnvironmentStartError(
                f"environment {name!r} (task {task!r}) failed to start: {first_line_of_error(e)}") from None


class FailureWatch:
    """Counts, per task, the training steps in a row in which grading failed for every sample (the
    environment raised, timed out or died), or for more than ``fractions[task]`` of them where a task
    has one (an agent task: ``env.<its environment>.max_failed_fraction``); past ``max_consecutive`` it raises
    :class:`EnvironmentFailureError` naming the task and the first error. 0 disables the stop."""

    def __init__(self, max_consecutive: int, fractions: dict[str, float] | None = None,
                 env_names: dict[str, str] | None = None) -> None:
        self.max_consecutive = max_consecutive
        self.fractions = dict(fractions or {})
        self.env_names = dict(env_names or {})  # task -> environment: names the key of its fraction
        self.streak: dict[str, int] = {}
        self.first_error: dict[str, str] = {}
        self.last_count: dict[str, tuple[int, int]] = {}

    def observe(self, task_names: Sequence[str], grading_errors: Sequence[str | None]) -> None:
        by_task: dict[str, list[str | None]] = {}
        for task, err in zip(task_names, grading_errors):
            by_task.setdefault(task, []).append(err)
        for task, errs in by_task.items():
            failed = [e for e in errs if e is not None]
            limit = self.fractions.get(task)
            if errs and (len(failed) == len(errs) if limit is None else len(failed) > limit * len(errs)):
                self.streak[task] = self.streak.get(task, 0) + 1
                self.first_error.setdefault(task, str(failed[0]))
                self.last_count[task] = (len(failed), len(errs))
            else:
                self.streak.pop(task, None)
                self.first_error.pop(task, None)
        for task, n in self.streak.items():
            if self.max_consecutive and n >= self.max_consecutive:
                if task in self.fractions:
                    k, m = self.last_count[task]
                    what = (f"more than {self.fractions[task]:g} of the episodes failed ({k} of {m} in the last) in "
                            f"{n} consecutive steps (env.{self.env_names.get(task, 'agent')}.max_failed_fraction)")
                else:
                    what = f"grading failed for every sample in {n} consecutive steps"
                raise EnvironmentFailureError(
                    f"task {task!r}: {what} (grpo.max_consecutive_env_failures={self.max_consecutive}); "
                    f"first error: {self.first_error[task]}")


def step_timeouts(env_options: dict[str, dict[str, Any]], task_envs: dict[str, str],
                  default_s: float) -> dict[str, float]:
    """Per task, ``env.<env_name>.step_timeout_s`` or the global default (seconds; inf: none)."""
    out = {}
    for task, name in task_envs.items():
        t = (env_options.get(name) or {}).get("step_timeout_s")
        out[task] = float(t) if t is not None else float(default_s) if default_s else math.inf
    return out
