"""A run that stops making progress says where it waits, and stops (on the one GPU run so far, three
runs waited silently until they were killed).

`StallWatch` times a trainer's phases (each step, each validation, each checkpoint save: ``phase``,
nested phases paused out of the outer one's clock); a thread compares the phase under way with the
median of the completed phases of its kind. Past ``factor`` x that median, and at least ``min_s``
seconds, it

1. prints every process's Python stacks: the driver's threads here, and every process of the local
   Ray cluster that imported nemo_like, by SIGUSR1 (``nemo_like/__init__.py`` registers faulthandler
   there; they print into their stderr, which Ray forwards here and keeps in its worker logs);
2. stops the run with one line saying what the driver waited for: the worker-group wait under way
   (``RayWorkerGroup.get_all_worker_results``, which polls ``check()``) raises `StalledError` naming
   the ranks it waits for; a driver blocked anywhere else is interrupted after ``grace_s`` (``phase``
   turns that KeyboardInterrupt into the same `StalledError`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["StallWatch", "StalledError", "active", "check", "stack_env", "waiting_for"]

# Set for the processes of a local Ray cluster this driver starts (ray_cluster.init_ray): each process
# that imports nemo_like registers its stack dump on SIGUSR1 and leaves its pid in the folder.
STACKS_FLAG, STACKS_DIR = "NEMO_LIKE_STACKS_ON_SIGUSR1", "NEMO_LIKE_STACKS_DIR"

_active: StallWatch | None = None
_waits: list[Callable[[], str]] = []  # what the driver waits for now (innermost last)
_stacks_dir: str | None = None


class StalledError(RuntimeError):
    """A phase ran past its stall limit; the message is one line."""


def stack_env(ray_temp_dir: str) -> dict[str, str]:
    """Environment for the processes of a local Ray cluster: stack dumps on SIGUSR1 (unless the user
    set ``NEMO_LIKE_STACKS_ON_SIGUSR1=0``) and the folder their pids go in (inside Ray's temp dir, so
    it lives as long as the cluster)."""
    global _stacks_dir
    if os.environ.get(STACKS_FLAG, "1") != "1":
        return {}
    _stacks_dir = os.path.join(ray_temp_dir, "nemo_like_stacks")
    os.makedirs(_stacks_dir, exist_ok=True)
    return {STACKS_FLAG: "1", STACKS_DIR: _stacks_dir}


def active() -> StallWatch | None:
    return _active


def check() -> None:
    """Raise `StalledError` once when the active watch has tripped (long waits poll this)."""
    w = _active
    if w is not None and w.tripped is not None and not w.raised:
        w.raised = True
        raise StalledError(w.tripped)


@contextmanager
def waiting_for(describe: Callable[[], str]) -> Iterator[None]:
    """While inside, a stall's message says ``describe()`` is what the driver waits for."""
    _waits.append(describe)
    try:
        yield
    finally:
        _waits.remove(describe)


class StallWatch:
    def __init__(self, factor: float | None, min_s: float, after: int = 3, first_s: float | None = None, *,
                 key: str = "grpo.stall_watch", poll_s: float = 1.0, grace_s: float = 5.0):
        self.factor, self.min_s, self.after, self.first_s, self.key = factor, min_s, after, first_s, key
        self.poll_s, self.grace_s = poll_s, grace_s
        self.history: dict[str, list[float]] = defaultdict(list)
        self._stack: list[list] = []  # [label, what, started] of the phases under way, innermost last
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tripped: str | None = None  # the stop's one line, from the trip until the stalled phase ends
        self._tripped_entry: list | None = None
        self.raised = False

    @property
    def enabled(self) -> bool:
        return self.factor is not None or self.first_s is not None

    def start(self) -> StallWatch:
        global _active
        if self.enabled and self._thread is None:
            _active = self
            self._thread = threading.Thread(target=self._run, name="nemo-like-stall-watch", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        global _active
        self._stop.set()
        if _active is self:
            _active = None

    @contextmanager
    def phase(self, label: str, what: str) -> Iterator[None]:
        """Time a phase of kind ``label`` (``what``: how a message names it, e.g. "step 12"); the phase
        it is nested in does not count the time spent in it."""
        with self._lock:
            self._stack.append([label, what, time.monotonic()])
        ok = False
        try:
            yield
            ok = True
        except KeyboardInterrupt:
            if self.tripped is None:
                raise
            self.raised = True  # this watch interrupted a driver blocked outside a worker-group wait
            raise StalledError(self.tripped) from None
        finally:
            with self._lock:
                entry = self._stack.pop()
                took = time.monotonic() - entry[2]
                if entry is self._tripped_entry:  # the stalled phase is over: stopped, or slow and done
                    if not self.raised:
                        print(f"[nemo_like] {entry[1]} finished after all; the run goes on", file=sys.stderr,
                              flush=True)
                    self.tripped, self._tripped_entry, self.raised = None, None, False
                if ok:
                    self.history[label].append(took)
                if self._stack:
                    self._stack[-1][2] += took

    def limit(self, label: str) -> float | None:
        """Seconds a phase of kind ``label`` may run (None: unwatched)."""
        done = self.history[label]
        if len(done) < self.after:
            return self.first_s
        if self.factor is None:
            return None
        return max(self.factor * statistics.median(done[-50:]), self.min_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if not self._stack or self.tripped is not None:
                    continue
                entry = self._stack[-1]
                label, what, t0 = entry
                elapsed, limit = time.monotonic() - t0, self.limit(label)
            if limit is not None and elapsed > limit:
                self._trip(entry, label, what, elapsed, limit)

    def _trip(self, entry: list, label: str, what: str, elapsed: float, limit: float) -> None:
        done = self.history[label]
        why = (f"{self.key}: {self.factor:g} x the median {label} of {statistics.median(done[-50:]):.1f} s, at "
               f"least min_s {self.min_s:g} s" if len(done) >= self.after else f"{self.key}.first_s")
        waits = [d() for d in list(_waits)]
        waited = "; ".join(w for w in waits if w) or "nothing a worker group was asked (see the driver's stacks)"
        print(f"[nemo_like] {what} has run {elapsed:.0f} s, past {limit:.0f} s ({why}): the Python stacks of "
              "every process follow", file=sys.stderr, flush=True)
        dump_stacks()
        with self._lock:
            if not any(e is entry for e in self._stack):  # it ended while the stacks were printed
                return
            self.tripped, self._tripped_entry = (f"stalled: {what} ran past {limit:.0f} s ({why}) waiting for "
                                                 f"{waited}; the Python stacks of every process are printed above"), entry
        # A wait that polls check() raises within a poll; a driver blocked elsewhere is interrupted.
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self._tripped_entry is entry and not self.raised:
            if self._stop.wait(0.1):
                return
        with self._lock:
            if self._tripped_entry is entry and not self.raised and not self._stop.is_set():
                # SIGINT to the main thread itself: its blocking call returns (EINTR) and Python raises
                # KeyboardInterrupt there (_thread.interrupt_main only sets a flag a blocked call never reads).
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def dump_stacks() -> int:
    """Print this process's threads' stacks to stderr and ask every local process of the cluster that
    imported nemo_like for theirs (SIGUSR1); how many were asked."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    asked = 0
    for pid in _stack_pids():
        try:
            os.kill(pid, signal.SIGUSR1)
            asked += 1
        except OSError:  # gone since
            pass
    return asked


def _stack_pids() -> list[int]:
    """Pids in the stacks folder that are still processes with the handler registered (a pid reused by
    another program must not get a signal it would die of)."""
    if _stacks_dir is None or not os.path.isdir(_stacks_dir):
        return []
    out = []
    for f in Path(_stacks_dir).iterdir():
        if not f.name.isdigit() or int(f.name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{f.name}/environ").read_bytes()
        except OSError:  # ended, or not Linux
            continue
        if f"{STACKS_FLAG}=1".encode() in env.split(b"\0"):
            out.append(int(f.name))
    return sorted(out)
