"""Multi-turn tool calling: the ``ToolEnvironment`` actor class.

Each step runs the tool calls of every sample's last assistant message and answers with one
``{"role": "tool", "content": ...}`` observation, or grades the message as the final answer when it
holds no call. The wire format and its strict parser live in :mod:`nemo_like.environments.tool_calls`
(re-exported here).

This module imports neither torch nor ray at import time (torch lazily, to build the reward tensors).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, EnvConfig, validate_env_config
from nemo_like.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    normalize_step_inputs,
    required_assistant_text,
)
from nemo_like.environments.tool_calls import (
    MAX_RECORDED_CALLS,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_STOP_STRINGS,
    answers_match,
    canonical_call,
    compact_json,
    extract_tool_answer,
    format_tool_call,
    format_tool_response,
    parse_tool_calls,
)
from nemo_like.environments.tools import DEFAULT_TOOLS, Tool, resolve_tool, validate_arguments

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = [
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "TOOL_STOP_STRINGS",
    "parse_tool_calls",
    "format_tool_call",
    "format_tool_response",
    "extract_tool_answer",
    "answers_match",
    "ToolEnvironment",
    "ToolEnvConfig",
]

# -------------------------------------------------------------------------------- environment
class ToolEnvConfig(EnvConfig):
    """``env.tool``: checked before Ray starts (see :mod:`nemo_like.environments.env_config`)."""

    tools: list[str] | None = None  # names (or import paths) of the tools offered; None: add, mul, lookup
    max_turns: int = Field(default=4, ge=1, strict=True)  # assistant turns per episode, the final answer included
    timeout_s: float = Field(default=2.0, gt=0, strict=True, allow_inf_nan=False)  # wall-clock limit of one call
    require_tool_calls: bool = Field(default=False, strict=True)  # reward only if expected_calls were all made
    call_match_reward: float = Field(default=0.0, strict=True)  # in [0, 1): added when expected_calls were all made
    max_calls_per_turn: int = Field(default=4, ge=1, strict=True)  # more calls in one message: malformed
    max_response_chars: int = Field(default=1000, ge=1, strict=True)  # a longer JSON result is an error observation
    # Calls of one tool running at once; a tool with this many calls still running past the limit
    # is unavailable until one returns (so a tool that hangs holds at most this many threads).
    max_stuck_calls: int = Field(default=4, ge=1, strict=True)
    # Tool threads alive at once, all tools together (abandoned calls included): bounds the threads a
    # hanging tool leaves behind and the calls a big batch runs in parallel.
    max_concurrent_calls: int = Field(default=8, ge=1, strict=True)
    # Seconds every call waits before its tool runs, as a web API's round trip would (inside the
    # call's time limit): a benchmark of rollouts that wait on I/O. 0: no wait.
    call_latency_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _latency_within_limit(self) -> ToolEnvConfig:
        if self.call_latency_s >= self.timeout_s:
            raise ValueError(f"call_latency_s ({self.call_latency_s:g}) must be below timeout_s ({self.timeout_s:g}): "
                             "every call would time out")
        return self

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_names(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str) or not isinstance(v, (list, tuple)) or not v:
            raise ValueError("must be a non-empty list of tool names (or null for add, mul, lookup)")
        return list(v)

    @field_validator("tools")
    @classmethod
    def _resolvable(cls, v: list[str] | None) -> list[str] | None:
        seen: dict[str, Tool] = {}
        for spec in v or []:
            try:  # an unknown name or a bad import path fails when the config is read
                t = resolve_tool(spec)
            except (KeyError, TypeError) as e:
                raise ValueError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from None
            if t.name in seen and seen[t.name] is not t:
                raise ValueError(f"two different tools named {t.name!r}")
            seen[t.name] = t
        return v

    @field_validator("call_match_reward")
    @classmethod
    def _below_one(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:  # below 1, so that accuracy (reward >= 1) still means a right answer
            raise ValueError("must be a number in [0, 1)")
        return v


class _BadItem(Exception):
    pass


def _answer(message_log: Any) -> tuple[str, int]:
    try:
        return required_assistant_text(message_log)
    except (TypeError, ValueError) as e:
        raise _BadItem(str(e)) from None


def _ground_truth(meta: dict) -> str:
    truth = meta.get("ground_truth")
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str):
        raise _BadItem("metadata has no ground_truth string")
    return truth


def _expected_calls(meta: dict) -> list[str]:
    exp = meta.get("expected_calls")
    if isinstance(exp, str):
        try:
            exp = json.loads(exp)
        except ValueError:
            raise _BadItem("expected_calls is not valid JSON") from None
    if not isinstance(exp, list):
        raise _BadItem("metadata has no expected_calls list")
    keys = [canonical_call(c) for c in exp]
    if any(k is None for k in keys):
        raise _BadItem("expected_calls entries must be {name, arguments} objects")
    return keys  # type: ignore[return-value]


class _Call:
    """One tool call running on a daemon thread. A thread cannot be killed: a call past its time
    limit is abandoned (and counted in its tool's stuck calls until it returns). ``on_exit`` runs
    when the thread ends, however it ends: it gives the call's slot back."""

    def __init__(self, tool: Tool, arguments: dict, max_chars: int, on_exit: Any, latency_s: float = 0.0) -> None:
        self.tool, self.arguments, self.max_chars, self.on_exit = tool, arguments, max_chars, on_exit
        self.latency_s = latency_s
        self.payload: str | None = None
        self.error: str | None = None
        self.done = False
        self.thread = threading.Thread(target=self._run, name=f"tool-{tool.name}", daemon=True)

    def _run(self) -> None:
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            result = self.tool.fn(**self.arguments)
            text = compact_json(result)  # serialised here, so a huge result also counts against the limit
            if len(text) > self.max_chars:
                self.error = f"tool result is longer than {self.max_chars} characters"
            else:
                self.payload = text
        except BaseException as e:  # report everything; the environment turns it into an observation
            msg = str(e) if not isinstance(e, KeyError) else str(e.args[0]) if e.args else ""
            self.error = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        finally:
            self.on_exit(self)  # sets ``done`` and frees the slot in one locked step


class ToolEnvironment(EnvironmentInterface):
    """Runs the tool calls in each sample's last assistant message, or grades its final answer.

    Config keys (:class:`ToolEnvConfig`): ``tools`` (None: add, mul, lookup; names from
    :mod:`nemo_like.environments.tools`, or import paths ``"pkg.mod.fn"``), ``max_turns`` (4),
    ``timeout_s`` (2.0), ``require_tool_calls`` (False), ``call_match_reward`` (0.0),
    ``max_calls_per_turn`` (4), ``max_response_chars`` (1000), ``max_stuck_calls`` (4),
    ``max_concurrent_calls`` (8), ``call_latency_s`` (0.0).

    Per sample, from the last assistant message:

    - tool calls: each is checked against its tool's schema (unknown tool, missing/extra arguments,
      wrong JSON types -> error) and run with a ``timeout_s`` limit (an exception or time-out -> error);
      observation ``{"role": "tool", "content": "<tool_response>...</tool_response>..."}``, reward 0,
      not terminated, next stop strings ``["</tool_call>"]``. The calls are appended to
      ``metadata["tool_calls"]`` (``{"name", "arguments", "ok"}``), which flows into the next turn.
      A malformed message gets one error response and continues too. At the ``max_turns``-th
      assistant message the episode instead terminates with reward 0 (no call is run).
    - no tool call: the final answer (:func:`extract_tool_answer`: the last ``\\boxed{}`` else the
      stripped text) is compared with ``metadata["ground_truth"]`` (:func:`answers_match`): reward
      1.0 or 0.0, terminated. With ``require_tool_calls`` the reward is multiplied by 1 if every call
      in ``metadata["expected_calls"]`` (a list or its JSON text) was made and succeeded (exact
      name and arguments, JSON types included; extra calls allowed), else by 0. ``call_match_reward``
      (partial credit, below 1 so that accuracy, reward >= 1, still means a right answer) is added
      when those calls were made, right answer or not.

    Tools of one step run concurrently on threads (they must be thread-safe): at most
    ``max_concurrent_calls`` threads alive in all, at most ``max_stuck_calls`` per tool, and the
    calls of one step end within 2 x ``timeout_s`` (a call that found no free slot by ``timeout_s``
    is an error). A thread cannot be killed, so a call past the limit is abandoned, and holds its
    slot until it returns; a tool with ``max_stuck_calls`` calls still running is disabled (error
    observations) until one returns, so a tool that hangs leaves at most that many threads and the
    other tools keep the remaining slots. Untrusted code does not belong in a tool: run it in a
    sandbox process.

    Never raises from :meth:`step`: a malformed sample (not a list of dicts, no assistant message,
    no ground truth when one is needed) scores 0, terminates and counts in ``num_failures``.
    Metrics: ``num_tool_calls``, ``num_tool_errors`` (time-outs included), ``num_malformed_calls``
    (malformed messages), ``num_timeouts``, ``num_turn_limit``, ``num_terminated``, ``num_correct``
    (terminated samples with reward >= 1), ``accuracy`` (their share; absent when no sample
    terminated in this step), ``num_failures``.
    """

    config_model: ClassVar[type[EnvConfig]] = ToolEnvConfig
    # step() shares only the tool-thread slots, under their lock: calls may overlap (their tool
    # threads still count against max_concurrent_calls together).
    max_concurrent_steps: ClassVar[int] = 4

    def __init__(self, config: dict | None = None) -> None:
        parsed = validate_env_config("tool", ToolEnvConfig, config)
        cfg = parsed.model_dump(exclude=set(TRAINER_SIDE_KEYS))
        self.tools: dict[str, Tool] = {}
        for spec in cfg["tools"] or DEFAULT_TOOLS:  # resolvable and unambiguous: checked by ToolEnvConfig
            t = resolve_tool(spec)
            self.tools[t.name] = t
        self.config = cfg
        self.timeout_s = float(cfg["timeout_s"])
        # Tool threads alive (running, or abandoned past their limit), in all and per tool, and the
        # abandoned ones per tool; guarded by _slots, which a call's thread notifies when it ends.
        self._slots = threading.Condition()
        self._live = 0
        self._live_by_tool: Counter[str] = Counter()
        self._stuck: dict[str, list[_Call]] = {}

    # ------------------------------------------------------------------------------ helpers
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The "tools" list of this environment's tools, for ``apply_chat_template(..., tools=...)``."""
        return [t.schema() for t in self.tools.values()]

    def _stuck_count(self, name: str) -> int:
        alive = [c for c in self._stuck.get(name, []) if not c.done]
        self._stuck[name] = alive
        return len(alive)

    def _call_ended(self, call: _Call) -> None:  # on the call's thread
        with self._slots:  # under the lock: a dispatcher never sees a call done whose slot is still taken
            call.done = True
            self._live -= 1
            self._live_by_tool[call.tool.name] -= 1
            self._slots.notify_all()

    def _run_calls(self, jobs: list[tuple[Tool, dict]]) -> list[tuple[str | None, str | None, bool]]:
        """Run ``(tool, arguments)`` jobs on at most ``max_concurrent_calls`` threads (at most
        ``max_stuck_calls`` per tool), each for at most ``timeout_s``; per job (payload, error,
        timed_out). A job waits for a slot until ``timeout_s`` after the start (then it fails with
        an error), so this returns within 2 x ``timeout_s`` however many jobs there are; it fails at
        once when every slot it could use is held by a call abandoned in an earlier step."""
        cap, per_tool = self.config["max_concurrent_calls"], self.config["max_stuck_calls"]
        results: list[tuple[str | None, str | None, bool] | None] = [None] * len(jobs)
        waiting = list(range(len(jobs)))
        running: dict[int, tuple[_Call, float]] = {}
        start_by = time.monotonic() + self.timeout_s
        with self._slots:
            while waiting or running:
                now = time.monotonic()
                for k, (call, deadline) in list(running.items()):
                    if call.done:
                        results[k] = (None, call.error, False) if call.error is not None else (call.payload, None, False)
                    elif now >= deadline:  # abandoned: its thread keeps its slot until it returns
                        self._stuck.setdefault(call.tool.name, []).append(call)
                        results[k] = (None, f"tool {call.tool.name!r} timed out after {self.timeout_s:g} s", True)
                    else:
                        continue
                    del running[k]
                still: list[int] = []
                for k in waiting:
                    t, args = jobs[k]
                    stuck = self._stuck_count(t.name)
                    if stuck >= per_tool:
                        results[k] = (None, f"tool {t.name!r} is unavailable: {stuck} earlier calls are still "
                                            "running past the time limit", False)
                    elif self._live >= cap or self._live_by_tool[t.name] >= per_tool:
                        still.append(k)  # a slot may free when a call of this step ends
                    else:
                        call = _Call(t, args, self.config["max_response_chars"], self._call_ended,
                                     self.config["call_latency_s"])
                        try:
                            call.thread.start()
                        except RuntimeError as e:  # cannot start a thread (resource limits)
                            results[k] = (None, f"tool could not be started ({e})", False)
                            continue
                        self._live += 1
                        self._live_by_tool[t.name] += 1
                        running[k] = (call, now + self.timeout_s)
                waiting = still
                # Calls of other steps running at once (max_concurrent_steps) free their slots within
                # their time limit; calls abandoned earlier may never return.
                others = self._live - len(running) - sum(self._stuck_count(n) for n in list(self._stuck))
                if waiting and (now >= start_by or (not running and others <= 0)):
                    # No call will free a slot in time (the others are held by calls abandoned
                    # earlier, which may never return): fail now instead of waiting.
                    for k in waiting:
                        results[k] = (None, f"tool call not run: {cap} tool calls already running "
                                            "(raise env.tool.max_concurrent_calls for more at once)", False)
                    waiting = []
                if running or waiting:
                    wake = min([d for _, d in running.values()] + ([start_by] if waiting else []))
                    self._slots.wait(max(0.0, wake - time.monotonic()))
        return [r if r is not None else (None, "internal error", False) for r in results]

    # --------------------------------------------------------------------------------- step
    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta_in = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        out_meta: list[dict | None] = list(meta_in)
        rewards = [0.0] * n
        terminated = [True] * n
        observations: list[dict[str, str]] = [{"role": "environment", "content": "Environment: invalid sample"}] * n
        m = Counter({k: 0 for k in ("num_tool_calls", "num_tool_errors", "num_malformed_calls", "num_timeouts",
                                    "num_turn_limit", "num_failures", "num_correct")})
        try:
            jobs: list[tuple[Tool, dict]] = []
            job_slots: list[tuple[int, int]] = []  # (sample, index of the call in the sample)
            pending: dict[int, tuple[list[dict], list[str | None]]] = {}  # sample -> (calls, responses)
            ok: dict[tuple[int, int], bool] = {}  # (sample, call) -> the call ran and returned
            for i in range(n):
                try:
                    meta = meta_in[i] if meta_in[i] is not None else {}
                    if not isinstance(meta, dict):
                        raise _BadItem(f"metadata is a {type(meta).__name__}, not a dict")
                    content, turns = _answer(batch[i])
                    calls, error = parse_tool_calls(content, max_calls=self.config["max_calls_per_turn"])
                    if not calls and error is None:  # the final answer
                        reward = float(answers_match(extract_tool_answer(content), _ground_truth(meta)))
                        bonus = self.config["call_match_reward"]
                        if self.config["require_tool_calls"] or bonus:
                            made = self._made_expected_calls(meta)
                            if self.config["require_tool_calls"]:  # a multiplicative gate
                                reward *= float(made)
                            reward += bonus * made
                        rewards[i] = reward
                        m["num_correct"] += reward >= 1.0
                        observations[i] = {"role": "environment",
                                           "content": "Environment: correct" if reward >= 1.0 else "Environment: incorrect"}
                        continue
                    if self.config["require_tool_calls"]:
                        _expected_calls(meta)  # malformed expectations fail now, not at the last turn
                    if turns >= self.config["max_turns"]:
                        m["num_turn_limit"] += 1
                        observations[i] = {"role": "environment",
                                           "content": f"Environment: turn limit reached ({turns} assistant turns)"}
                        continue
                    meta = dict(meta)
                    meta["tool_calls"] = list(meta.get("tool_calls") or [])
                    out_meta[i] = meta
                    terminated[i] = False
                    if error is not None:
                        m["num_malformed_calls"] += 1
                        observations[i] = {"role": "tool",
                                           "content": format_tool_response(error=f"malformed tool call: {error}")}
                        continue
                    responses: list[str | None] = [None] * len(calls)
                    pending[i] = (calls, responses)
                    for c, call in enumerate(calls):
                        m["num_tool_calls"] += 1
                        t = self.tools.get(call["name"])
                        if t is None:
                            err = (f"unknown tool {call['name'][:50]!r}; available: "
                                   f"{', '.join(sorted(self.tools))}")
                        else:
                            err = validate_arguments(call["arguments"], t.parameters)
                        if err is not None:
                            responses[c] = format_tool_response(error=err)
                            m["num_tool_errors"] += 1
                            continue
                        jobs.append((t, call["arguments"]))  # type: ignore[arg-type]
                        job_slots.append((i, c))
                except Exception:  # _BadItem, or something stranger: score 0, terminate, count
                    m["num_failures"] += 1
                    rewards[i], terminated[i] = 0.0, True
                    observations[i] = {"role": "environment", "content": "Environment: invalid sample"}
                    pending.pop(i, None)
            results = self._run_calls(jobs) if jobs else []
            for (i, c), (payload, err, timed_out) in zip(job_slots, results):
                if i not in pending:
                    continue
                calls, responses = pending[i]
                if err is not None:
                    responses[c] = format_tool_response(error=err)
                    m["num_tool_errors"] += 1
                    m["num_timeouts"] += timed_out
                else:
                    responses[c] = f"{RESPONSE_OPEN}{payload}{RESPONSE_CLOSE}"
                    ok[(i, c)] = True
            for i, (calls, responses) in pending.items():
                for c, call in enumerate(calls):  # recorded in call order, for the next turn
                    self._record(out_meta[i], call, ok=ok.get((i, c), False))  # type: ignore[arg-type]
                content = "\n".join(r if r is not None else format_tool_response(error="internal error")
                                    for r in responses)
                observations[i] = {"role": "tool", "content": content}
        except Exception:  # last line of defence: step must never raise into the trainer
            rewards, terminated = [0.0] * n, [True] * n
            observations = [{"role": "environment", "content": "Environment: internal error"}] * n
            out_meta = list(meta_in)
            m["num_failures"], m["num_correct"] = n, 0

        import torch  # lazily: keeps this module import-light

        done = [i for i in range(n) if terminated[i]]
        metrics = {k: float(v) for k, v in m.items()}
        metrics["num_terminated"] = float(len(done))
        if done:  # undefined when no episode ended (a rollout averaging it over turns must not see a 0)
            metrics["accuracy"] = metrics["num_correct"] / len(done)
        return EnvironmentReturn(
            observations=[dict(o) for o in observations],
            metadata=out_meta,
            next_stop_strings=[None if terminated[i] else list(TOOL_STOP_STRINGS) for i in range(n)],
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminated, dtype=torch.bool),
            metrics=metrics,
        )

    @staticmethod
    def _record(meta: dict, call: dict, *, ok: bool) -> None:
        record = meta["tool_calls"]
        if len(record) < MAX_RECORDED_CALLS:
            record.append({"name": call["name"], "arguments": call["arguments"], "ok": ok})

    @staticmethod
    def _made_expected_calls(meta: dict) -> bool:
        expected = Counter(_expected_calls(meta))
        made = Counter(
            canonical_call(c) for c in (meta.get("tool_calls") or []) if isinstance(c, dict) and c.get("ok")
        )
        return all(made[k] >= v for k, v in expected.items())

    def shutdown(self) -> None:
        """Nothing to release: abandoned tool threads are daemons and end with the process."""
