"""Slow environments first: a turn's samples are generated in waves, so that slow graders work while
the other tasks generate.

The turn-by-turn loop generates every active sample's turn in one call and then waits for the
environments. A task whose environment call is slow (a tool that waits on a web API, a sandbox)
then holds the whole turn: nothing is generated while it works. With ``EnvTimes`` the loop
generates the samples of the slowest tasks first, sends their calls, and generates the other tasks
while those run (one generate call per wave: a wave of fewer rows costs a little more per token, so
only tasks whose calls took at least ``threshold_s`` on average go ahead on their own).

A call's time is measured from sending to the answer's arrival (a callback on the call's future,
not when the loop looks), as an exponential moving average per task and turn: a tool task's first
call runs the tool, its second only grades the answer. The first call of each is not counted: it
pays for the actor's lazy start (imports, a sandbox's self-test), about a second here.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class EnvTimes:
    """Moving averages of environment call seconds per (task, turn), and the waves they suggest."""

    def __init__(self, threshold_s: float, smoothing: float = 0.5):
        if not threshold_s > 0:
            raise ValueError(f"threshold_s must be positive, got {threshold_s!r}")
        self.threshold_s, self.smoothing = float(threshold_s), float(smoothing)
        self.seconds: dict[tuple[str, int], float] = {}
        self._seen: set[tuple[str, int]] = set()  # keys whose first call was left out
        self._lock = threading.Lock()  # rollout threads and the trainer's validation share one

    def observe(self, task: str, turn: int, seconds: float, first: bool = False) -> None:
        """Count one call (``first``: left out if it is the first of its task and turn)."""
        with self._lock:
            if first and (task, turn) not in self._seen:
                self._seen.add((task, turn))
                return
            old = self.seconds.get((task, turn))
            self.seconds[(task, turn)] = seconds if old is None else old + self.smoothing * (seconds - old)

    def watch(self, task: str, turn: int, ref: Any) -> None:
        """Time the environment call ``ref`` (a Ray ObjectRef) after ``turn`` (0: the first) of
        ``task``'s samples, to when it returns."""
        t0 = time.monotonic()
        ref.future().add_done_callback(lambda _f: self.observe(task, turn, time.monotonic() - t0, first=True))

    def waves(self, task_names: list[str], turn: int) -> list[list[int]]:
        """Positions of ``task_names`` (samples about to take ``turn``) in generation order: one wave
        per slow task (slowest first), then one for the rest. Tasks never timed at this turn count
        as fast; a task is never split."""
        with self._lock:
            seconds = {t: s for (t, k), s in self.seconds.items() if k == turn}
        slow = sorted({t for t in task_names if seconds.get(t, 0.0) >= self.threshold_s},
                      key=lambda t: -seconds[t])
        waves = [[j for j, t in enumerate(task_names) if t == s] for s in slow]
        rest = [j for j, t in enumerate(task_names) if t not in slow]
        return [w for w in [*waves, rest] if w]
