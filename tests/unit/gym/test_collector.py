"""Trajectory collectors: groups from one reset seed, weights by version, broken environments cost
an episode, and a collector killed mid-episode is restarted with the weights and its jobs."""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest
import ray
import torch
from _nl_step_envs import CountdownEnv, InPlaceBufferEnv

from nemo_like.gym.agent import AgentPolicyConfig, build_network
from nemo_like.gym.collector import CollectorGroup, StaleWeightsError, TrajectoryCollector

POLICY = AgentPolicyConfig(hidden_sizes=[8])


def _collector(factory=CountdownEnv, **env_kwargs) -> TrajectoryCollector:
    c = TrajectoryCollector(factory, env_kwargs, None, POLICY.model_dump(), seed=0)
    c.set_weights(build_network(c.spec(), POLICY, seed=1).state_dict(), version=3)
    return c


def _state(pid: int) -> str:
    """The process's state letter from /proc ("Z" a zombie), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split()[1] for line in f if line.startswith("State:")), "")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _jobs(seeds, count=4, sample_seed=0):
    return [{"group_id": i, "seed": s, "count": count, "sample_seed": sample_seed + i} for i, s in enumerate(seeds)]


def test_collector_refuses_to_act_with_other_weights():
    c = TrajectoryCollector(CountdownEnv, {}, None, POLICY.model_dump())
    with pytest.raises(StaleWeightsError, match="version -1"):
        c.collect(_jobs([1]), expected_version=0)  # no weights pushed yet
    c.set_weights(build_network(c.spec(), POLICY, seed=1).state_dict(), version=3)
    with pytest.raises(StaleWeightsError, match="holds policy version 3, the learner expects 2"):
        c.collect(_jobs([1]), expected_version=2)
    trajs = c.collect(_jobs([1]), expected_version=3)
    assert [t.policy_version for t in trajs] == [3] * 4


def test_groups_never_mix_reset_seeds_and_keep_job_order():
    c = _collector()
    seeds = [12, 3, 40]
    trajs = c.collect(_jobs(seeds, count=4), expected_version=3)
    assert len(trajs) == 12
    for i, seed in enumerate(seeds):
        group = trajs[4 * i: 4 * i + 4]
        assert {t.group_id for t in group} == {i} and {t.seed for t in group} == {seed}
        for t in group:  # the first observation is the reset of this group's seed
            np.testing.assert_array_equal(t.obs[0], [seed % 7, 0])
            assert t.length == 1 + seed % 5 and t.ret == float(t.length) and t.terminated
            assert t.obs.shape == (t.length, 2) and t.logprobs.shape == (t.length,)
            assert np.all(t.logprobs < 0) and np.all(np.isin(t.actions, [0, 1]))


def test_logprobs_are_the_policy_log_probs_and_sampling_is_per_job():
    c = _collector()
    alone = c.collect(_jobs([44], count=6, sample_seed=9), expected_version=3)
    with_others = c.collect(_jobs([44, 33, 21], count=6, sample_seed=9), expected_version=3)[:6]
    for a, b in zip(alone, with_others, strict=True):  # a job's episodes do not depend on its neighbours
        np.testing.assert_array_equal(a.actions, b.actions)
    t = alone[0]
    with torch.no_grad():
        logits, _ = c.net(torch.from_numpy(t.obs))
    expected = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(t.actions)[:, None]).squeeze(-1)
    np.testing.assert_allclose(t.logprobs, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_greedy_takes_the_argmax():
    c = _collector()
    (t,) = c.collect(_jobs([4], count=1), expected_version=3, greedy=True)
    with torch.no_grad():
        logits, _ = c.net(torch.from_numpy(t.obs))
    np.testing.assert_array_equal(t.actions, logits.argmax(-1).numpy())


@pytest.mark.parametrize("bad, message", [("raise", r"step\(\d\) raised RuntimeError: simulator exploded"),
                                          ("nan", "non-finite reward"),
                                          ("huge", r"the reward 1e\+39 is outside float32's range"),
                                          ("huge_sum", r"return .* is outside float32's range"),
                                          ("shape", r"shape \(3,\), expected \(2,\)"),
                                          ("nan_obs", "NaN or infinite values"), ("text_obs", "bad observation")])
def test_a_broken_environment_costs_its_episode_only(bad, message):
    c = _collector(fail_seed=4, bad=bad)
    trajs = c.collect(_jobs([4, 3], count=2), expected_version=3)
    failed, fine = trajs[:2], trajs[2:]
    assert all(t.failed is not None for t in failed)
    assert all(re.search(message, t.failed) for t in failed), failed[0].failed
    assert all(t.failed is None and t.length == 4 for t in fine)
    # The broken instances were replaced: the next call still works for other seeds.
    assert all(t.failed is None for t in c.collect(_jobs([2], count=3), expected_version=3))


def test_observations_are_copied_from_environments_that_reuse_a_buffer():
    c = _collector(InPlaceBufferEnv)
    (t,) = c.collect(_jobs([4], count=1), expected_version=3)
    np.testing.assert_array_equal(t.obs[:, 1], np.arange(t.length))  # not the last obs repeated


def test_collector_group_spreads_whole_jobs_and_survives_a_killed_collector(ray_session):
    from nemo_like.gym.step_env import STEP_ENV_REGISTRY

    with STEP_ENV_REGISTRY.isolated():
        STEP_ENV_REGISTRY.register("countdown-test", CountdownEnv)  # a registration made in the driver only
        group = CollectorGroup("countdown-test", {"sleep_s": 0.01, "length_mod": 40}, None, POLICY,
                               num_collectors=2, cpus_per_collector=1, seed=0)
    try:
        net = build_network(group.spec, POLICY, seed=2)
        group.push_weights(net.state_dict(), version=5)
        jobs = _jobs([39, 38, 37, 36], count=3)
        first = group.collect(jobs)
        assert [t.group_id for t in first] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
        assert {t.policy_version for t in first} == {5}

        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("trajs", group.collect(jobs)))
        worker.start()
        time.sleep(0.2)  # mid-episode: each episode takes ~40 steps x 10 ms (a collect, 6 of them, ~2.3 s)
        ray.kill(group.actors[0], no_restart=False)
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert group.restarts == 1
        again = out["trajs"]
        assert {t.policy_version for t in again} == {5}  # the restarted collector got the weights again
        for a, b in zip(first, again, strict=True):  # and repeated its jobs: per-job seeds give the same episodes
            assert (a.group_id, a.seed) == (b.group_id, b.seed)
            np.testing.assert_array_equal(a.actions, b.actions)
    finally:
        group.close()


def test_a_collector_that_died_between_updates_gets_the_next_weights(ray_session):
    group = CollectorGroup("CartPole-v1", {}, None, POLICY, num_collectors=2, cpus_per_collector=1, seed=0)
    try:
        net = build_network(group.spec, POLICY, seed=2)
        group.push_weights(net.state_dict(), version=1)
        pid = ray.get(group.actors[0].__ray_call__.remote(lambda self: os.getpid()), timeout=120)
        ray.kill(group.actors[0], no_restart=False)  # idle, between two updates
        # ray.kill is asynchronous: wait for the process to go, or the push below could still reach it.
        deadline = time.monotonic() + 60
        while _state(pid) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(pid) in ("", "Z"), "the killed collector's process is still running"
        group.push_weights(net.state_dict(), version=2)
        assert group.restarts == 1
        trajs = group.collect(_jobs([5, 6], count=2))
        assert {t.policy_version for t in trajs} == {2} and all(t.failed is None for t in trajs)
    finally:
        group.close()


def test_a_simulator_that_hangs_is_cut_off_and_the_run_told_why(ray_session):
    from nemo_like.environments.supervision import EnvironmentFailureError

    group = CollectorGroup("CartPole-v1", {}, None, POLICY, num_collectors=1, cpus_per_collector=1, seed=0,
                           max_retries=1, collect_timeout_s=2.0)
    hanging = CollectorGroup(CountdownEnv, {"fail_seed": 4, "bad": "hang"}, None, POLICY, num_collectors=1,
                             cpus_per_collector=1, seed=0, max_retries=1, collect_timeout_s=2.0)
    try:
        for g in (group, hanging):
            g.push_weights(build_network(g.spec, POLICY, seed=2).state_dict(), version=1)
        assert len(group.collect(_jobs([1, 2], count=2))) == 4  # within the limit: untouched
        assert all(t.failed is None for t in hanging.collect(_jobs([3], count=2)))
        t0 = time.monotonic()
        with pytest.raises(EnvironmentFailureError, match=r"ran past env.collect_timeout_s=2 \(a simulator that hangs"):
            hanging.collect(_jobs([4], count=2))  # hangs on every try: killed, restarted, tried again, then stop
        assert time.monotonic() - t0 < 60 and hanging.restarts == 1  # one retry, then the run is told
    finally:
        group.close()
        hanging.close()


def test_truncated_episodes_keep_the_observation_after_their_last_step():
    # seed 4 runs 5 steps, seed 1 two: with a cap of 3 the first is truncated, the second terminates.
    c = TrajectoryCollector(CountdownEnv, {}, 3, POLICY.model_dump(), seed=0)
    c.set_weights(build_network(c.spec(), POLICY, seed=1).state_dict(), version=0)
    cut, done = c.collect(_jobs([4, 1], count=1), expected_version=0)
    assert cut.truncated and not cut.terminated and cut.length == 3
    np.testing.assert_array_equal(cut.obs[:, 1], [0, 1, 2])
    np.testing.assert_array_equal(cut.final_obs, [4, 3])  # what step 3 returned, for V(s_T)
    assert done.terminated and done.length == 2 and done.final_obs is None
