"""Trajectory collectors: Ray actors that run step-environment episodes with the latest policy weights.

The driver's :class:`CollectorGroup` pushes the weights after every update (the same refit idea as
the LLM rollout workers: one ``ray.put`` of the state dict, ``set_weights(ref, version)`` on every
collector) and sends each collector whole groups: a job is ``count`` episodes from one reset seed.
A collector runs all the episodes of its jobs in lockstep, one batched forward per step, and refuses
a job whose expected policy version is not the one it holds (so a sample is never generated with
stale weights by mistake). Episodes whose environment raised, returned a non-finite reward or a
malformed observation come back ``failed`` (and the environment instance is replaced), so a buggy
simulator costs an episode, not the run. A collector that dies (killed, crashed) is restarted by
Ray; the group sends it the weights again and repeats its jobs.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nemo_like.environments.supervision import (
    START_TIMEOUT_S,
    EnvironmentFailureError,
    EnvironmentStartError,
    first_line_of_error,
)
from nemo_like.gym.agent import AgentPolicyConfig, build_network, obs_to_tensor
from nemo_like.gym.step_env import ObsSpec, make_step_env, step_env_factory

__all__ = ["CollectorGroup", "StaleWeightsError", "Trajectory", "TrajectoryCollector"]

# A registered environment with no time limit of its own still ends: at this many steps (truncated).
DEFAULT_STEP_CAP = 10_000
_U_BLOCK = 64  # sampling uniforms are drawn per job this many steps at a time


class StaleWeightsError(RuntimeError):
    """A collector was asked to act with a policy version it does not hold."""


# Rewards and returns are kept in float32.
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class Trajectory:
    """One episode. ``obs`` is ``[T, ...]`` (or a dict of such arrays); ``logprobs`` are the behaviour
    policy's log-probs of ``actions``; ``failed`` holds the error when the environment broke."""

    group_id: int
    seed: int
    obs: Any
    actions: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    terminated: bool = False
    truncated: bool = False
    policy_version: int = -1
    failed: str | None = None
    # The observation after the last step, kept only when the episode was truncated (time limit or
    # the step cap) and not terminated: the trainer bootstraps its GAE with V(final_obs).
    final_obs: Any = None

    @property
    def length(self) -> int:
        return int(self.actions.shape[0])

    @property
    def ret(self) -> float:
        return float(self.rewards.sum())


@dataclass
class _Episode:
    job: int
    group_id: int
    seed: int
    env_slot: int
    obs: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    ret: float = 0.0  # the sum of rewards (float64), kept as they come
    current: Any = None
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    failed: str | None = None
    member: int = 0  # index within its job


def _shape(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {k: np.shape(v) for k, v in sorted(obs.items())}
    return np.shape(obs)


def _expected_shape(spec: ObsSpec) -> Any:
    if spec.image_shape is not None and spec.vector_dim:
        return {"image": tuple(spec.image_shape), "vector": (spec.vector_dim,)}
    return tuple(spec.image_shape) if spec.image_shape is not None else (spec.vector_dim,)


def _stack(values: list) -> Any:
    if values and isinstance(values[0], dict):
        return {k: np.stack([np.asarray(v[k], dtype=np.float32) for v in values]) for k in values[0]}
    return np.stack([np.asarray(v, dtype=np.float32) for v in values]) if values else np.zeros((0,), np.float32)


class TrajectoryCollector:
    """Runs episodes of one environment with its own copy of the policy network. ``env_factory`` is
    what :func:`step_env_factory` returns (a class or a callable)."""

    def __init__(self, env_factory: Any, env_kwargs: dict[str, Any], max_episode_steps: int | None,
                 policy_config: dict[str, Any], seed: int = 0) -> None:
        self.env_factory, self.env_kwargs, self.max_episode_steps = env_factory, dict(env_kwargs), max_episode_steps
        self.policy_config = AgentPolicyConfig.model_validate(policy_config)
        torch.set_num_threads(self.policy_config.torch_threads)
        self._envs = [self._make_env()]
        self._spec = self._envs[0].spec()
        self._expected = _expected_shape(self._spec)
        self.net = build_network(self._spec, self.policy_config, seed=seed)
        self.net.eval()
        self._version = -1  # no weights pushed yet: every job is refused until they are

    def _make_env(self) -> Any:
        return make_step_env(self.env_factory, max_episode_steps=self.max_episode_steps, **self.env_kwargs)

    def spec(self) -> ObsSpec:
        return self._spec

    def version(self) -> int:
        return self._version

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.net.load_state_dict(state_dict, strict=True)
        self._version = int(version)
        return self._version

    def _replace_env(self, slot: int) -> None:
        try:
            self._envs[slot].close()
        except Exception:  # a broken environment may fail to close too; it is dropped either way
            pass
        self._envs[slot] = self._make_env()

    def _fail(self, ep: _Episode, what: str) -> None:
        ep.failed, ep.done = what, True
        self._replace_env(ep.env_slot)

    def _check_obs(self, ep: _Episode, obs: Any, where: str) -> bool:
        """Keep a float32 copy of ``obs`` as the episode's current observation, or fail the episode:
        a wrong shape, a value that is not a number, or a NaN/inf (one of those trained on would
        turn every weight into NaN)."""
        try:
            if (obs.shape if isinstance(obs, np.ndarray) else _shape(obs)) != self._expected:
                raise ValueError(f"shape {_shape(obs)}, expected {self._expected}")
            # A copy: an environment may hand out one buffer and change it in place on the next step.
            current = ({k: np.array(v, dtype=np.float32) for k, v in obs.items()} if isinstance(obs, dict)
                       else np.array(obs, dtype=np.float32))
            values = current.values() if isinstance(current, dict) else (current,)
            if not all(np.isfinite(v).all() for v in values):
                raise ValueError("NaN or infinite values")
        except (TypeError, ValueError, AttributeError) as e:
            self._fail(ep, f"{where} returned a bad observation: {e}")
            return False
        ep.current = current
        return True

    def collect(self, jobs: list[dict[str, int]], expected_version: int, greedy: bool = False) -> list[Trajectory]:
        """``jobs``: ``{"group_id", "seed", "count", "sample_seed"}``; returns ``count`` trajectories
        per job, in job order. Sampling is seeded per job, so a job's episodes do not depend on which
        collector runs it or what else it runs."""
        if self._version != expected_version:
            raise StaleWeightsError(f"collector holds policy version {self._version}, "
                                    f"the learner expects {expected_version}")
        episodes: list[_Episode] = []
        generators, sizes = [], []
        for j, job in enumerate(jobs):
            generators.append(torch.Generator().manual_seed(int(job["sample_seed"])))
            sizes.append(int(job["count"]))
            for n in range(sizes[-1]):
                episodes.append(_Episode(j, int(job["group_id"]), int(job["seed"]), len(episodes)))
                episodes[-1].member = n
        while len(self._envs) < len(episodes):
            self._envs.append(self._make_env())
        for ep in episodes:
            try:
                obs = self._envs[ep.env_slot].reset(ep.seed)
            except Exception as e:  # noqa: BLE001 - a broken environment costs this episode only
                self._fail(ep, f"reset(seed={ep.seed}) raised {type(e).__name__}: {e}")
                continue
            self._check_obs(ep, obs, "reset")
        cap = self.max_episode_steps or DEFAULT_STEP_CAP
        uniforms: list[list[list[float]]] = []
        for it in itertools.count():
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            with torch.no_grad():
                logits, _ = self.net(obs_to_tensor([ep.current for ep in live]))
                logp_all = torch.log_softmax(logits.float(), dim=-1)
                if greedy:
                    actions = logp_all.argmax(dim=-1)
                else:
                    # Inverse-CDF sampling from uniforms drawn per job in blocks of _U_BLOCK steps for
                    # all of its episodes, live or not: what an episode draws depends on its job's seed
                    # and the step only, and sampling costs one vector op per step, not a call per job.
                    if it % _U_BLOCK == 0:
                        uniforms = [torch.rand(n, _U_BLOCK, generator=g).tolist()
                                    for n, g in zip(sizes, generators, strict=True)]
                    u = torch.tensor([uniforms[ep.job][ep.member][it % _U_BLOCK] for ep in live])
                    cdf = logp_all.exp().cumsum(dim=-1)
                    actions = (u[:, None] > cdf).sum(dim=-1).clamp(max=logp_all.shape[-1] - 1)
                chosen = logp_all.gather(-1, actions[:, None]).squeeze(-1).tolist()
            for ep, a, lp in zip(live, actions.tolist(), chosen, strict=True):
                prev = ep.current
                try:
                    obs, reward, terminated, truncated, _ = self._envs[ep.env_slot].step(a)
                    reward = float(reward)
                except Exception as e:  # noqa: BLE001
                    self._fail(ep, f"step({a}) raised {type(e).__name__}: {e}")
                    continue
                if not math.isfinite(reward):
                    self._fail(ep, f"step({a}) returned a non-finite reward {reward}")
                    continue
                # A finite float beyond float32's range would become inf after the check above and
                # poison the whole update's advantages.
                if abs(reward) > _F32_MAX:
                    self._fail(ep, f"step({a}): the reward {reward:g} is outside float32's range")
                    continue
                if abs(ep.ret + reward) > _F32_MAX:
                    self._fail(ep, f"step({a}): the episode's return {ep.ret + reward:g} is outside "
                                   "float32's range")
                    continue
                ep.ret += reward
                ep.obs.append(prev)
                ep.actions.append(a)
                ep.logprobs.append(lp)
                ep.rewards.append(reward)
                if not self._check_obs(ep, obs, f"step({a})"):
                    continue
                ep.terminated, ep.truncated = bool(terminated), bool(truncated) or len(ep.actions) >= cap
                ep.done = ep.terminated or ep.truncated
        return [Trajectory(group_id=ep.group_id, seed=ep.seed, obs=_stack(ep.obs),
                           actions=np.asarray(ep.actions, dtype=np.int64),
                           logprobs=np.asarray(ep.logprobs, dtype=np.float32),
                           rewards=np.asarray(ep.rewards, dtype=np.float32),
                           terminated=ep.terminated, truncated=ep.truncated, policy_version=self._version,
                           failed=ep.failed,
                           final_obs=ep.current if ep.truncated and not ep.terminated and not ep.failed else None)
                for ep in episodes]


class CollectorGroup:
    """``num_collectors`` restartable :class:`TrajectoryCollector` actors, driven from the learner."""

    def __init__(self, env_id: str | Any, env_kwargs: dict[str, Any], max_episode_steps: int | None,
                 policy_config: AgentPolicyConfig, num_collectors: int, cpus_per_collector: float = 1.0,
                 seed: int = 0, max_retries: int = 3, collect_timeout_s: float | None = None,
                 placement: Any = None) -> None:
        """``placement``: a RolePlacement (a pool's share, nemo_like.distributed.resource_pools) or a
        RayVirtualCluster whose bundle ``bundle_index(k)`` collector k runs in, reserving its
        ``cpus_per_worker``; None: Ray places each collector where ``cpus_per_collector`` CPUs are free."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        actor_cls = ray.remote(TrajectoryCollector)

        def options(k: int) -> dict[str, Any]:
            if placement is None:
                return {"num_cpus": cpus_per_collector}
            # A restarted collector comes back in the same bundle.
            return {"num_cpus": placement.cpus_per_worker, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement.placement_group, placement_group_bundle_index=placement.bundle_index(k))}

        # A name (registered or gymnasium), or already what builds the environment (a class).
        factory = step_env_factory(env_id) if isinstance(env_id, str) else env_id
        env_id = env_id if isinstance(env_id, str) else getattr(env_id, "__qualname__", repr(env_id))
        self.actors = [actor_cls.options(max_restarts=-1, max_task_retries=0, **options(k)).remote(
            factory, env_kwargs, max_episode_steps, policy_config.model_dump(), seed) for k in range(num_collectors)]
        self.max_retries = max_retries
        self.collect_timeout_s = collect_timeout_s
        self.restarts = 0
        self.version = -1
        self._weights_ref: Any = None
        self.env_id = env_id
        try:  # a constructor that raised (a bad kwarg, a broken simulator) fails the run now, naming it
            self.spec: ObsSpec = ray.get([a.spec.remote() for a in self.actors], timeout=START_TIMEOUT_S)[0]
        except ray.exceptions.RayActorError as e:
            self.close()
            raise EnvironmentStartError(f"step environment {env_id!r} (env.kwargs={dict(env_kwargs)}) did not start: "
                                        f"{first_line_of_error(e)}") from None
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise EnvironmentStartError(f"the {num_collectors} collectors of {env_id!r} did not start within "
                                        f"{START_TIMEOUT_S:g} s (are the CPUs they need, env.num_collectors x "
                                        "env.cpus_per_collector, held by another run?)") from None
        except BaseException:  # an interrupt: no actor outlives the group that made it
            self.close()
            raise

    def push_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Send the weights to every collector; returns the bytes sent once (the object store
        shares one copy between the collectors of a node)."""
        cpu = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()}
        self._weights_ref = self._ray.put(cpu)
        self.version = int(version)
        futures = [a.set_weights.remote(self._weights_ref, self.version) for a in self.actors]
        for k, fut in enumerate(futures):
            try:
                self._ray.get(fut)
            except self._ray.exceptions.RayActorError:  # it died since the last update: Ray restarts it
                self.restarts += 1
                self._resend_weights(k)
        return float(sum(v.numel() * v.element_size() for v in cpu.values()))

    def collect(self, jobs: list[dict[str, int]], greedy: bool = False) -> list[Trajectory]:
        """Runs ``jobs`` spread over the collectors (whole jobs, balanced by episode count) and
        returns their trajectories in job order. A collector that died is restarted by Ray, sent the
        weights again and given its jobs again, up to ``max_retries`` times per call; so is one whose
        jobs run past ``collect_timeout_s`` (a simulator that hangs in ``step``: it is killed)."""
        ray = self._ray
        shares: list[list[int]] = [[] for _ in self.actors]
        load = [0] * len(self.actors)
        for j in sorted(range(len(jobs)), key=lambda j: -int(jobs[j]["count"])):
            k = load.index(min(load))
            shares[k].append(j)
            load[k] += int(jobs[j]["count"])
        results: dict[int, list[Trajectory]] = {}
        pending = {k: share for k, share in enumerate(shares) if share}
        attempts = 0
        while pending:
            futures = {k: self.actors[k].collect.remote([jobs[j] for j in share], self.version, greedy)
                       for k, share in pending.items()}
            failed: dict[int, list[int]] = {}
            errors = []
            deadline = None if self.collect_timeout_s is None else time.monotonic() + self.collect_timeout_s
            for k, fut in futures.items():
                try:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    results[k] = ray.get(fut, timeout=left)
                except (ray.exceptions.RayActorError, StaleWeightsError) as e:
                    failed[k] = pending[k]
                    errors.append(f"collector {k}: {type(e).__name__}")
                except ray.exceptions.GetTimeoutError:
                    ray.kill(self.actors[k], no_restart=False)  # Ray starts it again; its jobs are repeated
                    failed[k] = pending[k]
                    errors.append(f"collector {k}: its episodes ran past env.collect_timeout_s="
                                  f"{self.collect_timeout_s:g} (a simulator that hangs in step()?)")
            if not failed:
                break
            attempts += 1
            if attempts > self.max_retries:
                raise EnvironmentFailureError(f"the collectors of {self.env_id!r} kept failing: {self.max_retries} "
                                              f"retries in one update failed ({'; '.join(errors)})")
            for k in failed:
                self.restarts += 1
                self._resend_weights(k)
            pending = failed
        out: list[Trajectory | None] = [None] * sum(int(j["count"]) for j in jobs)
        starts = np.cumsum([0] + [int(j["count"]) for j in jobs])
        for k, share in enumerate(shares):
            if not share:
                continue
            trajs = iter(results[k])
            for j in share:
                for n in range(int(jobs[j]["count"])):
                    out[starts[j] + n] = next(trajs)
        return out  # type: ignore[return-value]

    def _resend_weights(self, k: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """The collector is restarted by Ray (a call on it waits for that); it has no weights yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._ray.get(self.actors[k].set_weights.remote(self._weights_ref, self.version))
                return
            except self._ray.exceptions.RayActorError as e:
                if time.monotonic() > deadline:
                    raise EnvironmentFailureError(f"collector {k} of {self.env_id!r} died and did not come back "
                                                  f"within {timeout_s:g} s: {first_line_of_error(e)}") from None
                time.sleep(0.2)

    def close(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
