"""verifiers environments, trained unchanged: ``env_name: verifiers`` with rows from
``generator: {kind: verifiers, ...}`` (``nemo_like.data.verifiers_tasks``).

An agent environment (``is_agent``): for each row the actor plays that very task of the verifiers
environment (loaded once per process) with verifiers' own machinery: its harness program, tool
servers and rewards. The episode's model calls go through verifiers' interception to the trainer's
OpenAI-compatible server, with the episode's session key as the API key, so the server records the
exact tokens the training sample is built from. The reward is the episode's verifiers reward (the
weighted sum of its reward functions); each reward function's score and each metric is reported as a
metric (``agent/<name>`` in the step's log).

An episode that fails (a reward function that raises or reads a field its task lacks, a harness that
crashes, a model call refused) or runs past ``episode_timeout_s`` is unscorable and counted; the first
such error is printed once. Nothing an environment does ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import Field

from nemo_like.data.verifiers_tasks import TaskList, first_line, load_verifiers_env, spec_label
from nemo_like.environments.env_config import EnvConfig, EpisodeEnvConfig, validate_env_config
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn

__all__ = ["VerifiersEnvConfig", "VerifiersEnvironment", "episode_outcome"]

# verifiers' subprocess runtime leaves variables whose name holds API_KEY out of the programs it starts:
# the session keys stay in this process.
_KEY_VAR = "NEMO_LIKE_VF_API_KEY_{}"
_key_ids = itertools.count()


class VerifiersEnvConfig(EpisodeEnvConfig):
    # Episodes run at once by this environment (each runs verifiers' harness program; the server batches
    # their requests).
    max_concurrency: int = Field(32, gt=0)
    # Past this an episode is cancelled (verifiers stops its programs) and left unscorable.
    episode_timeout_s: float = Field(600.0, gt=0)


def _error_text(error: Any) -> str:
    message = (getattr(error, "message", "") or "").strip().splitlines()
    return f"{getattr(error, 'type', 'Error')}: {message[0] if message else ''}"[:500]


def episode_outcome(episode: Any) -> dict[str, Any]:
    """A finished verifiers ``Episode`` as ``{"reward", "metrics", "error", "timed_out"}``: the reward of its
    trainable traces (their mean when there are several), every reward function's score and metric."""
    traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    timed_out = bool(episode.is_timeout or any(t.is_timeout for t in episode.traces))
    if not episode.ok or not traces:
        error = episode.last_error or next((t.last_error for t in traces if t.last_error), None)
        if error is not None:
            text = _error_text(error)
        elif traces:
            text = f"the episode did not complete (stopped: {traces[-1].stop_condition})"
        else:
            text = "the episode ran no agent"
        return {"reward": None, "metrics": {}, "error": text, "timed_out": timed_out}
    sums: dict[str, list[float]] = {}
    for t in traces:
        for name, r in t.rewards.items():
            if r is not None:
                sums.setdefault(name, []).append(float(r.score))
        for name, v in t.metrics.items():
            if v is not None:
                sums.setdefault(name if name not in t.rewards else f"{name}_metric", []).append(float(v))
    metrics = {k: sum(v) / len(v) for k, v in sums.items()}
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}  # a NaN score must not poison a mean
    reward = sum(float(t.reward) for t in traces) / len(traces)
    if not math.isfinite(reward):  # verifiers passes a reward function's NaN or inf through
        return {"reward": None, "metrics": metrics, "timed_out": timed_out,
                "error": f"the episode's reward is {reward} (a reward function returned a non-finite number)"}
    return {"reward": reward, "metrics": metrics, "error": None, "timed_out": timed_out}


def _import_path_for_programs() -> str:
    """PYTHONPATH for the programs verifiers starts: tool servers start as ``python -m <module>``, so they
    get this process's own folders (the user's modules, not its site-packages), and a toolset importable
    here is importable there."""
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    mine = [os.path.abspath(p or os.getcwd()) for p in sys.path
            if not (p and p.startswith(prefixes) and ("site-packages" in p or "lib/python" in p))]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(current + [p for p in mine if os.path.isdir(p)]))


class VerifiersEnvironment(EnvironmentInterface):
    """Plays verifiers environments' tasks against the trainer's server (see the module doc)."""

    config_model: ClassVar[type[EnvConfig]] = VerifiersEnvConfig
    is_agent: ClassVar[bool] = True

    @classmethod
    def check_dataset(cls, ds_cfg: Any, options: Any) -> None:
        """Rows must come from a verifiers environment, whose tasks carry their own prompts."""
        if getattr(ds_cfg.generator, "kind", None) != "verifiers":
            raise ValueError("is graded by the verifiers environment, which needs rows from "
                             "generator: {kind: verifiers, environment: ..., split: ...}")
        for key in ("prompt", "system_prompt", "few_shot"):
            if getattr(ds_cfg, key, None):
                raise ValueError(f"{key}: a verifiers task is prompted by its environment (its harness sends the "
                                 f"task's own prompt), so {key} would change nothing; leave it unset")

    def __init__(self, config: dict[str, Any] | None = None):
        cfg = validate_env_config("verifiers", VerifiersEnvConfig, config)
        assert isinstance(cfg, VerifiersEnvConfig)
        self.cfg = cfg
        self._tasks: dict[str, TaskList] = {}
        self._reported = False
        self._lock = threading.Lock()
        # PYTHONPATH while batches run (verifiers' programs read this process's environment); restored after.
        self._batches = 0
        self._saved_path: str | None = None
        self._serving: asyncio.Lock | None = None  # made in the actor's event loop, on first use

    def step(self, message_log_batch: Any, metadata: Any) -> EnvironmentReturn:
        """verifiers tasks are played by ``run_episodes``; a message log handed here is unscorable and ended."""
        import torch

        n = len(list(message_log_batch))
        # NaN: unscorable (counted, never trained on as a real score of 0).
        return EnvironmentReturn([{"role": "environment", "content": ""} for _ in range(n)], [None] * n, [None] * n,
                                 torch.full((n,), float("nan")), torch.ones(n, dtype=torch.bool),
                                 {"num_not_episodes": float(n)})

    def _task(self, row: dict) -> tuple[Any, Any]:
        """(env, task) of a row; raises with what is wrong with the row or the environment."""
        spec = row.get("vf_env")
        if not isinstance(spec, str):
            raise ValueError("the row has no vf_env column (rows come from generator: {kind: verifiers})")
        env = load_verifiers_env(spec)
        with self._lock:
            tasks = self._tasks.setdefault(spec, TaskList(env))
        index = int(row.get("vf_index", -1))
        task = tasks.get(index) if index >= 0 else None
        if task is None:
            raise ValueError(f"the environment has no task {index}")
        if row.get("vf_key") and task.key != row["vf_key"]:
            raise ValueError(f"task {index} is not the one the dataset was made from (does its taskset's load() "
                             "yield the same tasks every time?)")
        return env, task

    async def run_episodes(self, rows: list[dict], base_url: str, keys: list[str], model: str) -> list[dict]:
        """One episode per (row, key): ``{"reward", "metrics", "error", "timed_out"}`` each. Never raises."""
        try:
            return await self._run(rows, base_url, keys, model)
        except Exception as e:  # a failure around the episodes (serving the environment): all unscorable
            out = [{"reward": None, "metrics": {}, "timed_out": False,
                    "error": f"the verifiers environment failed: {first_line(e)}"} for _ in rows]
            self._report(rows[0] if rows else {}, out[0]["error"], len(out))
            return out

    async def _run(self, rows: list[dict], base_url: str, keys: list[str], model: str) -> list[dict]:
        import verifiers.v1 as vf

        results: list[dict | None] = [None] * len(rows)
        found: dict[int, tuple[Any, Any]] = {}
        for i, row in enumerate(rows):
            try:
                found[i] = self._task(row)
            except Exception as e:
                results[i] = {"reward": None, "metrics": {}, "timed_out": False, "error": first_line(e)}
        gate = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(i: int, env: Any, task: Any) -> None:
            var = _KEY_VAR.format(next(_key_ids))
            os.environ[var] = keys[i]
            ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var=var))
            try:
                async with gate:
                    episode = await asyncio.wait_for(env.run_slot(env.slots(task)[0], ctx),
                                                     self.cfg.episode_timeout_s)
                results[i] = episode_outcome(episode)
            except TimeoutError:
                results[i] = {"reward": None, "metrics": {}, "timed_out": True,
                              "error": f"the episode ran past env.verifiers.episode_timeout_s="
                                       f"{self.cfg.episode_timeout_s}"}
            except Exception as e:
                results[i] = {"reward": None, "metrics": {}, "timed_out": False, "error": first_line(e)}
            finally:
                os.environ.pop(var, None)

        envs = {id(env): env for env, _ in found.values()}
        # One batch at a time: verifiers keeps a serving context's resources on the Env object and the
        # first batch to leave would stop them under the other (validation can overlap a training batch).
        if self._serving is None:
            self._serving = asyncio.Lock()
        async with self._serving:
            return await self._serve(rows, envs, found, one, results)

    async def _serve(self, rows: list[dict], envs: dict[int, Any], found: dict[int, tuple[Any, Any]], one: Any,
                     results: list[dict | None]) -> list[dict]:
        with self._program_path():
            async with contextlib.AsyncExitStack() as stack:
                # An environment's shared resources (interception, taskset-wide tool servers) for this batch.
                for env in envs.values():
                    await stack.enter_async_context(env.serving())
                await asyncio.gather(*(one(i, env, task) for i, (env, task) in found.items()))
        out = [r or {"reward": None, "metrics": {}, "timed_out": False, "error": "the episode did not run"}
               for r in results]
        failed = [(i, r) for i, r in enumerate(out) if r["error"] is not None]
        if failed:
            self._report(rows[failed[0][0]], failed[0][1]["error"], len(failed))
        return out

    @contextlib.contextmanager
    def _program_path(self) -> Iterator[None]:
        with self._lock:
            if self._batches == 0:
                self._saved_path = os.environ.get("PYTHONPATH")
                os.environ["PYTHONPATH"] = _import_path_for_programs()
            self._batches += 1
        try:
            yield
        finally:
            with self._lock:
                self._batches -= 1
                if self._batches == 0:
                    if self._saved_path is None:
                        os.environ.pop("PYTHONPATH", None)
                    else:
                        os.environ["PYTHONPATH"] = self._saved_path

    def _report(self, row: dict, error: str, n: int) -> None:
        """The first failure of this environment, printed once; later ones are only counted."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
        label = spec_label(str(row.get("vf_env", "")))
        print(f"[nemo_like] verifiers environment {label!r}: {n} episode(s) unscorable, the first: {error} "
              "(further failures are counted in agent/failed, not printed)", flush=True)

    def shutdown(self) -> None:
        pass

