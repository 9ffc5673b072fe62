"""Asynchronous GRPO's producer side: rollout batches made ahead of the trainer, within a staleness bound.

Batch ``k`` is the batch GRPO step ``k`` trains on (the trainer's weights are then version ``k``, the
count of optimizer steps taken). A sample's *lag* is ``k`` minus the version of the weights that
generated it (the oldest, if an episode's turns straddled a refit). With ``on_stale: wait`` a batch
is started only once the rollout weights are at least version ``k - max_staleness``; versions only
grow, so no trained sample lags more than the bound. With ``on_stale: drop`` generation never waits
and a sample past the bound when its step comes carries no loss and is counted.

Up to ``buffer_size`` batches are in flight or ready at once, each on its own thread: while one
batch's episodes wait on their tools, another's generate (the rollout workers' calls interleave).
Batches are handed to the trainer in order, so every prompt is trained on once and the sampler's
state after the last trained batch is what a checkpoint stores: batches in flight at a save are not
saved, and a resumed run draws their prompts again and generates them with the resumed weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nemo_like.distributed.batched_data_dict import BatchedDataDict

# Tries of one batch's rollout before its step is told it failed.
ROLLOUT_ATTEMPTS = 2


@dataclass
class RolloutBatch:
    index: int  # the GRPO step meant to train on it
    batch: BatchedDataDict
    metrics: dict[str, float]
    sampler_state: dict  # the sampler's state right after this batch's prompts were drawn
    started: float = 0.0
    finished: float = 0.0
    dropped: int = 0  # samples past the staleness bound when the trainer took it (their loss is off)


@dataclass
class _Busy:
    """Wall time with at least one batch in flight (the rollout side's busy time)."""

    in_flight: int = 0
    since: float = 0.0
    total: float = 0.0

    def enter(self, now: float) -> None:
        if self.in_flight == 0:
            self.since = now
        self.in_flight += 1

    def leave(self, now: float) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.total += now - self.since

    def read(self, now: float) -> float:
        return self.total + (now - self.since if self.in_flight else 0.0)


class AsyncRolloutRunner:
    """Threads that draw prompts and run rollouts ahead of the trainer.

    ``draw()`` returns a collated, G-repeated batch of fresh prompts and the sampler's state after
    drawing them (called under this runner's lock, in batch order); ``rollout(batch)`` generates and
    grades it (``run_multi_turn_rollout`` on the rollout group) and returns ``(batch, metrics)``
    with a ``policy_version`` [B] tensor. The trainer calls ``next_batch(step)`` for its step's batch
    and ``weights_updated(version)`` after each refit.
    """

    def __init__(self, *, draw: Callable[[], tuple[BatchedDataDict, dict]],
                 rollout: Callable[[BatchedDataDict], tuple[BatchedDataDict, dict[str, float]]],
                 max_staleness: int, on_stale: str, buffer_size: int, start_index: int, weights_version: int,
                 end_index: int | None = None, sampler_state: dict | None = None):
        self._draw, self._rollout = draw, rollout
        # No batch at or past end_index is started (the run's last step): it would only compete with
        # the final validation. A step asked for past it (the notebook API) lifts the limit.
        self._end = end_index
        self.max_staleness, self.on_stale, self.buffer_size = max_staleness, on_stale, buffer_size
        self._cond = threading.Condition()
        self._next_draw = start_index  # index of the next batch to start
        self._next_take = start_index  # index of the next batch the trainer takes
        self._version = weights_version  # of the rollout workers' weights
        self._ready: dict[int, RolloutBatch] = {}
        self._failed: dict[int, tuple[BatchedDataDict, dict, BaseException]] = {}  # every attempt failed
        self._redo: dict[int, tuple[BatchedDataDict, dict]] = {}  # failed batches asked for again
        self._in_flight = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._busy = _Busy()
        self._last_read = (time.perf_counter(), 0.0)  # (wall, busy) at the previous next_batch
        self.dropped_stale = 0
        # The sampler as of the last batch the trainer took (before any: as it was when the runner was
        # made), which a checkpoint records: the threads draw ahead of it.
        self._taken_state: dict | None = sampler_state

    # ---- the trainer's side -----------------------------------------------------------------------
    @property
    def batches_started(self) -> int:
        """Index of the next batch to start: every batch below it may be generating or grading now."""
        return self._next_draw

    @property
    def batches_taken(self) -> int:
        """Index of the next batch the trainer takes: every batch below it was taken."""
        return self._next_take

    def start(self) -> None:
        if self._threads:
            return
        for i in range(self.buffer_size):
            t = threading.Thread(target=self._work, name=f"nemo-like-rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def weights_updated(self, version: int) -> None:
        with self._cond:
            self._version = max(self._version, version)
            self._cond.notify_all()

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Block until batch ``step`` is ready; return it (samples past the bound with their loss
        off, under ``drop``) and this step's producer metrics."""
        self.start()
        with self._cond:
            if step != self._next_take:
                raise RuntimeError(f"async rollouts: step {step} asked for a batch, but batch {self._next_take} is next")
            if self._end is not None and step >= self._end:
                self._end = None
                self._cond.notify_all()
            # Only this step's own batch matters: a later batch that failed is raised when its step comes.
            while step not in self._ready and step not in self._failed and self._error is None:
                self._cond.wait(timeout=1.0)
            if step in self._failed:
                batch, sampler_state, error = self._failed.pop(step)
                self._redo[step] = (batch, sampler_state)  # a step() called again retries it
                self._cond.notify_all()
                raise RuntimeError(f"the rollout of batch {step} failed {ROLLOUT_ATTEMPTS} times: {error!r}") from error
            if step not in self._ready:
                raise RuntimeError(f"a rollout thread failed: {self._error!r}") from self._error
            rb = self._ready.pop(step)
            self._next_take += 1
            # What a checkpoint after this step stores: a step that fails before its save saves nothing.
            self._taken_state = rb.sampler_state
            fill = len(self._ready)
            self._cond.notify_all()  # a slot is free
            now = time.perf_counter()
            busy = self._busy.read(now)
        wall0, busy0 = self._last_read
        self._last_read = (now, busy)
        versions = rb.batch["policy_version"]
        lag = (step - versions).clamp(min=0)
        stale = lag > self.max_staleness
        dropped = int(stale.sum())
        # Only under "drop": "wait" never starts a batch that could end up here, unless a refit sent
        # without waiting failed before loading anything (its error comes at the next refit).
        if dropped:
            rb.batch["loss_multiplier"] = rb.batch["loss_multiplier"] * (~stale).float()
            self.dropped_stale += dropped
        rb.dropped = dropped
        kept = lag[~stale]  # what is trained on (nothing, if every sample is stale)
        metrics = {
            "train/staleness_mean": float(kept.float().mean()) if len(kept) else 0.0,
            "train/staleness_max": float(kept.max()) if len(kept) else 0.0,
            "async/dropped_stale_samples": float(dropped),
            "async/buffer_fill": float(fill),  # batches ready beyond this one when it was taken
            "async/generation_busy_frac": min(1.0, (busy - busy0) / max(now - wall0, 1e-9)),
            "timing/rollout_batch": rb.finished - rb.started,
        }
        return rb, metrics

    def give_back(self, step: int, rb: RolloutBatch, taken_state: dict) -> None:
        """Undo ``next_batch(step)`` for a step that failed before training: the batch is next again
        (its stale samples' loss stays off: the same step drops the same ones) and a checkpoint
        records the sampler as it was before it was taken."""
        with self._cond:
            if self._next_take != step + 1:
                raise RuntimeError(f"async rollouts: batch {step} given back, but batch {self._next_take - 1} "
                                   "was the last taken")
            self._ready[step] = rb
            self._next_take = step
            self._taken_state = taken_state
            self.dropped_stale -= rb.dropped
            self._cond.notify_all()

    def resume_sampler_state(self, fallback: dict) -> dict:
        """The sampler state a checkpoint stores: right after the last batch taken by the trainer
        (``fallback`` before any was taken)."""
        return self._taken_state if self._taken_state is not None else fallback

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:  # a rollout in progress runs to its end (its calls cannot be cut)
            t.join(max(0.0, end - time.monotonic()))
        self._threads = []

    # ---- the producer threads -----------------------------------------------------------------------
    def _may_start(self) -> bool:
        if self._redo:  # a failed batch its step asked for again
            return True
        if self._in_flight + len(self._ready) + len(self._failed) >= self.buffer_size:
            return False
        if self._end is not None and self._next_draw >= self._end:
            return False
        # Under "wait", batch k starts only with weights of version >= k - max_staleness.
        return self.on_stale == "drop" or self._next_draw - self._version <= self.max_staleness

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._error is None and not self._may_start():
                    self._cond.wait(timeout=1.0)
                if self._stopped or self._error is not None:
                    return
                if self._redo:
                    index = min(self._redo)
                    batch, sampler_state = self._redo.pop(index)
                else:
                    index = self._next_draw
                    try:
                        batch, sampler_state = self._draw()
                    except BaseException as e:  # the sampler itself: nothing later can be drawn either
                        self._error = e
                        self._cond.notify_all()
                        return
                    self._next_draw += 1
                self._in_flight += 1
                self._busy.enter(time.perf_counter())
            started = time.perf_counter()
            error: BaseException | None = None
            for _ in range(ROLLOUT_ATTEMPTS):  # a transient failure (a worker error, a timeout) is tried again
                try:
                    out, metrics = self._rollout(batch)  # (a rollout appends to copies of the logs: reusable)
                    if "policy_version" not in out:
                        raise KeyError("the rollout returned no policy_version: is the generator a rollout group?")
                    error = None
                    break
                except Exception as e:  # noqa: BLE001 - kept for the step that needs this batch
                    error = e
                    with self._cond:
                        if self._stopped:
                            break
            if error is not None:
                with self._cond:  # raised by next_batch when (and only when) this batch's step asks for it
                    self._failed[index] = (batch, sampler_state, error)
                    self._in_flight -= 1
                    self._busy.leave(time.perf_counter())
                    self._cond.notify_all()
                continue
            with self._cond:
                now = time.perf_counter()
                self._ready[index] = RolloutBatch(index, out, metrics, sampler_state, started, now)
                self._in_flight -= 1
                self._busy.leave(now)
                self._cond.notify_all()
