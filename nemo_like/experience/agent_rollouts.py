"""Rollouts of agent tasks: the agent programs talk to the trainer's OpenAI-compatible server, and the
training samples are built from what the server recorded (``serve.sessions``), token for token.

:class:`AgentServer` is the trainer's server: a :class:`~nemo_like.serve.engines.BatchingEngine` over
the run's generator (the policy, or its rollout group), so every request an agent makes is sampled
by the weights being trained, with the trainer's sampling settings, batched with the other agents'
requests. :func:`run_agent_rollout` runs one batch of episodes and returns the rollout contract of
``run_multi_turn_rollout`` (``message_log``, ``total_reward``, ``num_turns``...).

An episode whose program failed, timed out or made no request is unscorable (NaN reward, counted in
``agent/failed`` / ``agent/timeouts``); the run goes on. When the program rewrote its history the
episode has several samples (``agent/prefix_breaks``); this trainer keeps one row per episode, the
last run of joined turns, and counts the turns left out in ``agent/turns_dropped``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.registry import get_env_class
from nemo_like.experience.rollouts import run_parts
from nemo_like.serve.engines import BatchingEngine, StreamingEngine
from nemo_like.serve.server import ServerHandle, start_server

SERVED_NAME = "policy"


class ServingError(RuntimeError):
    """The worker taking the server's turns failed: the run cannot generate."""


def is_agent_env(env_name: str) -> bool:
    """Whether the environment registered as ``env_name`` runs agent programs (``run_episodes``)."""
    try:
        return bool(getattr(get_env_class(env_name), "is_agent", False))
    except (KeyError, ImportError):
        return False


class AgentServer:
    """The trainer's server over ``generator`` (``GenerationInterface``), started once per run."""

    def __init__(self, generator: Any, tokenizer: Any, *, context_length: int, host: str = "127.0.0.1",
                 port: int = 0, version_fn: Any = lambda: 0, port_key: str = "env.agent.port"):
        self.generator = generator
        # Where the generator's worker can take the turns into its continuous engine as they come,
        # it does (a turn joins the rows decoding); else they are batched for generate().
        self.streaming = bool(getattr(generator, "serves_requests", lambda: False)())
        self.stats: dict[str, float] = {}
        self.engine = (StreamingEngine(tokenizer, context_length=context_length, version_fn=version_fn)
                       if self.streaming else
                       BatchingEngine(lambda data, greedy: self.generator.generate(data, greedy=greedy), tokenizer,
                                      context_length=context_length, version_fn=version_fn))
        try:
            self.handle: ServerHandle = start_server(self.engine, model_name=SERVED_NAME, host=host, port=port,
                                                     fixed_sampling=True, key=port_key)
        except Exception:
            self.engine.close()
            raise
        if not self.streaming:  # a batch waits for every running episode's request (BatchingEngine)
            self.engine.expected_fn = self.handle.sessions.running

    @classmethod
    def for_run(cls, config: Any, generator: Any, tokenizer: Any, *, version_fn: Any) -> AgentServer:
        """The server of a GRPO run (``MasterConfig``): bound where the first agent environment's options
        (``env.<name>.host``/``port``) say, sampling up to the policy's context length. One server serves
        every agent environment of the run (``env.agent`` and ``env.verifiers`` alike)."""
        name, opts = next(((e, o or {}) for e, o in config.env.items() if is_agent_env(e)), ("agent", {}))
        return cls(generator, copy.deepcopy(tokenizer), context_length=config.policy.max_total_sequence_length,
                   host=opts.get("host", "127.0.0.1"), port=opts.get("port", 0), version_fn=version_fn,
                   port_key=f"env.{name}.port")

    def run(self, episodes: ray.ObjectRef) -> Any:
        """The result of ``episodes`` (an agent actor's ``run_episodes``), the worker taking the server's
        turns meanwhile when streaming. A worker that stops serving fails the turns it left (the
        episodes end at once, not at their time limit) and raises ServingError after them."""
        if not self.streaming:
            return ray.get(episodes)
        self.engine.open_rollout()
        serving = self.generator.start_serving(self.handle.url, self.handle.api_key)
        failed = None
        try:
            ready, _ = ray.wait([episodes, *serving], num_returns=1)
            if ready[0] != episodes:
                try:
                    self.generator.finish_serving(serving)
                    failed = "the worker stopped taking the server's turns before the episodes ended"
                except Exception as e:  # noqa: BLE001 - said to every waiting turn, raised below
                    failed = f"the worker serving the episodes failed: {type(e).__name__}: {str(e)[:300]}"
                self.engine.fail(failed)
            results = ray.get(episodes)
        finally:
            self.engine.close_rollout()
            if failed is None:
                self.stats = self.generator.finish_serving(serving)
        if failed is not None:
            raise ServingError(failed)
        return results

    def close(self) -> None:
        self.handle.stop()
        self.engine.close()


def _has_method(actor: Any, name: str) -> bool:
    try:
        getattr(actor, name)
        return True
    except AttributeError:
        return False


def agent_row(batch: BatchedDataDict, i: int) -> dict[str, Any]:
    """What an agent program gets for sample i: the dataset row's columns (``problem``,
    ``ground_truth``...; the program may score itself with them), ``messages`` (the problem as one
    user message, or the row's conversation) and ``task_name``. The program owns its prompts: the
    task's system prompt and prompt format are not applied."""
    info = dict(batch["extra_env_info"][i] or {})
    problem = info.get("problem")
    if isinstance(problem, list):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in problem if isinstance(m, dict)]
    else:
        messages = [{"role": "user", "content": "" if problem is None else str(problem)}]
    return info | {"messages": messages, "task_name": batch["task_name"][i]}


def run_agent_rollout(server: AgentServer, actor: Any, batch: BatchedDataDict, tokenizer: Any, *, greedy: bool,
                      max_seq_len: int) -> tuple[BatchedDataDict, dict[str, float]]:
    """One episode per sample of ``batch`` by the agent environment ``actor``; the rollout contract."""
    n = batch.size
    # Each episode's result as it ends, and its session with it (an environment with stream_episodes):
    # the batcher then waits only for the requests of the episodes still running.
    streamed = not server.streaming and _has_method(actor, "stream_episodes")
    sessions = []
    for i in range(n):
        s = server.handle.sessions.open(tag=i, awaited=streamed)
        s.greedy = greedy
        sessions.append(s)
    t0 = time.perf_counter()
    args = ([agent_row(batch, i) for i in range(n)], server.handle.base_url, [s.key for s in sessions], SERVED_NAME)
    try:
        if streamed:
            results = [None] * n
            for ref in actor.stream_episodes.remote(*args):
                i, res = ray.get(ref)
                results[i] = res
                server.handle.sessions.end(sessions[i])
        else:
            results = server.run(actor.run_episodes.remote(*args))
    except ServingError:
        raise
    except Exception as e:  # the actor died (and its retries): every episode unscorable, the run goes on
        results = [{"reward": None, "metrics": {}, "timed_out": False,
                    "error": f"the agent environment failed: {type(e).__name__}: {str(e)[:300]}"}] * n
    wall = time.perf_counter() - t0
    for s in sessions:
        server.handle.sessions.end(s)

    logs, rewards, errors = [], torch.zeros(n), [None] * n
    turns, gen_len = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    counts = {"agent/failed": 0.0, "agent/timeouts": 0.0, "agent/prefix_breaks": 0.0, "agent/turns_dropped": 0.0,
              "agent/requests": 0.0, "agent/malformed_tool_calls": 0.0}
    extra: dict[str, list[float]] = {}
    for i, (s, res) in enumerate(zip(sessions, results)):
        reward, error = res.get("reward"), res.get("error")
        if reward is None and error is None:  # a command that printed nothing: the reward it posted
            reward = s.reward
            error = None if reward is not None else "the program printed no reward and posted none"
        samples = s.samples(tokenizer)
        if not samples and error is None:
            error = "the agent made no request to the server"
        counts["agent/timeouts"] += float(bool(res.get("timed_out")))
        counts["agent/prefix_breaks"] += s.prefix_breaks
        counts["agent/requests"] += len(s.turns)
        counts["agent/malformed_tool_calls"] += s.malformed_tool_calls
        for k, v in (res.get("metrics") or {}).items():
            extra.setdefault(f"agent/{k}", []).append(v)
        if samples:
            log = samples[-1]
            counts["agent/turns_dropped"] += sum(1 for lg in samples[:-1] for m in lg if m["role"] == "assistant")
        else:  # the prompt alone: nothing to train, the row is unscorable
            log = [dict(m) for m in batch["message_log"][i]]
        if error is not None:
            counts["agent/failed"] += 1
            reward = math.nan
        logs.append(log)
        rewards[i], errors[i] = float(reward), error
        assistant = [m for m in log if m["role"] == "assistant"]
        turns[i] = len(assistant)
        gen_len[i] = sum(len(m["token_ids"]) for m in assistant)
        last = [t for t in s.turns if t.sampled_ids]
        truncated[i] = bool(last) and (last[-1].finish_reason == "length" or
                                       len(last[-1].prompt_ids) + len(last[-1].sampled_ids) >= max_seq_len)
    out = BatchedDataDict(batch)
    out["message_log"], out["total_reward"], out["grading_error"] = logs, rewards, errors
    out["truncated"], out["generation_lengths"], out["num_turns"] = truncated, gen_len, turns
    out["policy_version"] = torch.tensor(
        [min([int(m["policy_version"]) for m in lg if m["role"] == "assistant"] or [0]) for lg in logs])
    metrics = {"response_length_mean": float(gen_len.float().mean()) if n else 0.0,
               "truncation_rate": float(truncated.float().mean()) if n else 0.0,
               "turns_per_sample": float(turns.float().mean()) if n else 0.0,
               "unterminated_rate": 0.0, "generation_s": wall} | counts
    metrics |= {k: sum(v) / len(v) for k, v in extra.items()}
    return out, metrics


def rollout_with_agents(batch: BatchedDataDict, task_envs: dict[str, str], envs: dict[str, Any],
                        env_rollout: Callable[..., tuple[BatchedDataDict, dict[str, float]]],
                        server: Callable[[], AgentServer], tokenizer: Any, *, greedy: bool,
                        max_seq_len: int) -> tuple[BatchedDataDict, dict[str, float]]:
    """``batch`` rolled out: the samples of agent tasks (``task_envs`` maps task -> environment name) by
    their environments' programs through ``server()`` (started on first need), the rest by
    ``env_rollout(batch, tokenizer)``; each part on its own thread with its own tokenizer (a fast
    tokenizer must not be shared between threads)."""
    agents = sorted(t for t, e in task_envs.items() if is_agent_env(e) and t in batch["task_name"])
    if not agents:
        return env_rollout(batch, tokenizer)
    srv = server()
    parts = [[i for i, t in enumerate(batch["task_name"]) if t == a] for a in agents]
    parts.append([i for i, t in enumerate(batch["task_name"]) if t not in agents])
    runs = [lambda b, a=a: run_agent_rollout(srv, envs[a], b, copy.deepcopy(tokenizer), greedy=greedy,
                                             max_seq_len=max_seq_len)
            for a in agents] + [lambda b: env_rollout(b, copy.deepcopy(tokenizer))]
    return run_parts(batch, runs, parts)
