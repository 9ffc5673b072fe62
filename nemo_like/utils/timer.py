"""Wall-clock timing of training phases (generation, reward, logprobs, train, ...).

Each name accumulates a list of measured durations so a step can report either the
total time spent in a phase (``reduction="sum"``) or the average per call (``"mean"``).
Different names may overlap (e.g. "logprobs" measured inside "train_step"); the same
name cannot be started twice without being stopped, which would silently lose time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_REDUCTIONS = ("sum", "mean")


class Timer:
    """Accumulates named durations in seconds (time.perf_counter: monotonic, high resolution)."""

    def __init__(self) -> None:
        self._running: dict[str, float] = {}
        self._durations: dict[str, list[float]] = {}

    def start(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Timer name must be a non-empty string, got {name!r}")
        if name in self._running:
            raise RuntimeError(f"Timer {name!r} is already running; stop it before starting it again")
        self._running[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        """Stops ``name`` and returns the measured duration in seconds."""
        started = self._running.pop(name, None)
        if started is None:
            raise RuntimeError(
                f"Timer {name!r} was stopped but is not running (running: {sorted(self._running)})"
            )
        elapsed = time.perf_counter() - started
        self._durations.setdefault(name, []).append(elapsed)
        return elapsed

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """``with timer.time("generation"): ...`` — the time is recorded even if the body raises."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def get_timing_metrics(self, reduction: str = "sum") -> dict[str, float]:
        """Completed measurements per name, reduced over calls; timers still running are not included."""
        if reduction not in _REDUCTIONS:
            raise ValueError(f"Unknown timing reduction {reduction!r}; expected one of {_REDUCTIONS}")
        out: dict[str, float] = {}
        for name, values in self._durations.items():
            total = float(sum(values))
            out[name] = total if reduction == "sum" else total / len(values)
        return out

    def reset(self, name: str | None = None) -> None:
        """Forgets all measurements (and running timers), or only those of ``name``."""
        if name is None:
            self._running.clear()
            self._durations.clear()
        else:
            self._running.pop(name, None)
            self._durations.pop(name, None)
