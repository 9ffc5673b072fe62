"""A run that stops making progress says where it waits, and stops (on the one GPU run so far, three
runs waited silently until they were killed).

`StallWatch` times a trainer's phases (each step, its checkpoint save included; each validation:
``phase``, a nested phase paused out of the outer one's clock); a thread compares the phase under way
with the median of the completed phases of its kind. Past ``factor`` x that median, and at least
``min_s`` seconds, unless the wait under way has a deadline of its own still ahead (an environment
call's ``step_timeout_s`` and its actor's restart: that wait ends by itself), it

1. prints every process's Python stacks: the driver's threads here (printed, so a notebook shows
   them), and every process of the local Ray cluster that imported nemo_like, by SIGUSR1
   (``nemo_like/__init__.py`` registers faulthandler there; they print into their stderr, which Ray
   forwards here and keeps in its worker logs);
2. stops the run with one line saying what the phase's thread waited for: a worker-group wait
   (``RayWorkerGroup.get_all_worker_results`` polls ``check()``) raises `StalledError` naming the ranks
   it waits for; a main thread blocked anywhere else gets SIGUSR2, whose handler (installed by
   ``start`` when the signal is free) raises the same `StalledError` while the stalled phase's body is
   still running. SIGUSR2, not SIGINT: a driver started in the background has SIGINT ignored.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nemo_like._proc import process_start_time

__all__ = ["StallWatch", "StalledError", "active", "check", "stack_env", "waiting_for"]

# Set for the processes of a local Ray cluster this driver starts (ray_cluster.init_ray): each process
# that imports nemo_like registers its stack dump on SIGUSR1 and leaves its pid in the folder.
STACKS_FLAG, STACKS_DIR = "NEMO_LIKE_STACKS_ON_SIGUSR1", "NEMO_LIKE_STACKS_DIR"

_active: StallWatch | None = None
_waits: list[tuple[int, Callable[[], str], float | None]] = []  # (thread, describe, deadline), innermost last
_stacks_dir: str | None = None

# A phase under way: [label, what, started (monotonic; moved on by nested phases), thread, in its body]
_LABEL, _WHAT, _T0, _THREAD, _BODY = range(5)


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
    """Raise `StalledError` once, in the stalled phase's thread, when the active watch has tripped
    (long waits poll this; other threads, e.g. async rollout producers, never get it)."""
    w = _active
    e = w._tripped_entry if w is not None else None
    if e is not None and not w.raised and e[_THREAD] == threading.get_ident():
        w.raised = True
        raise StalledError(w.tripped)


@contextmanager
def waiting_for(describe: Callable[[], str], deadline: float | None = None) -> Iterator[None]:
    """While inside, a stall's message says ``describe()`` is what this thread waits for; a wait with a
    ``deadline`` (time.monotonic()) of its own is not a stall before it."""
    item = (threading.get_ident(), describe, deadline)
    _waits.append(item)
    try:
        yield
    finally:
        _waits.remove(item)


class StallWatch:
    def __init__(self, factor: float | None, min_s: float, after: int = 3, first_s: float | None = None, *,
                 key: str = "grpo.stall_watch", poll_s: float = 1.0, grace_s: float = 5.0):
        self.factor, self.min_s, self.after, self.first_s, self.key = factor, min_s, after, first_s, key
        self.poll_s, self.grace_s = poll_s, grace_s
        self.history: dict[str, list[float]] = defaultdict(list)
        self._stack: list[list] = []  # the phases under way, innermost last
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tripped: str | None = None  # the stop's one line, from the trip until the stalled phase ends
        self._tripped_entry: list | None = None
        self.raised = False
        self._old_handler: object = None  # SIGUSR2's handler before ours (None: ours is not installed)

    @property
    def enabled(self) -> bool:
        return self.factor is not None or self.first_s is not None

    def start(self) -> StallWatch:
        global _active
        if not self.enabled or self._thread is not None:
            return self
        _active = self
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None):
                    self._old_handler = signal.signal(signal.SIGUSR2, self._on_signal)
            except (ValueError, OSError):  # no such signal here: worker-group waits still stop
                self._old_handler = None
        self._thread = threading.Thread(target=self._run, name="nemo-like-stall-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        global _active
        self._stop.set()
        if _active is self:
            _active = None
        if self._old_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, self._old_handler)
            self._old_handler = None

    @contextmanager
    def phase(self, label: str, what: str) -> Iterator[None]:
        """Time a phase of kind ``label`` (``what``: how a message names it, e.g. "step 12"); the phase
        it is nested in does not count the time spent in it."""
        entry = [label, what, time.monotonic(), threading.get_ident(), True]
        with self._lock:
            self._stack.append(entry)
        ok = False
        try:
            yield
            ok = True
        finally:
            entry[_BODY] = False  # first: from here on the signal handler leaves this phase alone
            with self._lock:
                self._stack[:] = [e for e in self._stack if e is not entry]
                took = time.monotonic() - entry[_T0]
                if ok:
                    self.history[label].append(took)
                if self._stack:
                    self._stack[-1][_T0] += took
                if entry is self._tripped_entry:  # the stalled phase is over: stopped, or slow and done
                    if not self.raised:
                        print(f"[nemo_like] {what} finished after all; the run goes on", file=sys.stderr, flush=True)
                    self.tripped, self._tripped_entry, self.raised = None, None, False

    def limit(self, label: str) -> float | None:
        """Seconds a phase of kind ``label`` may run (None: unwatched)."""
        done = self.history[label]
        if len(done) < self.after:
            return self.first_s
        if self.factor is None:
            return None
        return max(self.factor * statistics.median(done[-50:]), self.min_s)

    def _on_signal(self, signum, frame) -> None:
        e = self._tripped_entry
        if e is not None and e[_BODY] and not self.raised and e[_THREAD] == threading.get_ident():
            self.raised = True
            raise StalledError(self.tripped)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if not self._stack or self._tripped_entry is not None:
                    continue
                entry = self._stack[-1]
                now = time.monotonic()
                elapsed, limit = now - entry[_T0], self.limit(entry[_LABEL])
                own = [w for w in _waits if w[0] == entry[_THREAD]]
            if limit is None or elapsed <= limit or (own and own[-1][2] is not None and now < own[-1][2]):
                continue
            try:
                self._trip(entry, elapsed, limit, own)
            except Exception as e:  # noqa: BLE001 - the watch must outlive what it reports on
                print(f"[nemo_like] the stall watch failed while reporting: {e!r}", file=sys.stderr, flush=True)

    def _trip(self, entry: list, elapsed: float, limit: float, own: list) -> None:
        label, what = entry[_LABEL], entry[_WHAT]
        done = self.history[label]
        why = (f"{self.key}: {self.factor:g} x the median {label} of {statistics.median(done[-50:]):.1f} s, at "
               f"least min_s {self.min_s:g} s" if len(done) >= self.after else f"{self.key}.first_s")
        waited = "; ".join(d for d in (_describe(w[1]) for w in own) if d)
        print(f"[nemo_like] {what} has run {elapsed:.0f} s, past {limit:.0f} s ({why}): the Python stacks of "
              "every process follow", file=sys.stderr, flush=True)
        dump_stacks()
        with self._lock:
            if not any(e is entry for e in self._stack):  # it ended while the stacks were printed
                return
            self.tripped = (f"stalled: {what} ran past {limit:.0f} s ({why}) waiting for "
                            f"{waited or 'nothing a worker group was asked (see the driver stacks)'}; the Python "
                            "stacks of every process are printed above")
            self._tripped_entry = entry
        # A wait that polls check() raises within a poll; a main thread blocked elsewhere is interrupted.
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self._tripped_entry is entry and not self.raised:
            if self._stop.wait(0.1):
                return
        with self._lock:
            if self._tripped_entry is not entry or self.raised or self._stop.is_set():
                return
            if self._old_handler is not None and entry[_THREAD] == threading.main_thread().ident:
                signal.pthread_kill(entry[_THREAD], signal.SIGUSR2)
                return
        print(f"[nemo_like] cannot interrupt {what} (it runs outside the main thread, or SIGUSR2 is taken): "
              "stop the run yourself (Ctrl-C)", file=sys.stderr, flush=True)


def _describe(describe: Callable[[], str]) -> str:
    try:
        return describe()
    except Exception as e:  # noqa: BLE001 - a description must not lose the report
        return f"(a wait that could not describe itself: {e!r})"


def dump_stacks() -> int:
    """Print this process's threads' stacks to stderr and ask every local process of the cluster that
    imported nemo_like for theirs (SIGUSR1); how many were asked."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"--- driver thread {names.get(ident, ident)} (most recent call last):\n"
              + "".join(traceback.format_stack(frame)), file=sys.stderr)
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
    """Pids in the stacks folder that are still the processes that wrote them (the start time in the
    file matches): a pid reused by another program must not get a signal it would die of."""
    if _stacks_dir is None or not os.path.isdir(_stacks_dir):
        return []
    out = []
    for f in Path(_stacks_dir).iterdir():
        if not f.name.isdigit() or int(f.name) == os.getpid():
            continue
        try:
            started = f.read_text().strip()
        except OSError:
            continue
        if started and started == process_start_time(f.name):
            out.append(int(f.name))
    return sorted(out)
