"""The trainer's side of environment supervision: actors that cannot start are reported at setup,
and a task whose grading fails step after step is caught."""

from __future__ import annotations

import pytest

from nemo_like.environments.registry import create_env_actor
from nemo_like.environments.supervision import (
    EnvironmentFailureError,
    EnvironmentStartError,
    FailureWatch,
    step_timeouts,
    wait_for_env_actors,
)


def test_code_environment_without_bubblewrap_fails_at_start_naming_it(ray_session):
    import ray

    good = create_env_actor("math", {})
    bad = create_env_actor("code", {"bwrap_path": "/nonexistent/bwrap"})
    with pytest.raises(EnvironmentStartError, match=r"^environment 'code' \(task 'python'\) failed to start: "
                       r".*/nonexistent/bwrap"):
        wait_for_env_actors({"arith": good, "python": bad}, {"arith": "math", "python": "code"})
    wait_for_env_actors({"arith": good}, {"arith": "math"})  # a healthy one passes
    for a in (good, bad):
        ray.kill(a, no_restart=True)


def test_failure_watch_needs_every_sample_of_a_task_to_fail_in_consecutive_steps():
    watch = FailureWatch(3)
    tasks = ["math", "math", "code", "code"]
    watch.observe(tasks, ["boom 1", "boom 1", None, None])
    watch.observe(tasks, ["boom 2", "boom 2", "x", None])  # code: one sample graded, no streak
    watch.observe(tasks, ["boom 3", None, "x", "x"])  # math: one sample graded, its streak ends
    watch.observe(tasks, ["boom 4", "boom 4", "y", "y"])
    with pytest.raises(EnvironmentFailureError, match=r"^task 'math': grading failed for every sample in 3 "
                       r"consecutive steps \(grpo.max_consecutive_env_failures=3\); first error: boom 4$"):
        watch.observe(tasks, ["boom 5", "boom 5", None, None])
        watch.observe(tasks, ["boom 6", "boom 6", None, None])
    never = FailureWatch(0)
    for _ in range(10):
        never.observe(["t"], ["down"])


def test_failure_watch_stops_an_agent_task_where_most_episodes_fail():
    watch = FailureWatch(2, {"agent": 0.5})
    tasks = ["agent"] * 4 + ["math"] * 2
    watch.observe(tasks, ["e1", "e1", None, None, None, "m"])  # agent: half failed, not more: no streak
    watch.observe(tasks, ["e2", "e2", "e2", None, "m", None])  # 3 of 4
    with pytest.raises(EnvironmentFailureError, match=r"^task 'agent': more than 0.5 of the episodes failed "
                       r"\(3 of 4 in the last\) in 2 consecutive steps \(env.agent.max_failed_fraction\) "
                       r"\(grpo.max_consecutive_env_failures=2\); first error: e2$"):
        watch.observe(tasks, ["e3", None, "e3", "e3", None, "m"])
    # The key named is the task's environment's (a verifiers task: env.verifiers.max_failed_fraction).
    vf = FailureWatch(1, {"quiz": 0.5}, env_names={"quiz": "verifiers"})
    with pytest.raises(EnvironmentFailureError, match=r"\(env.verifiers.max_failed_fraction\)"):
        vf.observe(["quiz"] * 2, ["e", "e"])



def test_step_timeouts_per_environment_or_the_global_default():
    limits = step_timeouts({"code": {"step_timeout_s": 5}, "math": {}}, {"py": "code", "arith": "math"}, 600.0)
    assert limits == {"py": 5.0, "arith": 600.0}
    assert step_timeouts({}, {"t": "x"}, 0)["t"] == float("inf")  # no limit at all only when asked for
