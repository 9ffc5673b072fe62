"""Rollouts: turn prompts (message logs) into completed, graded episodes.

Single-turn generation is the one-turn case; environments are Ray actors reached by task name.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from nemo_like.distributed import stall
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.interfaces import EnvironmentReturn
from nemo_like.environments.supervision import START_TIMEOUT_S, first_line_of_error
from nemo_like.experience.env_waves import EnvTimes
from nemo_like.models.generation.interfaces import GenerationInterface


def flatten_message_logs(message_logs: list[list[dict]], pad_id: int) -> BatchedDataDict:
    """Concatenate each sample's messages into one row: input_ids, input_lengths, token_mask
    (1 on assistant tokens) and generation_logprobs (the sampler's log-probs, 0 elsewhere)."""
    rows, masks, glps = [], [], []
    for log in message_logs:
        ids = [m["token_ids"] for m in log]
        rows.append(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long))
        masks.append(torch.cat([torch.full_like(m["token_ids"], int(m["role"] == "assistant" and m.get("loss", True)))
                                for m in log]) if log else torch.zeros(0, dtype=torch.long))
        glps.append(torch.cat([m.get("generation_logprobs", torch.zeros(len(m["token_ids"])))
                               for m in log]).float() if log else torch.zeros(0))
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(int(lengths.max()) if len(rows) else 0, 1)
    out_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    out_mask = torch.zeros((len(rows), width), dtype=torch.long)
    out_glp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m, g) in enumerate(zip(rows, masks, glps)):
        out_ids[i, : len(r)], out_mask[i, : len(r)], out_glp[i, : len(r)] = r, m, g
    return BatchedDataDict(input_ids=out_ids, input_lengths=lengths, token_mask=out_mask,
                           generation_logprobs=out_glp)


def calculate_rewards(message_logs: list[list[dict]], task_names: list[str], env_infos: list[dict],
                      envs: dict[str, Any], step_timeouts: dict[str, float] | None = None
                      ) -> tuple[torch.Tensor, list[EnvironmentReturn | None], dict[str, float], list[str | None]]:
    """Group samples by task, send each group to its environment actor in one call, and put the
    results back in batch order.

    A call that raises, whose actor died, or that runs past ``step_timeouts[task]`` seconds leaves
    its samples unscorable: reward NaN (advantage 0, out of the baseline), return None, and the
    error's first line in the fourth output; counted as ``env/<task>/step_errors`` or
    ``env/<task>/step_timeouts``. A timed-out actor is restarted, so a hung grader costs one call,
    not the run.
    """
    return PendingRewards(message_logs, task_names, env_infos, envs, step_timeouts).collect()


class PendingRewards:
    """``calculate_rewards``'s calls, sent at construction without waiting (``env_times``: time each,
    as after ``turn``); ``collect()`` waits for them and returns ``calculate_rewards``'s outputs."""

    def __init__(self, message_logs: list[list[dict]], task_names: list[str], env_infos: list[dict],
                 envs: dict[str, Any], step_timeouts: dict[str, float] | None = None,
                 env_times: EnvTimes | None = None, turn: int = 0):
        self.n, self.envs, self.step_timeouts = len(message_logs), envs, step_timeouts
        self.by_task: dict[str, list[int]] = {}
        for i, t in enumerate(task_names):
            self.by_task.setdefault(t, []).append(i)
        self.futures, self.deadlines = {}, {}
        for task, idx in self.by_task.items():
            if task not in envs:
                raise KeyError(f"no environment for task {task!r}; configured: {sorted(envs)}")
            self.futures[task] = envs[task].step.remote([message_logs[i] for i in idx], [env_infos[i] for i in idx])
            if env_times is not None:
                env_times.watch(task, turn, self.futures[task])
            limit = (step_timeouts or {}).get(task, math.inf)
            self.deadlines[task] = time.monotonic() + limit if math.isfinite(limit) else None

    def collect(self) -> tuple[torch.Tensor, list[EnvironmentReturn | None], dict[str, float], list[str | None]]:
        n = self.n
        rewards = torch.zeros(n, dtype=torch.float32)
        returns: list[EnvironmentReturn | None] = [None] * n
        errors: list[str | None] = [None] * n
        metrics: dict[str, float] = {}
        for task, fut in self.futures.items():
            idx = self.by_task[task]
            # A call with a time limit ends by itself (and its actor's restart within START_TIMEOUT_S):
            # not a stall before then (grpo.stall_watch).
            ends = None if self.deadlines[task] is None else self.deadlines[task] + START_TIMEOUT_S
            with stall.waiting_for(lambda task=task: f"the environment of task {task!r} in 'step'", ends):
                try:
                    left = None if self.deadlines[task] is None else max(0.0, self.deadlines[task] - time.monotonic())
                    ret: EnvironmentReturn = ray.get(fut, timeout=left)
                except ray.exceptions.GetTimeoutError:
                    _restart(self.envs[task], fut)
                    rets, m, err = call_failed(task, len(idx), f"step timed out after {self.step_timeouts[task]:g} "
                                               "s; actor restarted", "step_timeouts")
                except Exception as e:  # a crashed grader must not end the run
                    rets, m, err = call_failed(task, len(idx), first_line_of_error(e), "step_errors")
                else:
                    rets, m, err = split_return(task, ret, len(idx))
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
            for j, i in enumerate(idx):
                returns[i], errors[i] = rets[j], err
                rewards[i] = math.nan if rets[j] is None else float(rets[j].rewards[0])
        return rewards, returns, metrics, errors


def split_return(task: str, ret: EnvironmentReturn, n: int
                 ) -> tuple[list[EnvironmentReturn], dict[str, float], None]:
    """One environment call's answer for ``n`` samples as n one-sample returns, and its metrics
    named ``env/<task>/<key>``."""
    rets = [EnvironmentReturn([ret.observations[j]], [ret.metadata[j]], [ret.next_stop_strings[j]],
                              ret.rewards[j : j + 1], ret.terminateds[j : j + 1], {}) for j in range(n)]
    return rets, {f"env/{task}/{k}": float(v) for k, v in (ret.metrics or {}).items()}, None


def call_failed(task: str, n: int, err: str, key: str) -> tuple[list[None], dict[str, float], str]:
    """A call that raised or timed out: its ``n`` samples are unscorable; counted as ``env/<task>/<key>``."""
    print(f"[nemo_like] environment {task!r} could not grade {n} samples (unscorable): {err}")
    return [None] * n, {f"env/{task}/{key}": float(n)}, err


def _restart(actor: Any, fut: Any) -> None:
    """Cancel the hung call first (else Ray retries it on the restarted actor), kill the actor's
    process so Ray starts a fresh one (its ``max_restarts`` allows it), and wait until it is up:
    the next step's time limit must not be spent on the restart."""
    try:
        ray.cancel(fut)
    except Exception:
        pass
    try:
        ray.kill(actor, no_restart=False)
        ray.get(actor.__ray_ready__.remote(), timeout=START_TIMEOUT_S)
    except Exception as e:  # could not come back: the next call finds out and is counted then
        print(f"[nemo_like] could not restart a hung environment actor: {first_line_of_error(e)}")


def _turn_closer(tokenizer) -> str:
    """What the chat template puts after an assistant message's content (ChatML: "<|im_end|>\\n")."""
    marker = "\x00NEMO_LIKE\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "assistant", "content": marker}], tokenize=False)
        return text.split(marker, 1)[1]
    except Exception:  # a template that cannot render a lone assistant message
        return (tokenizer.eos_token or "") + "\n"


_CONTENT_MARKER = "\x00NEMO_LIKE_OBSERVATION\x00"


def observation_token_ids(tokenizer, observation: dict, *, assistant_ended_with_eos: bool) -> torch.Tensor:
    """Token ids that follow an assistant turn: the end of that turn (unless the model already
    emitted EOS), the environment's message rendered by the chat template, and the next
    assistant header. None of these tokens carry loss.

    The message's content is untrusted text (a tool's output, a program's stderr, an echo of the
    model's own answer): it is encoded as plain characters, so a literal "<|im_end|>" in it can
    never become the special token that ends a turn. Only the template's own markup is encoded
    with special tokens."""
    closer = _turn_closer(tokenizer)
    if assistant_ended_with_eos and tokenizer.eos_token and closer.startswith(tokenizer.eos_token):
        closer = closer[len(tokenizer.eos_token):]
    content = str(observation.get("content", ""))
    msg = {"role": observation.get("role", "environment"), "content": _CONTENT_MARKER}
    try:
        body = tokenizer.apply_chat_template([msg], tokenize=False, add_generation_prompt=True)
    except Exception:  # e.g. a template without a "tool" role: fall back to plain text
        body = f"{_CONTENT_MARKER}\n"
    head, found, tail = body.partition(_CONTENT_MARKER)
    if not found:  # a template that rewrites content: the message as plain text, nothing else
        head, tail = "", "\n"

    def encode(text: str, *, plain: bool) -> list[int]:
        if not text:
            return []
        return tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"]

    ids = encode(closer + head, plain=False) + encode(content, plain=True) + encode(tail, plain=False)
    return torch.tensor(ids, dtype=torch.long)


class Episodes:
    """The per-sample state of a batch of multi-turn episodes: the turn-by-turn loop below and the
    streaming rollout (``nemo_like.experience.streaming``, each episode's next turn starts as soon
    as its environment answers) move it by the same rules.

    A sample stops when its environment says terminated, when its observation or the next turn
    would not fit in ``max_seq_len`` (truncated, counted; no row ever exceeds it), or after
    ``max_turns`` assistant turns. Its reward is the sum of the rewards its environment gave; if
    grading failed at any turn it is NaN (unscorable) and ``grading_error`` holds why. Environment
    tokens are appended with loss off."""

    def __init__(self, batch: BatchedDataDict, tokenizer, *, max_turns: int, max_seq_len: int):
        n = self.n = len(batch["message_log"])
        self.batch, self.tokenizer, self.max_turns, self.max_seq_len = batch, tokenizer, max_turns, max_seq_len
        self.message_logs = [copy.copy(log) for log in batch["message_log"]]
        self.env_infos = [copy.copy(m) for m in batch["extra_env_info"]]
        self.task_names = list(batch["task_name"])
        self.stop_strings: list[list[str] | None] = list(batch["stop_strings"]) if "stop_strings" in batch else [None] * n
        self.rewards = torch.zeros(n, dtype=torch.float32)
        self.grading_errors: list[str | None] = [None] * n
        self.lengths = [sum(len(m["token_ids"]) for m in log) for log in self.message_logs]
        self.turns = torch.zeros(n, dtype=torch.long)
        self.truncated = torch.zeros(n, dtype=torch.bool)
        self.terminated = torch.zeros(n, dtype=torch.bool)
        self.gen_lengths = torch.zeros(n, dtype=torch.long)
        self.ended_eos = [False] * n  # the last assistant turn ended with EOS (its closer is shorter)
        # The oldest weights version any turn was generated with (a separate rollout group reports it).
        self.versions: list[int | None] = [None] * n
        self.env_metrics: dict[str, list[tuple[float, int]]] = {}

    def wants_turn(self, i: int) -> bool:
        """Whether sample i gets another assistant turn; no room for even one new token: the sample
        is over, truncated."""
        if self.turns[i] >= self.max_turns:
            return False
        if self.lengths[i] >= self.max_seq_len:
            self.truncated[i] = True
            return False
        return True

    def prompt_ids(self, i: int) -> torch.Tensor:
        ids = [m["token_ids"] for m in self.message_logs[i]]
        return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)

    def add_turn(self, i: int, ids: torch.Tensor, logprobs: torch.Tensor, *, hit_limit: bool,
                 version: int | None = None) -> None:
        """Append the assistant's turn (``hit_limit``: it hit its token cap; the environment still
        decides whether the episode goes on). ``version``: of the weights it started with, kept on
        the message as ``policy_version``; the episode's is its oldest turn's."""
        msg = {"role": "assistant", "content": self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
               "token_ids": ids, "generation_logprobs": logprobs}
        if version is not None:
            msg["policy_version"] = int(version)
        self.message_logs[i].append(msg)
        self.turns[i] += 1
        self.gen_lengths[i] += len(ids)
        self.lengths[i] += len(ids)
        self.ended_eos[i] = len(ids) > 0 and int(ids[-1]) == self.tokenizer.eos_token_id
        if version is not None:
            self.versions[i] = version if self.versions[i] is None else min(self.versions[i], version)
        if hit_limit:
            self.truncated[i] = True

    def apply_return(self, i: int, ret: EnvironmentReturn | None, error: str | None) -> bool:
        """Take the environment's answer to sample i's last turn; whether the episode goes on (its
        observation is then appended)."""
        if ret is None:  # grading failed: unscorable (counted where the call was made)
            self.rewards[i], self.grading_errors[i] = math.nan, error
            self.terminated[i] = True
            return False
        self.rewards[i] += float(ret.rewards[0])
        if math.isnan(self.rewards[i]) and self.grading_errors[i] is None:
            # The environment answered but could not score the sample (a service that timed out, a reward
            # function that returned None): unscorable, and a step of nothing else stops the run as a
            # failed call does (FailureWatch), instead of training on nothing for ever.
            self.grading_errors[i] = "the environment could not score it (reward NaN; see env/<task>/num_* metrics)"
        if ret.metadata[0] is not None:
            self.env_infos[i] = ret.metadata[0]
        if bool(ret.terminateds[0]):
            self.terminated[i] = True
            return False
        obs_ids = observation_token_ids(self.tokenizer, ret.observations[0], assistant_ended_with_eos=self.ended_eos[i])
        if self.lengths[i] + len(obs_ids) >= self.max_seq_len:
            # The observation would overflow the row (or leave no room to answer it): the episode
            # ends here, truncated, rather than a training row longer than the model's limit.
            self.truncated[i] = True
            return False
        self.lengths[i] += len(obs_ids)
        self.message_logs[i].append(dict(ret.observations[0]) | {"token_ids": obs_ids})
        self.stop_strings[i] = ret.next_stop_strings[0]
        return True

    def add_env_metrics(self, metrics: dict[str, float], weight: int = 1) -> None:
        for k, v in metrics.items():
            self.env_metrics.setdefault(k, []).append((float(v), weight))

    def result(self, generation_s: float) -> tuple[BatchedDataDict, dict[str, float]]:
        n = self.n
        out = BatchedDataDict(self.batch)
        out["message_log"] = self.message_logs
        out["extra_env_info"] = self.env_infos
        out["total_reward"] = self.rewards
        out["grading_error"] = self.grading_errors
        out["truncated"] = self.truncated
        out["generation_lengths"] = self.gen_lengths
        out["num_turns"] = self.turns
        if n and all(v is not None for v in self.versions):
            out["policy_version"] = torch.tensor(self.versions, dtype=torch.long)
        metrics = {
            "response_length_mean": float(self.gen_lengths.float().mean()) if n else 0.0,
            "truncation_rate": float(self.truncated.float().mean()) if n else 0.0,
            "turns_per_sample": float(self.turns.float().mean()) if n else 0.0,
            "unterminated_rate": float((~self.terminated).float().mean()) if n else 0.0,
            "generation_s": generation_s,
        }
        # Counters ("num_*", "step_errors", "step_timeouts") add up over calls; rates and accuracies
        # are averaged over the calls, each weighing what it was given.
        for k, vs in self.env_metrics.items():
            metrics[k] = (sum(v for v, _ in vs) if _is_counter(k)
                          else sum(v * w for v, w in vs) / max(sum(w for _, w in vs), 1))
        return out, metrics


def run_multi_turn_rollout(policy: GenerationInterface, batch: BatchedDataDict, tokenizer, envs: dict[str, Any],
                           *, max_turns: int, max_seq_len: int, greedy: bool = False,
                           step_timeouts: dict[str, float] | None = None,
                           step_concurrency: dict[str, int] | None = None, env_times: EnvTimes | None = None
                           ) -> tuple[BatchedDataDict, dict[str, float]]:
    """Generate, let each sample's environment answer, append its observation, repeat (the rules:
    :class:`Episodes`). Single-turn tasks take exactly one turn.

    A generator that streams episodes (``generator.streams_episodes()``: the continuous engine in
    one process) runs them there instead: an episode's next turn is admitted as soon as its
    environment answers, while the others keep decoding; a task's environment gets at most
    ``step_concurrency[task]`` calls at once (default 1). Otherwise turn by turn: every active
    sample's turn is generated, then all are graded, then the next turn starts; with ``env_times``
    (:mod:`~nemo_like.experience.env_waves`) the tasks whose calls are slow are generated first and
    graded while the others generate (``env_waves``: generate calls per turn).
    """
    if getattr(policy, "streams_episodes", lambda: False)():
        return policy.generate_episodes(batch, envs, max_turns=max_turns, max_seq_len=max_seq_len,
                                        greedy=greedy, step_timeouts=step_timeouts,
                                        step_concurrency=step_concurrency)
    ep = Episodes(batch, tokenizer, max_turns=max_turns, max_seq_len=max_seq_len)
    active = list(range(ep.n))
    generation_s, turns, waves_sent = 0.0, 0, 0
    while active:
        active = [i for i in active if ep.wants_turn(i)]
        if not active:
            break
        names = [ep.task_names[i] for i in active]
        waves = env_times.waves(names, turns) if env_times is not None else [range(len(active))]
        sent = []
        for wave in waves:
            ids = [active[j] for j in wave]
            flat = flatten_message_logs([ep.message_logs[i] for i in ids], tokenizer.pad_token_id)
            gen_in = BatchedDataDict(input_ids=flat["input_ids"], input_lengths=flat["input_lengths"])
            if any(ep.stop_strings[i] for i in ids):
                gen_in["stop_strings"] = [ep.stop_strings[i] for i in ids]
            t0 = time.perf_counter()
            gen = policy.generate(gen_in, greedy=greedy)
            generation_s += time.perf_counter() - t0
            for j, i in enumerate(ids):
                start, end = int(flat["input_lengths"][j]), int(gen["unpadded_sequence_lengths"][j])
                ep.add_turn(i, gen["output_ids"][j, start:end].clone(), gen["logprobs"][j, start:end].clone(),
                            hit_limit=bool(gen["truncated"][j]),
                            version=int(gen["policy_version"][j]) if "policy_version" in gen else None)
            # Sent at once: these samples' environments work while the next wave generates.
            sent.append((ids, PendingRewards([ep.message_logs[i] for i in ids], [ep.task_names[i] for i in ids],
                                             [ep.env_infos[i] for i in ids], envs, step_timeouts, env_times, turns)))
        turns, waves_sent = turns + 1, waves_sent + len(waves)
        going_on = set()
        for ids, pending in sent:
            _, returns, m, errors = pending.collect()
            ep.add_env_metrics(m)
            going_on |= {i for j, i in enumerate(ids) if ep.apply_return(i, returns[j], errors[j])}
        active = [i for i in active if i in going_on]
    out, metrics = ep.result(generation_s)
    if env_times is not None:
        metrics["env_waves"] = waves_sent / max(turns, 1)
    return out, metrics


def _is_counter(key: str) -> bool:
    leaf = key.rsplit("/", 1)[-1]
    return leaf.startswith("num_") or leaf in ("step_errors", "step_timeouts")


def run_split_rollout(batch: BatchedDataDict,
                      rollouts: list[Callable[[BatchedDataDict], tuple[BatchedDataDict, dict[str, float]]]],
                      weights: list[float] | None = None) -> tuple[BatchedDataDict, dict[str, float]]:
    """Deal the samples of ``batch`` to ``rollouts`` (each a rollout on a generator of its own), in
    turn and in proportion to ``weights`` (default equal: round-robin; e.g. each generator's worker
    count), run them in threads at once, and put the results back in batch order.

    The result holds the per-sample fields (lists and 1-D tensors: ``total_reward``, ``task_name``,
    ``num_turns``, ``truncated``, ``generation_lengths``, ``message_log``, ...); 2-D tensors are left
    out. Metrics: lengths, truncation and turns over all samples; environment counters summed, other
    environment metrics weighted by each part's size; ``generation_s`` the longest part's.
    """
    n, k = batch.size, len(rollouts)
    share = [float(x) for x in (weights or [1.0] * k)]
    if len(share) != k or not all(x > 0 for x in share):
        raise ValueError(f"run_split_rollout: weights must be {k} positive numbers, got {weights}")
    parts_idx: list[list[int]] = [[] for _ in range(k)]
    for i in range(n):  # each sample to the part furthest below its share (Webster's rounding; ties: the first)
        j = min(range(k), key=lambda j: ((len(parts_idx[j]) + 0.5) / share[j], j))
        parts_idx[j].append(i)
    return run_parts(batch, rollouts, parts_idx)


def run_parts(batch: BatchedDataDict,
              rollouts: list[Callable[[BatchedDataDict], tuple[BatchedDataDict, dict[str, float]]]],
              parts_idx: list[list[int]]) -> tuple[BatchedDataDict, dict[str, float]]:
    """``rollouts[j]`` on the samples ``parts_idx[j]`` of ``batch``, in threads at once, put back in
    batch order (what ``run_split_rollout`` returns)."""
    n = batch.size
    rollouts = [r for r, idx in zip(rollouts, parts_idx) if idx]
    parts_idx = [idx for idx in parts_idx if idx]
    with ThreadPoolExecutor(len(parts_idx), thread_name_prefix="split-rollout") as pool:
        parts = list(pool.map(lambda run, idx: run(batch.select_indices(idx)), rollouts, parts_idx))
    order = torch.tensor([i for idx in parts_idx for i in idx])
    back = torch.argsort(order)
    out = BatchedDataDict()
    for key, first in parts[0][0].items():
        if not all(key in p for p, _ in parts):  # e.g. policy_version, where one generator reports none
            continue
        values = [p[key] for p, _ in parts]
        if isinstance(first, torch.Tensor) and first.dim() == 1:
            out[key] = torch.cat(values)[back]
        elif isinstance(first, list):
            flat = [v for part in values for v in part]
            out[key] = [flat[int(i)] for i in back]
    gen_lengths, truncated, turns = out["generation_lengths"], out["truncated"], out["num_turns"]
    metrics = {"response_length_mean": float(gen_lengths.float().mean()),
               "truncation_rate": float(truncated.float().mean()),
               "turns_per_sample": float(turns.float().mean()),
               "unterminated_rate": sum(m["unterminated_rate"] * len(idx) for (_, m), idx in zip(parts, parts_idx)) / n,
               "generation_s": max(m["generation_s"] for _, m in parts)}
    for key in {k for _, m in parts for k in m if k.startswith("stream/")}:  # calls add up; waits overlap
        vals = [m[key] for _, m in parts if key in m]
        metrics[key] = sum(vals) if key.endswith("_calls") else max(vals)
    for key in {k for _, m in parts for k in m if k.startswith(("env/", "agent/"))}:
        have = [(m[key], len(idx)) for (_, m), idx in zip(parts, parts_idx) if key in m]
        metrics[key] = (sum(v for v, _ in have) if _is_counter(key)
                        else sum(v * w for v, w in have) / sum(w for _, w in have))
    return out, metrics
