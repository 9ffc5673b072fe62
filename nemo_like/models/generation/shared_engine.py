"""One continuous engine per rollout worker, fed by every ``generate_episodes`` call at once.

A rollout worker's calls run on threads of their own (its Ray actor is threaded). Each
``generate_episodes`` call hands its episodes (an ``EpisodeStream``) to this engine and waits; one
engine thread owns the model and decodes the rows of every stream in the same steps. Asynchronous
GRPO keeps up to ``max_staleness + 1`` batches in flight: while one batch's episodes wait on their
tools, the next batch's decode, where a worker that ran its calls one at a time sat idle until the
slowest tool of the first batch had answered.

Everything else that touches the weights (a refit, a plain ``generate``, a checksum) runs on the
same thread through ``call``, between two engine steps, so no forward sees half-loaded weights. A
refit that lands while episodes decode applies from the next step on:

* each turn records the version it *started* with, and an episode's lag is that of its oldest turn,
  so the staleness bound is never understated;
* a turn that straddles a refit samples its later tokens from the new weights on top of the KV of
  the old ones; the log-probs it records are those of the distribution it sampled from, which is
  what the importance correction divides by. The prefix cache is emptied at a refit, so later turns
  prefill on the new weights (AReaL's interruptible generation makes the same trade).

Calls that need a version (``min_version``) wait for it here: Ray does not order the calls of a
threaded actor, so "the weights sent before this call" is a version number, not a queue position.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
import torch

from nemo_like.models.generation.engine import ContinuousBatcher, decoding_mode

# Waiting for environments, the engine looks for new streams and tasks this often (seconds).
POLL_S = 0.01
# A batcher's per-request storage grows with every turn it has seen: a new one is made, once no row
# decodes, after this many.
RECYCLE_AFTER = 4096


class Stream(Protocol):
    """What the engine needs of a stream (``experience.streaming.EpisodeStream`` is one)."""

    version: int | None
    request_of: dict[int, Any]  # its requests queued or decoding in the engine

    def poll(self, batcher: ContinuousBatcher, block: bool) -> None: ...
    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None: ...
    def restamp(self, queued: set[int], version: int) -> None: ...  # its queued turns start on `version`
    def exhausted(self) -> bool: ...
    def waits_on(self) -> tuple[list[ray.ObjectRef], float | None]: ...


@dataclass
class _Waiter:
    """A call waiting on the engine thread: a stream to run to its end, or a task to run once."""

    stream: Any = None
    fn: Callable[[], Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def end(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class SharedEngine:
    """``make_batcher()`` makes a streaming ``ContinuousBatcher`` for ``model``; ``check()`` raises
    if the weights may not be used (a refit failed part way): the streams decoding then fail too."""

    def __init__(self, model, make_batcher: Callable[[], ContinuousBatcher], check: Callable[[], None],
                 name: str = "nemo-like-engine"):
        self.model, self._make_batcher, self._check = model, make_batcher, check
        self._cond = threading.Condition()
        self._joining: list[_Waiter] = []
        self._active: list[_Waiter] = []
        self._tasks: deque[_Waiter] = deque()  # run in the order they came
        self._version = 0
        self._batcher: ContinuousBatcher | None = None
        self.steps = 0  # polls so far (a test waits on it)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # ---- the callers' side ----------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the engine thread between two steps; its result or its error."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        w = _Waiter(fn=lambda: fn(*args, **kwargs))
        with self._cond:
            self._tasks.append(w)
            self._cond.notify_all()
        return self._wait(w)

    def stream(self, stream: Stream) -> None:
        """Decode ``stream``'s episodes with everyone else's until it is exhausted."""
        w = _Waiter(stream=stream)
        with self._cond:
            self._joining.append(w)
            self._cond.notify_all()
        self._wait(w)

    def set_version(self, version: int) -> None:
        """The weights' version from now on (call it on the engine thread, where the refit ran):
        turns starting later record it, and callers waiting in ``wait_for_version`` go on."""
        with self._cond:
            self._version = int(version)
            # Turns queued but not prefilled yet are generated wholly by these weights: they say so
            # (their staleness would be over-reported, and under on_stale: drop dropped for nothing).
            queued = set(self._batcher.pending) if self._batcher is not None else set()
            for w in self._active:  # a stream still joining takes the version when admitted
                w.stream.version = self._version
                w.stream.restamp(queued, self._version)
            self._cond.notify_all()

    def wait_for_version(self, version: int, timeout_s: float, broken: Callable[[], str | None]) -> None:
        """Block until the weights are at least ``version`` (a refit sent before this call may still
        be loading); raise if ``broken()`` says a refit failed, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._version < version:
                if why := broken():
                    raise RuntimeError(f"waiting for weights version {version}: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"weights version {version} did not arrive within {timeout_s:g} s "
                                       f"(the worker has version {self._version}); was its refit sent?")
                self._cond.wait(timeout=min(left, 1.0))

    @property
    def version(self) -> int:
        return self._version

    def _wait(self, w: _Waiter) -> Any:
        w.done.wait()
        if w.error is not None:
            raise w.error
        return w.result

    # ---- the engine thread ------------------------------------------------------------------------
    def _main(self) -> None:
        param = next(self.model.parameters(), None)
        if param is not None and param.is_cuda:  # the current CUDA device is per thread
            torch.cuda.set_device(param.device)
        while True:
            with self._cond:
                while not (self._tasks or self._joining or self._active):
                    self._cond.wait()
            try:
                self._run_tasks()
                self._admit()
                if self._active:
                    self._batcher = self._make_batcher()
                    with decoding_mode(self.model):
                        self._batcher.run(self)
            except BaseException as e:  # noqa: BLE001 - every stream in the engine hears of it
                with self._cond:
                    failed, self._active = self._active + self._joining, []
                    self._joining = []
                for w in failed:
                    w.end(error=e)

    def _run_tasks(self) -> None:
        while True:
            with self._cond:
                if not self._tasks:
                    return
                w = self._tasks.popleft()
            try:
                # Out of inference mode: a refit writes to the parameters in place.
                with torch.inference_mode(False):
                    w.end(result=w.fn())
            except BaseException as e:  # noqa: BLE001 - it goes to the caller
                w.end(error=e)

    def _admit(self) -> None:
        """Streams that joined since: refused while the weights are unusable."""
        with self._cond:
            joining, self._joining = self._joining, []
            for w in joining:
                w.stream.version = self._version
        self._active += joining
        if joining:
            self._check()  # raises: the joining (now active) streams fail with the others

    def _retire(self) -> None:
        keep = []
        for w in self._active:
            if w.stream.exhausted() and not w.stream.request_of:
                w.end()
            else:
                keep.append(w)
        self._active = keep

    # ---- RequestSource (engine.ContinuousBatcher.run) -------------------------------------------------
    def poll(self, batcher: ContinuousBatcher, block: bool) -> None:
        while True:
            self.steps += 1
            if self._tasks:
                self._run_tasks()
                self._check()
            if self._joining:
                self._admit()
            for w in self._active:
                w.stream.poll(batcher, block=False)
            self._retire()
            if not block or batcher.pending or not self._active or batcher.count > RECYCLE_AFTER:
                return
            # Nothing decodes: wait for an environment, a new stream or a task, whichever comes first.
            refs, deadlines = [], []
            for w in self._active:
                r, d = w.stream.waits_on()
                refs += r
                deadlines += [d] if d is not None else []
            timeout = POLL_S if not deadlines else max(0.0, min(POLL_S, min(deadlines) - time.monotonic()))
            if refs:
                ray.wait(refs, num_returns=1, timeout=timeout)
            else:
                time.sleep(timeout)

    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None:
        for w in self._active:
            mine = [r for r in requests if r in w.stream.request_of]
            if mine:
                w.stream.finished(batcher, mine)
        self._retire()

    def exhausted(self) -> bool:
        """No row decodes: the run ends once no stream is left or joining (or to recycle the batcher;
        ``_main`` starts the next one for the streams still active)."""
        if self._joining:
            self._admit()
        self._retire()
        return not self._active or self._batcher.count > RECYCLE_AFTER
