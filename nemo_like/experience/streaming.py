"""Streaming multi-turn rollouts: an episode's next turn starts as soon as its environment answers.

The turn-by-turn loop (:func:`nemo_like.experience.rollouts.run_multi_turn_rollout`) generates
every active sample's turn, waits for the slowest, grades them all, and only then starts the next
turn: a tool that waits on I/O stalls the whole batch once per turn, and so does the batch's
longest answer. Here the continuous engine (``models/generation/engine.py``) is fed by an
:class:`EpisodeStream`: a sample whose turn ends goes to its environment while the other rows keep
decoding, and the environment's answer comes back as a new request (the conversation so far,
prefilled again: the tiny and SmolLM2-sized models prefill a turn in one forward), admitted into
the next free rows.

Environment calls are batched per task: at most ``step_concurrency[task]`` calls (the environment's
``max_concurrent_steps``; 1 by default) are in flight at once. With one, whatever waits goes when it
is free; with more, each call carries an even share of the samples still to come, and the last free
one carries whatever ends last (see ``_dispatch``). The per-call time limit, the restart of a hung
actor and the unscorable-sample rules are those of ``calculate_rewards``.

This runs in the process that holds the model (a training worker with one rank, or a rollout
worker) and calls the environment actors from there.
"""

from __future__ import annotations

import math
import time
from typing import Any

import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.supervision import first_line_of_error
from nemo_like.experience.rollouts import Episodes, _restart, call_failed, run_multi_turn_rollout, split_return
from nemo_like.models.generation.engine import ContinuousBatcher, decoding_mode, unsupported_reason
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig, GenerationInterface
from nemo_like.models.generation.prefix_cache import PrefixCache

# What a streamed rollout needs of a batch; its other fields stay with the caller.
EPISODE_KEYS = ("message_log", "extra_env_info", "task_name", "stop_strings")


def with_episodes(batch: BatchedDataDict, episodes: BatchedDataDict) -> BatchedDataDict:
    """``batch`` with the fields of a streamed rollout of its ``EPISODE_KEYS``."""
    out = BatchedDataDict(batch)
    out.update(episodes)
    return out


class EpisodeStream:
    """The engine's request source for a batch of episodes (``RequestSource`` of the engine)."""

    def __init__(self, episodes: Episodes, envs: dict[str, Any], step_timeouts: dict[str, float] | None,
                 version: int | None = None, step_concurrency: dict[str, int] | None = None,
                 greedy: bool | None = None, calls_in_flight: dict[str, int] | None = None):
        # ``version``: of the weights a turn starting now is generated with (a shared engine moves it
        # on at a refit; each turn keeps the one it started with). ``greedy``: None, as the engine.
        # ``calls_in_flight``: task -> environment calls in flight, shared by the streams of one engine:
        # a task's slots (``step_concurrency``) are the worker's, not each stream's, or the extra calls
        # would queue in the actor while their time limit runs.
        self.ep, self.envs, self.version, self.greedy = episodes, envs, version, greedy
        self.calls_in_flight = calls_in_flight if calls_in_flight is not None else {}
        self.limits = step_timeouts or {}
        self.concurrency = step_concurrency or {}
        for task in set(episodes.task_names) - set(envs):
            raise KeyError(f"no environment for task {task!r}; configured: {sorted(envs)}")
        self.ready = list(range(episodes.n))  # episodes whose next turn can be queued
        self.request_of: dict[int, int] = {}  # engine request -> episode
        self.turn_version: dict[int, int | None] = {}  # engine request -> weights version at its start
        self.to_grade: dict[str, list[int]] = {}
        # Calls in flight: ref -> (task, its samples, deadline).
        self.in_flight: dict[ray.ObjectRef, tuple[str, list[int], float | None]] = {}
        self.env_wait_s = 0.0  # none of this stream's rows in the engine, only its environments working
        self._idle_since: float | None = None
        self.num_calls = 0

    # ---- RequestSource ------------------------------------------------------------------------
    def poll(self, batcher: ContinuousBatcher, block: bool) -> None:
        self._collect(wait=False)
        while block and not self.ready and self.in_flight:
            self._collect(wait=True)
        ready = [i for i in self.ready if self.ep.wants_turn(i)]
        self.ready = []
        if ready:
            rows = [self.ep.prompt_ids(i) for i in ready]
            ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=batcher.pad_id)
            lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
            reqs = batcher.add(ids, lengths, [self.ep.stop_strings[i] for i in ready], greedy=self.greedy)
            self.request_of.update(zip(reqs, ready))
            self.turn_version.update((r, self.version) for r in reqs)
        self._dispatch()  # episodes that ended are no longer counted as to come
        self._mark_idle()

    def restamp(self, queued: set[int], version: int) -> None:
        """Weights changed: the turns still queued (not prefilled) start on ``version``."""
        for r in queued & self.turn_version.keys():
            self.turn_version[r] = version

    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None:
        for r in requests:
            i = self.request_of.pop(r)
            ids, logprobs, ended = batcher.result(r)
            self.ep.add_turn(i, ids, logprobs, hit_limit=not ended, version=self.turn_version.pop(r))
            self.to_grade.setdefault(self.ep.task_names[i], []).append(i)
        self._dispatch()
        self._mark_idle()

    def exhausted(self) -> bool:
        return not self.ready and not self.in_flight and not any(self.to_grade.values())

    def release_calls(self) -> None:
        """A stream that ends with calls in flight (its engine failed) gives their slots back."""
        for task, _, _ in self.in_flight.values():
            self.calls_in_flight[task] -= 1
        self.in_flight.clear()

    # ---- for an engine shared by several streams (models/generation/shared_engine.py) ---------------
    def waits_on(self) -> tuple[list[ray.ObjectRef], float | None]:
        """The environment calls in flight and the earliest of their deadlines (monotonic), if any."""
        deadlines = [d for _, _, d in self.in_flight.values() if d is not None]
        return list(self.in_flight), min(deadlines) if deadlines else None

    def _mark_idle(self) -> None:
        """Count the time with none of this stream's rows in the engine while its environments work."""
        now = time.perf_counter()
        idle = not self.request_of and not self.exhausted()
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self.env_wait_s += now - self._idle_since
            self._idle_since = None

    # ---- environment calls --------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send each task's waiting samples in calls of a useful size.

        A task with one call slot sends whatever waits whenever the slot is free. A task with ``c``
        > 1 slots splits the samples still to come (waiting or decoding) evenly over its free slots,
        and keeps its last free slot for the samples that end last: sending each sample the moment
        it ends would spend every slot on the first few (a tool that waits a second per call then
        holds the rest for a second more)."""
        if not any(self.to_grade.values()):  # called every decode step: nothing to send, nothing to count
            return
        ep = self.ep
        busy = self.calls_in_flight
        decoding: dict[str, int] = {}
        for i in [*self.request_of.values(), *(i for i in self.ready if ep.wants_turn(i))]:
            decoding[ep.task_names[i]] = decoding.get(ep.task_names[i], 0) + 1
        for task, idx in self.to_grade.items():
            slots = self.concurrency.get(task, 1)
            free, left = slots - busy.get(task, 0), decoding.get(task, 0)
            if not idx or free <= 0:
                continue
            if slots > 1 and left and (free == 1 or len(idx) < -(-(len(idx) + left) // free)):
                continue
            ref = self.envs[task].step.remote([ep.message_logs[i] for i in idx], [ep.env_infos[i] for i in idx])
            limit = self.limits.get(task, math.inf)
            self.in_flight[ref] = (task, idx, time.monotonic() + limit if math.isfinite(limit) else None)
            busy[task] = busy.get(task, 0) + 1
            self.to_grade[task] = []
            self.num_calls += 1

    def _collect(self, wait: bool) -> None:
        """Take the answers of the calls that have returned (``wait``: block until one has, or one
        is past its time limit), then send what waited behind them."""
        if not self.in_flight:
            return
        refs = list(self.in_flight)
        deadlines = [d for _, _, d in self.in_flight.values() if d is not None]
        timeout = 0 if not wait else (max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
        done, _ = ray.wait(refs, num_returns=1 if wait else len(refs), timeout=timeout)
        if done:  # and any other that returned meanwhile
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        now = time.monotonic()
        for ref, (task, idx, deadline) in list(self.in_flight.items()):
            if ref in done:
                try:
                    rets, m, err = split_return(task, ray.get(ref), len(idx))
                except Exception as e:  # a crashed grader must not end the run
                    rets, m, err = call_failed(task, len(idx), first_line_of_error(e), "step_errors")
            elif deadline is not None and now >= deadline:
                _restart(self.envs[task], ref)
                rets, m, err = call_failed(task, len(idx), f"step timed out after {self.limits[task]:g} s; "
                                           "actor restarted", "step_timeouts")
            else:
                continue
            del self.in_flight[ref]
            self.calls_in_flight[task] -= 1
            self.ep.add_env_metrics(m, len(idx))
            self.ready += [i for i, ret in zip(idx, rets) if self.ep.apply_return(i, ret, err)]
        self._dispatch()


class _LocalGenerator(GenerationInterface):
    """This process's model behind ``generate``, for the turn-by-turn fallback."""

    def __init__(self, generate):
        self._generate = generate

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        return self._generate(data, greedy)


def stream_episodes(model, tokenizer, batch: BatchedDataDict, envs: dict[str, Any], cfg: GenerationConfig, *,
                    greedy: bool, max_total_length: int, slots: int, device: torch.device, max_turns: int,
                    max_seq_len: int, step_timeouts: dict[str, float] | None = None, version: int | None = None,
                    step_concurrency: dict[str, int] | None = None, prefix_cache: PrefixCache | None = None
                    ) -> tuple[BatchedDataDict, dict[str, float]]:
    """``run_multi_turn_rollout``'s result for ``batch`` (its ``EPISODE_KEYS``), generated by this
    process's ``model`` with the continuous engine fed turn by turn per episode. A model the engine
    cannot drive is rolled out turn by turn with HF ``generate``.

    Metrics beside the rollout's: ``generation_s`` is the wall time less the time spent with no
    row decoding, waiting only for environments (``stream/env_wait_s``); ``stream/env_calls``."""
    if unsupported_reason(model) is not None:
        def generate(data: BatchedDataDict, g: bool) -> BatchedDataDict:
            out = hf_generate(model, tokenizer, data, cfg, greedy=g, max_total_length=max_total_length,
                              micro_batch_size=slots, synced=False, device=device, prefix_cache=prefix_cache)
            if version is not None:  # a rollout worker's samples say which weights made them
                out["policy_version"] = torch.full((out.size,), version, dtype=torch.int64)
            return out
        return run_multi_turn_rollout(_LocalGenerator(generate), batch, tokenizer, envs, max_turns=max_turns,
                                      max_seq_len=max_seq_len, greedy=greedy, step_timeouts=step_timeouts)
    source = open_stream(batch, tokenizer, envs, max_turns=max_turns, max_seq_len=max_seq_len,
                         step_timeouts=step_timeouts, version=version, step_concurrency=step_concurrency)
    t0 = time.perf_counter()
    with decoding_mode(model):
        ContinuousBatcher(model, tokenizer, None, cfg, greedy=greedy, max_total_length=max_total_length,
                          slots=slots, device=device, prefix_cache=prefix_cache).run(source)
    return close_stream(source, time.perf_counter() - t0)


def open_stream(batch: BatchedDataDict, tokenizer, envs: dict[str, Any], *, max_turns: int, max_seq_len: int,
                step_timeouts: dict[str, float] | None = None, version: int | None = None,
                step_concurrency: dict[str, int] | None = None, greedy: bool | None = None,
                calls_in_flight: dict[str, int] | None = None) -> EpisodeStream:
    """The request source of ``batch``'s episodes, for an engine to run (``close_stream`` after)."""
    ep = Episodes(batch, tokenizer, max_turns=max_turns, max_seq_len=max_seq_len)
    return EpisodeStream(ep, envs, step_timeouts, version, step_concurrency, greedy, calls_in_flight)


def close_stream(source: EpisodeStream, wall_s: float) -> tuple[BatchedDataDict, dict[str, float]]:
    """The rollout and metrics of a stream an engine ran to its end in ``wall_s`` seconds.

    ``generation_s`` is the wall time less ``stream/env_wait_s``: the time with none of the stream's
    rows in the engine, only its environments working."""
    ep = source.ep
    # Out of inference mode: the training step embeds these ids and must be able to save them.
    for log in ep.message_logs:
        for k, m in enumerate(log):
            if "generation_logprobs" in m and m["token_ids"].is_inference():
                log[k] = m | {"token_ids": m["token_ids"].clone(), "generation_logprobs": m["generation_logprobs"].clone()}
    source._mark_idle()  # closes the last wait, if the stream ended on one
    out, metrics = ep.result(generation_s=max(0.0, wall_s - source.env_wait_s))
    return out, metrics | {"stream/env_wait_s": source.env_wait_s, "stream/env_calls": float(source.num_calls)}
