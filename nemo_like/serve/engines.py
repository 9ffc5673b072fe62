"""What the server generates with: one ``generate(prompt_ids, params)`` coroutine over an engine.

* :class:`LocalEngine`: a model in this process and the continuous engine (continuous batching, the
  prefix cache) on a thread of its own; every request joins the rows decoding as soon as a row is
  free. ``python -m nemo_like.serve`` uses it.
* :class:`BatchingEngine`: any ``GenerationInterface`` (the training policy, a rollout group):
  requests that arrive while a batch generates form the next batch. Training uses it, so that the
  tokens an agent gets are sampled by the weights being trained, with the trainer's sampling
  settings (the log-probs it recomputes are at that temperature).

Both answer with the sampled ids, their log-probs, why generation ended and the weights' version.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.engine import ContinuousBatcher, decoding_mode
from nemo_like.models.generation.interfaces import GenerationConfig

# A batcher's per-request storage grows with every request: a new one once this many have passed.
RECYCLE_AFTER = 4096


@dataclass
class GenParams:
    max_new_tokens: int
    temperature: float | None = None  # None: the engine's
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    version: int


@dataclass
class _Pending:
    ids: list[int]
    params: GenParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def resolve(self, result: Generated | BaseException) -> None:
        def set_() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)
        self.loop.call_soon_threadsafe(set_)


class _Serving:
    def __init__(self, engine: _EngineBase):
        self.engine = engine

    async def __aenter__(self) -> _Serving:
        self.engine.busy += 1
        return self

    async def generate(self, prompt_ids: list[int], params: GenParams) -> Generated:
        self.engine.busy -= 1
        try:
            return await self.engine.generate(prompt_ids, params)
        finally:
            self.engine.busy += 1

    async def __aexit__(self, *exc: Any) -> None:
        self.engine.busy -= 1


class _EngineBase:
    """The queue both engines share: ``generate`` puts a request and awaits its future."""

    context_length: int
    tokenizer: Any

    def __init__(self) -> None:
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        # Requests the server is parsing, or whose answers it is writing, now (only the server's
        # loop changes it): they are about to queue a turn or to let their client send the next.
        self.busy = 0

    async def generate(self, prompt_ids: list[int], params: GenParams) -> Generated:
        if self._closed.is_set():
            raise RuntimeError("the engine is closed")
        self._check_open()
        loop = asyncio.get_running_loop()
        pending = _Pending(list(prompt_ids), params, loop, loop.create_future())
        self._queue.put(pending)
        self._queued()
        return await pending.future

    def _check_open(self) -> None:
        """Raise where a new turn cannot be answered (beyond the engine being closed)."""

    def _queued(self) -> None:
        """On the server's loop, after a turn was queued."""

    def serving(self) -> Any:
        """Around a request's handling on the server's loop: ``async with engine.serving() as s:``,
        then ``await s.generate(...)`` (see ``busy``)."""
        return _Serving(self)

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _drain(self, block: bool) -> list[_Pending]:
        """The requests queued now (``block``: wait for at least one, or for the engine to close)."""
        out: list[_Pending] = []
        while True:
            try:
                item = self._queue.get(block=block and not out, timeout=0.1 if block and not out else None)
            except queue.Empty:
                if block and not out and not self._closed.is_set():
                    continue
                return out
            if item is None:
                return out
            out.append(item)


class LocalEngine(_EngineBase):
    """``model`` decoding with the continuous engine on its own thread, ``slots`` rows at once."""

    def __init__(self, model: Any, tokenizer: Any, cfg: GenerationConfig, *, context_length: int, slots: int = 32,
                 device: torch.device | None = None, version: int = 0):
        super().__init__()
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.context_length, self.slots, self.version = context_length, slots, version
        self.device = device or next(model.parameters()).device
        self._requests: dict[int, _Pending] = {}
        self._start("nemo-like-serve-engine")

    # RequestSource ------------------------------------------------------------------------------
    def poll(self, batcher: ContinuousBatcher, block: bool) -> None:
        for p in self._drain(block):
            try:
                ids = torch.tensor([p.ids], dtype=torch.long)
                [req] = batcher.add(ids, torch.tensor([len(p.ids)]), [p.params.stop or None],
                                    greedy=p.params.greedy,
                                    temperature=None if p.params.greedy else p.params.temperature,
                                    top_p=p.params.top_p, max_new_tokens=p.params.max_new_tokens)
                self._requests[req] = p
            except Exception as e:  # one bad request fails alone
                p.resolve(e)

    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None:
        for r in requests:
            p = self._requests.pop(r, None)
            if p is None:
                continue
            tokens, lps, ended = batcher.result(r)
            p.resolve(Generated(tokens.tolist(), lps.tolist(), "stop" if ended else "length", self.version))

    def exhausted(self) -> bool:
        # A batcher that has seen many requests is replaced once nothing decodes (see RECYCLE_AFTER).
        return self._closed.is_set() or (self._batcher.count >= RECYCLE_AFTER and not self._requests)

    def _main(self) -> None:
        while not self._closed.is_set():
            try:
                with decoding_mode(self.model):
                    self._batcher = ContinuousBatcher(
                        self.model, self.tokenizer, None, self.cfg, greedy=False,
                        max_total_length=self.context_length, slots=self.slots, device=self.device)
                    self._batcher.run(self)
            except Exception as e:  # the model failed mid-step: fail what was decoding, keep serving
                for p in self._requests.values():
                    p.resolve(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
                self._requests.clear()
        for p in self._drain(block=False):
            p.resolve(RuntimeError("the engine is closed"))


class BatchingEngine(_EngineBase):
    """``generate_fn(BatchedDataDict(input_ids, input_lengths, stop_strings), greedy) -> outputs`` (the
    ``GenerationInterface`` contract) over batches of the requests queued while the last one ran
    (greedy requests, temperature 0, in a batch of their own).
    A request's ``max_tokens`` below the generator's own limit keeps only that many sampled tokens;
    its temperature and top-p are the generator's (recorded as such)."""

    def __init__(self, generate_fn: Callable[[BatchedDataDict, bool], BatchedDataDict], tokenizer: Any, *,
                 context_length: int, max_batch: int = 256, version_fn: Callable[[], int] = lambda: 0,
                 gather_s: float = 0.025, max_gather_s: float = 1.0, expected_fn: Callable[[], int] = lambda: 0,
                 expect_gap_s: float = 0.2):
        super().__init__()
        self.generate_fn, self.tokenizer, self.context_length = generate_fn, tokenizer, context_length
        self.max_batch, self.version_fn, self.gather_s = max_batch, version_fn, gather_s
        self.max_gather_s = max_gather_s
        # How many requests to expect before a batch (the trainer's episodes still running, one
        # request each at a time; 0: unknown, the quiet gap alone decides).
        self.expected_fn = expected_fn
        # While expected requests are missing, the quiet gap that still ends the gathering: an episode
        # busy with its own work (a slow tool) must not hold the others' batch for max_gather_s.
        self.expect_gap_s = expect_gap_s
        self.batches = 0  # generate calls made (how well requests batched: requests / batches)
        self.requests = 0
        self._start("nemo-like-serve-batcher")

    def _main(self) -> None:
        carry: list[_Pending] = []
        while not self._closed.is_set() or carry:
            pending = carry + self._drain(block=not carry)
            if not pending:
                continue
            # Episodes send their turns over a few hundred milliseconds (HTTP, the programs' own work,
            # the server writing the last batch's answers): gather until every running episode has
            # asked (expected_fn) or none asked for expect_gap_s; with nothing known, until none came
            # for gather_s while the server is handling none; up to max_gather_s. So they generate as
            # one batch rather than the first few alone (a batch of one took a third of the time of
            # the batch of 128 after it, on the cores the programs needed to send the rest).
            deadline = time.monotonic() + self.max_gather_s
            while len(pending) < self.max_batch and not self._closed.is_set():
                expected = self.expected_fn()
                missing = expected - len(pending)
                if (expected and missing <= 0 and self.busy == 0) or time.monotonic() >= deadline:
                    break
                try:
                    item = self._queue.get(timeout=self.expect_gap_s if missing > 0 else self.gather_s)
                except queue.Empty:
                    if self.busy > 0 and time.monotonic() < deadline:
                        continue
                    break
                if item is None:
                    break
                pending.append(item)
            batch, carry = pending[: self.max_batch], pending[self.max_batch:]
            for greedy in (False, True):
                part = [p for p in batch if p.params.greedy == greedy]
                try:
                    if part:
                        self._run(part, greedy)
                except Exception as e:
                    for p in part:
                        p.resolve(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))

    def _run(self, batch: list[_Pending], greedy: bool) -> None:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(p.ids) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, : len(p.ids)] = torch.tensor(p.ids, dtype=torch.long)
        data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p.ids) for p in batch]))
        if any(p.params.stop for p in batch):
            data["stop_strings"] = [p.params.stop or None for p in batch]
        out = self.generate_fn(data, greedy)
        self.batches, self.requests = self.batches + 1, self.requests + len(batch)
        version = int(self.version_fn())
        for i, p in enumerate(batch):
            start, end = len(p.ids), int(out["unpadded_sequence_lengths"][i])
            toks, lps = out["output_ids"][i, start:end].tolist(), out["logprobs"][i, start:end].tolist()
            finish = "length" if bool(out["truncated"][i]) else "stop"
            if len(toks) > p.params.max_new_tokens:
                toks, lps, finish = toks[: p.params.max_new_tokens], lps[: p.params.max_new_tokens], "length"
            v = int(out["policy_version"][i]) if "policy_version" in out else version
            p.resolve(Generated(toks, lps, finish, v))


class StreamingEngine(_EngineBase):
    """Turns queued for a worker's continuous engine, which takes them over HTTP as they come
    (``models.generation.request_stream``: the ``/v1/nemo_like/engine/*`` routes call ``take`` and
    ``finish``) and answers each as soon as its row ends. Training uses it where the generator can
    serve requests (one worker holding the model): a turn that arrives while others decode joins
    them, where :class:`BatchingEngine` waits for the batch in progress to end.

    ``open_rollout`` before the episodes start, ``close_rollout`` once they have all ended: a
    ``take`` then says ``closed`` and the worker goes back to training."""

    def __init__(self, tokenizer: Any, *, context_length: int, version_fn: Callable[[], int] = lambda: 0):
        super().__init__()
        self.tokenizer, self.context_length, self.version_fn = tokenizer, context_length, version_fn
        self._taken: dict[str, _Pending] = {}
        self._open = False
        self._wake: asyncio.Event | None = None  # made on the server's loop, where take runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broken: str | None = None
        self.requests = 0

    def _check_open(self) -> None:
        if self._broken is not None:  # the worker stopped taking turns: this one would wait forever
            raise RuntimeError(self._broken)

    def _queued(self) -> None:
        self._event().set()  # a take waiting for turns returns now

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
        return self._wake

    def open_rollout(self) -> None:
        self._open, self._broken = True, None

    def fail(self, why: str) -> None:
        """The worker stopped taking turns: every turn queued or taken fails with ``why``, and so do
        new ones until the next rollout opens."""
        self._broken = why
        for p in [*self._taken.values(), *self._drain(block=False)]:
            p.resolve(RuntimeError(why))
        self._taken.clear()

    def close_rollout(self) -> None:
        self._open = False
        if self._wake is not None and self._loop is not None:  # a take waiting now returns at once
            self._loop.call_soon_threadsafe(self._wake.set)

    async def take(self, wait_s: float) -> dict[str, Any]:
        """The turns queued now (waiting up to ``wait_s`` for one), as the worker adds them to its
        batcher; ``closed`` once the rollout is over and none is left."""
        if self._queue.empty() and self._open:
            wake = self._event()
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), wait_s)
            except TimeoutError:
                pass
        out = []
        for p in self._drain(block=False):
            rid = str(self.requests)  # unique for the engine's life: a stale answer matches nothing
            self.requests += 1
            self._taken[rid] = p
            greedy = p.params.greedy
            out.append({"id": rid, "ids": p.ids, "max_new_tokens": p.params.max_new_tokens,
                        "stop": p.params.stop or None, "greedy": greedy,
                        "temperature": None if greedy else p.params.temperature,
                        "top_p": None if greedy else p.params.top_p})
        return {"requests": out, "closed": not self._open and not out}

    def finish(self, results: list[dict[str, Any]]) -> int:
        """Answers from the worker (``{"id", "token_ids", "logprobs", "finish_reason"}`` or
        ``{"id", "error"}``); how many matched a turn taken."""
        version, matched = int(self.version_fn()), 0
        for r in results:
            p = self._taken.pop(str(r.get("id")), None)
            if p is None:
                continue
            matched += 1
            if r.get("error") is not None:
                p.resolve(RuntimeError(f"generation failed: {r['error']}"))
            else:
                p.resolve(Generated(list(r["token_ids"]), list(r["logprobs"]), str(r["finish_reason"]), version))
        return matched

    def close(self) -> None:
        super().close()
        self.fail("the engine is closed")
