"""Agent programs as environments: code written only against an OpenAI client, trained unchanged.

``env.agent.fn: "my_pkg.agent:solve"`` names ``async def solve(client: openai.AsyncOpenAI, row: dict)``
returning the episode's reward (a number, or a dict with ``reward`` and more metrics).
``env.agent.command: [...]`` runs a program in any language once per episode with
``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` set and the row as JSON on its stdin
(and in the file ``$NEMO_LIKE_ROW``); its reward is the last line of its standard output (a number,
or ``{"reward": x}``), or what it posted to ``$OPENAI_BASE_URL/nemo_like/reward``.

The environment is a Ray actor like every other grader (it can run on any node); ``run_episodes``
runs a batch of episodes concurrently (at most ``max_concurrency`` at once), each with its own
session key, so the server records each episode's tokens apart; with ``num_actors`` > 1 it deals
each batch's episodes among itself and that many - 1 more actors, spread over the nodes (the
programs' own CPU work in parallel). The trainer builds the training
samples from those records (``experience.agent_rollouts``), not from anything the program says.
A program that raises, exits non-zero or runs past ``episode_timeout_s`` leaves its episode
unscorable and counted; it never ends the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import tempfile
import time
import traceback
from typing import Any, ClassVar

import httpx
import openai
from pydantic import Field, model_validator

from nemo_like.environments.env_config import EnvConfig, EpisodeEnvConfig
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.utils.registry import import_from_path

__all__ = ["AgentEnvConfig", "AgentEnvironment", "episode_result"]


class AgentEnvConfig(EpisodeEnvConfig):
    # "pkg.module:solve": an async function (client: openai.AsyncOpenAI, row: dict) -> float | dict.
    fn: str | None = None
    # A program run once per episode (argv list); reads the row as JSON on stdin.
    command: list[str] | None = Field(default=None, min_length=1)
    # Episodes run at once by this environment (each makes its own requests; the server batches them).
    max_concurrency: int = Field(64, gt=0)
    # Ray actors running the episodes, each batch's rows dealt among them (spread over the nodes); each
    # runs up to max_concurrency at once. More than 1: the programs' own CPU work in parallel.
    num_actors: int = Field(1, ge=1)
    # Past this an episode is stopped (a command's process group is killed) and left unscorable.
    episode_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _one_program(self) -> AgentEnvConfig:
        if (self.fn is None) == (self.command is None):
            raise ValueError("give exactly one of fn (an async function 'pkg.module:solve') or command "
                             "(a program as a list of arguments)")
        if self.fn is not None:
            try:
                fn = import_from_path(self.fn, what="agent function")
            except (ImportError, ValueError) as e:
                raise ValueError(f"fn: {e}") from None
            if not asyncio.iscoroutinefunction(fn):
                raise ValueError(f"fn: {self.fn!r} is not an async function (async def solve(client, row))")
        return self


def episode_result(value: Any) -> tuple[float | None, dict[str, float], str | None]:
    """An agent's return value as (reward, metrics, error): a number, or a dict with ``reward``."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        metrics = {str(k): float(v) for k, v in value.items()
                   if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, metrics, f"the agent returned {type(value).__name__}, not a number (or {{'reward': x}})"
    if not math.isfinite(float(value)):
        return None, metrics, f"the agent returned a reward of {value}"
    return float(value), metrics, None


class AgentEnvironment(EnvironmentInterface):
    """Runs agent episodes against the trainer's server (see the module doc)."""

    config_model: ClassVar[type[EnvConfig]] = AgentEnvConfig
    is_agent: ClassVar[bool] = True

    def __init__(self, config: dict[str, Any] | None = None):
        self.cfg = AgentEnvConfig.model_validate({k: v for k, v in (config or {}).items() if k != "step_timeout_s"})
        self.fn = import_from_path(self.cfg.fn, what="agent function") if self.cfg.fn else None
        self._tls: Any = None
        self._helpers: list[Any] | None = None  # the other num_actors - 1 actors, started on first use

    def step(self, message_log_batch: Any, metadata: Any) -> EnvironmentReturn:
        """Agent tasks are run by ``run_episodes``; a message log handed here is graded 0 and ended."""
        import torch

        n = len(list(message_log_batch))
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, [None] * n, [None] * n,
                                 torch.zeros(n), torch.ones(n, dtype=torch.bool), {"num_not_episodes": float(n)})

    async def run_episodes(self, rows: list[dict], base_url: str, keys: list[str], model: str) -> list[dict]:
        """One episode per (row, key): ``{"reward", "metrics", "error", "timed_out", "seconds"}`` each."""
        out: list[dict] = [{}] * len(rows)
        async for i, res in self.stream_episodes(rows, base_url, keys, model):
            out[i] = res
        return out

    async def stream_episodes(self, rows: list[dict], base_url: str, keys: list[str], model: str):
        """``run_episodes``' episodes, each ``(index, result)`` as soon as it ends (a Ray streaming
        generator: the trainer ends each episode's session at once). With ``num_actors`` > 1 the rows
        are dealt among this actor and the others; an actor that fails leaves its episodes that had
        not ended unscorable."""
        helpers = self._helper_actors()
        if not helpers:
            async for item in self._stream_here(rows, base_url, keys, model):
                yield item
            return
        n = len(helpers) + 1
        parts = [list(range(k, len(rows), n)) for k in range(n)]
        queue: asyncio.Queue = asyncio.Queue()

        def share(idx: list[int]) -> tuple:
            return [rows[i] for i in idx], base_url, [keys[i] for i in idx], model

        async def remote(actor: Any, idx: list[int]):
            async for ref in actor.stream_episodes.remote(*share(idx)):
                yield await ref

        async def pump(idx: list[int], stream: Any) -> None:
            left = set(range(len(idx)))
            try:
                async for j, res in stream:
                    left.discard(j)
                    queue.put_nowait((idx[j], res))
            except Exception as e:  # noqa: BLE001 - the actor died: its episodes are unscorable
                why = f"the agent actor running it failed: {type(e).__name__}: {str(e)[:300]}"
                for j in sorted(left):
                    queue.put_nowait((idx[j], {"reward": None, "metrics": {}, "timed_out": False, "error": why}))
            finally:
                queue.put_nowait(None)
        await _until_up(helpers)
        tasks = [asyncio.create_task(pump(parts[0], self._stream_here(*share(parts[0]))))]
        tasks += [asyncio.create_task(pump(idx, remote(h, idx))) for h, idx in zip(helpers, parts[1:])]
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item

    def _helper_actors(self) -> list[Any]:
        if self._helpers is None:
            self._helpers = []
            if self.cfg.num_actors > 1:
                import ray

                if not ray.is_initialized():
                    raise RuntimeError(f"env.agent.num_actors={self.cfg.num_actors} needs Ray: run the "
                                       "environment as a Ray actor (as the trainer does), or set num_actors=1")
                cfg = self.cfg.model_dump() | {"num_actors": 1}
                # Owned by this actor (they end with it), spread over the nodes, mostly idle: no CPU slot;
                # one that dies is restarted for the next batch (the batch it died in lost its share).
                actor = ray.remote(AgentEnvironment).options(num_cpus=0, scheduling_strategy="SPREAD", max_restarts=-1)
                self._helpers = [actor.remote(cfg) for _ in range(self.cfg.num_actors - 1)]
        return self._helpers

    async def _stream_here(self, rows: list[dict], base_url: str, keys: list[str], model: str):
        """This actor's share: each ``(index, result)`` as it ends."""
        gate = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(i: int, row: dict, key: str) -> tuple[int, dict]:
            async with gate:
                t0 = time.monotonic()
                out = await (self._call_fn(row, base_url, key) if self.fn else
                             self._run_command(row, base_url, key, model))
                return i, out | {"seconds": time.monotonic() - t0}
        for done in asyncio.as_completed([one(i, r, k) for i, (r, k) in enumerate(zip(rows, keys))]):
            yield await done

    async def _call_fn(self, row: dict, base_url: str, key: str) -> dict:
        # Each episode its own client and connection pool (one pool shared by 128 episodes stalls in
        # httpx's pool for seconds), made with one TLS context: a client that makes its own loads the
        # CA bundle, ~20 ms, 2.6 s a step for 128 episodes on 2 cores.
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                    timeout=self.cfg.episode_timeout_s,
                                    http_client=openai.DefaultAsyncHttpxClient(verify=self._tls))
        try:
            value = await asyncio.wait_for(self.fn(client, dict(row)), self.cfg.episode_timeout_s)
        except TimeoutError:
            return {"reward": None, "metrics": {}, "timed_out": True,
                    "error": f"the episode ran past env.agent.episode_timeout_s={self.cfg.episode_timeout_s}"}
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            at = f" at {os.path.basename(where.filename)}:{where.lineno}" if where else ""
            return {"reward": None, "metrics": {}, "timed_out": False, "error": f"{type(e).__name__}{at}: {e}"[:500]}
        finally:
            await client.close()
        reward, metrics, error = episode_result(value)
        return {"reward": reward, "metrics": metrics, "timed_out": False, "error": error}

    async def _run_command(self, row: dict, base_url: str, key: str, model: str) -> dict:
        data = json.dumps(row, default=str).encode()
        with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
            f.write(data)
        env = os.environ | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "OPENAI_MODEL": model,
                            "NEMO_LIKE_ROW": f.name}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.cfg.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        except OSError as e:
            os.unlink(f.name)
            return {"reward": None, "metrics": {}, "timed_out": False,
                    "error": f"env.agent.command {self.cfg.command[0]!r} cannot start: {e.strerror or e}"}
        try:
            out, err = await asyncio.wait_for(proc.communicate(data), self.cfg.episode_timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return {"reward": None, "metrics": {}, "timed_out": True,
                    "error": f"the program ran past env.agent.episode_timeout_s={self.cfg.episode_timeout_s}"}
        finally:
            os.unlink(f.name)
            _kill_group(proc.pid)  # children it left behind
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            return {"reward": None, "metrics": {}, "timed_out": False,
                    "error": f"the program exited with {proc.returncode}: {tail[0][:300]}"}
        lines = [ln for ln in out.decode(errors="replace").strip().splitlines() if ln.strip()]
        if not lines:
            return {"reward": None, "metrics": {}, "timed_out": False, "error": None, "posted": True}
        try:
            value = json.loads(lines[-1])
        except json.JSONDecodeError:
            return {"reward": None, "metrics": {}, "timed_out": False,
                    "error": f"the program's last output line is not a number or JSON: {lines[-1][:200]!r}"}
        reward, metrics, error = episode_result(value)
        return {"reward": reward, "metrics": metrics, "timed_out": False, "error": error}


async def _until_up(actors: list[Any], timeout_s: float = 60.0) -> None:
    """Wait until each actor answers (one that died is being restarted: the batch after its death must
    not be sent to it before it is back, or Ray fails the calls). One that does not come back within
    ``timeout_s`` is left to fail its share."""
    import ray

    async def one(actor: Any) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await actor.__ray_ready__.remote()
                return
            except ray.exceptions.RayActorError:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.2)
    await asyncio.gather(*(one(a) for a in actors))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
