"""MathEnvironment in-process and as a restartable Ray actor, plus the environment registry.

Custom verifiers and a user environment live in ``_nl_math_env_test_helpers.py`` beside this file
(importing this test module in a grader subprocess would drag in pytest, torch and ray). Pytest
puts this directory on ``sys.path`` while collecting, before the session's Ray starts:
``GraderPool`` hands the parent's ``sys.path`` to its workers, and ``init_ray`` hands the driver's
to Ray workers.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from nemo_like.environments import registry
from nemo_like.environments.math_environment import MathEnvironment
from nemo_like.environments.registry import create_env_actor, get_env_class, register_env, registered_envs

HELPER_MODULE = "_nl_math_env_test_helpers"


@pytest.fixture(scope="module")
def helpers():
    """The helper module beside this file: on sys.path here (pytest puts test dirs there), in grader
    subprocesses (they get the parent's sys.path) and in Ray workers (see ray_session)."""
    import importlib

    return importlib.import_module(HELPER_MODULE)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content) -> dict:
    return {"role": "assistant", "content": content}


def log(answer) -> list[dict]:
    return [{"role": "system", "content": "Put the answer in \\boxed{}."}, user("What is 1/2?"), assistant(answer)]


def gt(truth) -> dict:
    return {"ground_truth": truth}


def pid_gone(pid: int) -> bool:
    """No such process any more, or only a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split()[1] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
    return False


def wait_for(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


# A batch mixing right, wrong and malformed samples, graded by the built-in verifier.
BATCH = [
    (log("so \\boxed{\\frac{1}{2}}"), gt("0.5"), 1.0),
    (log("#### 1,000"), gt(1000), 1.0),  # a numeric ground truth is accepted
    (log("\\boxed{2\\sqrt{2}}"), gt("\\sqrt{8}"), 1.0),  # needs sympy: goes to a grader process
    (log("\\boxed{0.51}"), gt("1/2"), 0.0),
    (log("\\boxed{3}\\boxed{4}"), gt("3"), 0.0),  # the last box counts
    (log("The answer is 0.5"), gt("0.5"), 0.0),  # no final answer
    (log("\\boxed{\\sqrt{2}}"), gt("1.41421356"), 0.0),  # sympy, wrong
    ([user("q")], gt("1"), 0.0),  # malformed: no assistant message
    ([assistant("\\boxed{1}"), "not a dict"], gt("1"), 0.0),  # malformed: non-dict message
    (log(None), gt("1"), 0.0),  # malformed: non-str content
    (log("\\boxed{1}"), {}, 0.0),  # malformed: no ground_truth
]
BATCH_FAILURES = 4


def check_batch_result(ret, expected: list[float], failures: int, timeouts: int = 0) -> None:
    import torch

    n = len(expected)
    assert isinstance(ret.rewards, torch.Tensor) and ret.rewards.dtype == torch.float32
    assert ret.rewards.shape == (n,)
    assert ret.rewards.tolist() == expected
    assert ret.terminateds.dtype == torch.bool and ret.terminateds.shape == (n,)
    assert bool(ret.terminateds.all())
    assert len(ret.observations) == len(ret.metadata) == len(ret.next_stop_strings) == n
    for obs, r in zip(ret.observations, expected):
        assert obs["role"] == "environment"
        assert obs["content"] == ("Environment: correct" if r == 1.0 else "Environment: incorrect")
    assert ret.metrics["num_failures"] == failures
    assert ret.metrics["num_timeouts"] == timeouts
    assert ret.metrics["accuracy"] == pytest.approx(sum(expected) / n if n else 0.0)


# ======================================================================== in-process
@pytest.fixture(scope="module")
def math_env():
    env = MathEnvironment({"timeout_s": 10.0})  # generous: the sympy check must not time out on a loaded box
    yield env
    env.shutdown()
    env.shutdown()  # idempotent


def test_step_grades_mixed_batch(math_env: MathEnvironment) -> None:
    logs, meta, expected = map(list, zip(*BATCH))
    ret = math_env.step(logs, meta)
    check_batch_result(ret, expected, failures=BATCH_FAILURES)
    assert ret.metadata == meta
    ret2 = math_env.step(logs, meta)  # warm pool: same answer
    assert ret2.rewards.tolist() == expected


@pytest.mark.parametrize(
    ("bad_log", "bad_meta"),
    [
        pytest.param([user("q")], gt("1"), id="no_assistant"),
        pytest.param([], gt("1"), id="empty_log"),
        pytest.param([assistant("\\boxed{1}"), "text"], gt("1"), id="non_dict_message"),
        pytest.param([assistant("\\boxed{1}"), None], gt("1"), id="none_message"),
        pytest.param(log(None), gt("1"), id="none_content"),
        pytest.param(log(1), gt("1"), id="int_content"),
        pytest.param(log(["\\boxed{1}"]), gt("1"), id="list_content"),
        pytest.param([{"role": "assistant"}], gt("1"), id="missing_content"),
        pytest.param(log("\\boxed{1}"), {}, id="missing_ground_truth"),
        pytest.param(log("\\boxed{1}"), gt(None), id="none_ground_truth"),
        pytest.param(log("\\boxed{1}"), gt(True), id="bool_ground_truth"),
        pytest.param(log("\\boxed{1}"), gt(["1"]), id="list_ground_truth"),
        pytest.param(log("\\boxed{1}"), None, id="none_metadata"),
        pytest.param(log("\\boxed{1}"), "1", id="str_metadata"),
        pytest.param(None, gt("1"), id="none_log"),
        pytest.param(5, gt("1"), id="int_log"),
    ],
)
def test_malformed_item_scores_zero_and_counts(math_env: MathEnvironment, bad_log, bad_meta) -> None:
    good = (log("\\boxed{7}"), gt("7"))
    ret = math_env.step([good[0], bad_log, good[0]], [good[1], bad_meta, good[1]])
    check_batch_result(ret, [1.0, 0.0, 1.0], failures=1)


def test_metadata_shorter_than_batch(math_env: MathEnvironment) -> None:
    ret = math_env.step([log("\\boxed{7}"), log("\\boxed{7}")], [gt("7")])
    check_batch_result(ret, [1.0, 0.0], failures=1)
    ret = math_env.step([log("\\boxed{7}")], None)
    check_batch_result(ret, [0.0], failures=1)


@pytest.mark.parametrize(
    ("logs", "meta"),
    [([], []), (None, None), (5, 5), (iter([]), iter([])), ([], None)],
    ids=["empty", "none", "int", "empty_iters", "empty_none_meta"],
)
def test_degenerate_batches_never_raise(math_env: MathEnvironment, logs, meta) -> None:
    ret = math_env.step(logs, meta)
    check_batch_result(ret, [], failures=0)


def test_grades_last_assistant_message(math_env: MathEnvironment) -> None:
    multi_turn = [user("q"), assistant("\\boxed{3}"), user("are you sure?"), assistant("\\boxed{4}"), user("ok")]
    ret = math_env.step([multi_turn, multi_turn], [gt("4"), gt("3")])
    check_batch_result(ret, [1.0, 0.0], failures=0)


def test_hostile_responses_in_batch_are_fast(math_env: MathEnvironment) -> None:
    hostile = [
        log("\\boxed{9^{9^{9}}}"),
        log("x" * (1 << 20)),
        log("\\boxed{" + "{" * (1 << 20)),
        log("\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}"),
        log("\\boxed{" + "+".join(["1"] * 1000) + "}"),
    ]
    start = time.monotonic()
    ret = math_env.step(hostile + [log("\\boxed{1}")], [gt("1")] * (len(hostile) + 1))
    assert time.monotonic() - start < 10.0
    check_batch_result(ret, [0.0] * len(hostile) + [1.0], failures=0)


def test_custom_verifier_timeouts_and_failures(helpers, tmp_path: Path) -> None:
    """One env, one batch: every way a custom verifier can misbehave scores 0 and is counted."""
    pid_file = tmp_path / "sleeper.pid"
    env = MathEnvironment(
        {"verifier": f"{HELPER_MODULE}.misbehaving_verifier", "timeout_s": 2.0, "num_workers": 2,
         "memory_limit_mb": 512}
    )
    try:
        rows = [
            ("42", gt("42"), 1.0),
            ("41", gt("42"), 0.0),
            ("sleep", gt(str(pid_file)), 0.0),  # timeout
            ("raise", gt("x"), 0.0),  # failure
            ("nan", gt("x"), 0.0),  # failure: not a valid score
            ("exit", gt("x"), 0.0),  # failure: the grader process died
            ("oom", gt("x"), 0.0),  # failure: over memory_limit_mb
            ("print", gt("x"), 0.0),  # prints fake protocol lines on stdout: still its own 0.0, no failure
            (None, gt("x"), 0.0),  # failure: malformed item, never reaches the verifier
            ("42", gt(42), 1.0),
        ]
        start = time.monotonic()
        ret = env.step([log(r) for r, _, _ in rows], [m for _, m, _ in rows])
        elapsed = time.monotonic() - start
        check_batch_result(ret, [e for _, _, e in rows], failures=5, timeouts=1)
        assert elapsed < 60.0, f"step took {elapsed:.1f}s with a 2s limit"
        # The timed-out grader was killed, not left sleeping.
        sleeper = int(pid_file.read_text())
        assert wait_for(lambda: pid_gone(sleeper), 10.0), f"timed-out grader {sleeper} still running"
        # The pool recovered: the same env keeps grading.
        ret = env.step([log("42"), log("7")], [gt("42"), gt("42")])
        check_batch_result(ret, [1.0, 0.0], failures=0)
    finally:
        env.shutdown()


def test_slow_verifier_times_out_without_hanging(helpers) -> None:
    env = MathEnvironment({"verifier": f"{HELPER_MODULE}:slow_verifier", "timeout_s": 0.5})
    try:
        start = time.monotonic()
        ret = env.step([log("1"), log("2")], [gt("1"), gt("2")])
        elapsed = time.monotonic() - start
        check_batch_result(ret, [0.0, 0.0], failures=0, timeouts=2)
        assert elapsed < 30.0, f"two 0.5s-limited checks took {elapsed:.1f}s"
    finally:
        env.shutdown()


@pytest.mark.parametrize(
    ("config", "exc", "match"),
    [
        ({"bogus_key": 1}, ValueError, "bogus_key"),
        ({"timeout_s": 1, "timeot_s": 2}, ValueError, "timeot_s"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"timeout_s": -1.0}, ValueError, "timeout_s"),
        ({"timeout_s": "2"}, ValueError, "timeout_s"),
        ({"timeout_s": None}, ValueError, "timeout_s"),
        ({"timeout_s": math.inf}, ValueError, "timeout_s"),
        ({"timeout_s": math.nan}, ValueError, "timeout_s"),
        ({"timeout_s": True}, ValueError, "timeout_s"),
        ({"num_workers": 0}, ValueError, "num_workers"),
        ({"num_workers": 1.5}, ValueError, "num_workers"),
        ({"memory_limit_mb": -1}, ValueError, "memory_limit_mb"),
        ({"verifier": "no_such_pkg_xyz.mod.fn"}, ValueError, "env.math.verifier: cannot import .*no_such_pkg_xyz.mod.fn"),
        ({"verifier": "math.no_such_function_xyz"}, ValueError, "no_such_function_xyz"),
        ({"verifier": "justaname"}, ValueError, "justaname"),
        ({"verifier": "math.pi"}, ValueError, "math.pi"),
        ({"verifier": 5}, ValueError, "env.math.verifier: Input should be a valid string"),
        ({"timeout": 3}, ValueError, r"env.math.timeout: unknown config key \(did you mean env.math.timeout_s\?\)"),
        ([("timeout_s", 1)], TypeError, "dict"),
    ],
)
def test_bad_config_raises_clear_error(config, exc, match) -> None:
    with pytest.raises(exc, match=match):
        MathEnvironment(config)


def test_default_config_is_valid() -> None:
    for cfg in (None, {}, {"timeout_s": 1, "num_workers": 2, "memory_limit_mb": 0, "verifier": None}):
        MathEnvironment(cfg).shutdown()  # workers start lazily: construction is cheap


# ========================================================================== registry
@pytest.fixture
def clean_registry():
    """Registrations made by a test do not leak into the next one."""
    with registry.ENV_REGISTRY.isolated():
        yield


def test_math_is_registered() -> None:
    assert "math" in registered_envs()
    assert get_env_class("math") is MathEnvironment


def test_unknown_env_lists_known_names(clean_registry) -> None:
    with pytest.raises(KeyError, match=r"no_such_env.*math"):
        get_env_class("no_such_env")
    with pytest.raises(KeyError, match=r"no_such_env.*math"):
        create_env_actor("no_such_env")  # fails before touching Ray


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_bad_env_names(clean_registry, name) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        get_env_class(name)
    with pytest.raises(ValueError, match="non-empty string"):
        register_env(name, "pkg.mod.Cls")


def test_register_env_decorator(clean_registry) -> None:
    @register_env("my_user_env")
    class MyEnv:
        def step(self, message_log_batch, metadata):
            return "stepped"

    assert MyEnv.__name__ == "MyEnv"  # the decorator returns the class itself
    assert "my_user_env" in registered_envs()
    assert get_env_class("my_user_env") is MyEnv
    register_env("my_user_env", MyEnv)  # same target again: a no-op

    class Other:
        def step(self, message_log_batch, metadata):
            return "other"

    with pytest.raises(ValueError, match=r"my_user_env.*already registered.*overwrite=True"):
        register_env("my_user_env", Other)
    assert get_env_class("my_user_env") is MyEnv
    register_env("my_user_env", Other, overwrite=True)
    assert get_env_class("my_user_env") is Other
    with pytest.raises(ValueError, match="already registered"):
        register_env("math", Other)  # the built-in is protected too
    assert get_env_class("math") is MathEnvironment


def test_register_math_again_is_noop(clean_registry) -> None:
    register_env("math", "nemo_like.environments.math_environment:MathEnvironment")
    register_env("math", MathEnvironment)
    assert get_env_class("math") is MathEnvironment


def test_register_rejects_bad_targets(clean_registry) -> None:
    class NoStep:
        pass

    with pytest.raises(TypeError, match="step"):
        register_env("bad", NoStep)
    with pytest.raises(ValueError, match="pkg.module.name"):
        register_env("bad", "NoDots")
    with pytest.raises(TypeError, match="class or an import path"):
        register_env("bad", 42)
    with pytest.raises(TypeError, match="class or an import path"):
        register_env("bad")(lambda: None)  # the decorator on a non-class
    assert "bad" not in registered_envs()


def test_import_path_resolved_lazily(clean_registry, helpers, tmp_path: Path) -> None:
    # Registering a path whose module does not exist yet is fine; asking for it is not.
    register_env("later_env", "nl_not_yet_written_mod_xyz.LaterEnv")
    with pytest.raises(ImportError, match="nl_not_yet_written_mod_xyz"):
        get_env_class("later_env")
    (tmp_path / "nl_not_yet_written_mod_xyz.py").write_text(
        "class LaterEnv:\n    def step(self, message_log_batch, metadata):\n        return 'later'\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        importlib.invalidate_caches()
        cls = get_env_class("later_env")
        assert cls.__name__ == "LaterEnv" and cls().step([], []) == "later"
        assert get_env_class("later_env") is cls  # cached
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nl_not_yet_written_mod_xyz", None)

    register_env("echo", f"{HELPER_MODULE}:EchoEnv")
    assert get_env_class("echo") is helpers.EchoEnv
    register_env("no_attr", f"{HELPER_MODULE}.Missing")
    with pytest.raises(ImportError, match="Missing"):
        get_env_class("no_attr")
    register_env("not_class", f"{HELPER_MODULE}.NOT_A_CLASS")
    with pytest.raises(TypeError, match="not a class"):
        get_env_class("not_class")
    register_env("no_step", f"{HELPER_MODULE}.NoStep")
    with pytest.raises(TypeError, match="step"):
        get_env_class("no_step")


# ============================================================================ on Ray
@pytest.fixture(scope="module")
def ray_cluster(ray_session, helpers):
    import ray

    return ray


@pytest.fixture(scope="module")
def math_actor(ray_cluster):
    actor = create_env_actor("math", {"timeout_s": 10.0})
    yield actor
    ray_cluster.kill(actor, no_restart=True)


def _actor_pid(ray, actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=120)


def _grader_pids(ray, actor) -> list[int]:
    return ray.get(
        actor.__ray_call__.remote(lambda self: [w.proc.pid for w in self._pool.workers if w is not None]),
        timeout=120,
    )


def test_actor_grades_mixed_batch(ray_cluster, math_actor) -> None:
    logs, meta, expected = map(list, zip(*BATCH))
    ret = ray_cluster.get(math_actor.step.remote(logs, meta), timeout=120)
    check_batch_result(ret, expected, failures=BATCH_FAILURES)
    assert ret.metadata == meta


def test_actor_restarts_after_kill(ray_cluster, math_actor) -> None:
    ray = ray_cluster
    # Make sure a grader process exists (a sympy-path sample), then kill the actor under it.
    ret = ray.get(math_actor.step.remote([log("\\boxed{2\\sqrt{2}}")], [gt("\\sqrt{8}")]), timeout=120)
    assert ret.rewards.tolist() == [1.0]
    pid_before = _actor_pid(ray, math_actor)
    graders = _grader_pids(ray, math_actor)
    assert graders, "expected a live grader process"

    ray.kill(math_actor, no_restart=False)
    # ray.kill only asks the GCS; a call sent at once can still reach the old process (a CI run
    # saw exactly that). Wait for the process to be gone so the call below needs the restart.
    assert wait_for(lambda: pid_gone(pid_before)), "the killed actor process is still running"
    ret = ray.get(math_actor.step.remote([log("\\boxed{1/2}"), log("nope")], [gt("0.5"), gt("0.5")]), timeout=120)
    check_batch_result(ret, [1.0, 0.0], failures=0)
    assert _actor_pid(ray, math_actor) != pid_before
    # Grader processes die with their actor instead of lingering.
    assert wait_for(lambda: all(pid_gone(p) for p in graders)), f"graders {graders} outlived their actor"


def test_actor_with_bad_config_dies_with_clear_error(ray_cluster) -> None:
    ray = ray_cluster
    with pytest.raises(TypeError, match="dict"):
        create_env_actor("math", ["timeout_s"])  # checked before any actor starts
    actor = create_env_actor("math", {"timeout_s": -1})
    try:
        with pytest.raises(ray.exceptions.RayActorError, match="timeout_s"):
            ray.get(actor.step.remote([log("\\boxed{1}")], [gt("1")]), timeout=120)
    finally:
        ray.kill(actor, no_restart=True)


def test_user_env_actor_via_registry(ray_cluster, clean_registry, helpers) -> None:
    ray = ray_cluster
    register_env("echo", f"{HELPER_MODULE}.EchoEnv")  # by import path, resolved on request
    actor = create_env_actor("echo", {"word": "bye"}, actor_options={"name": "nl_test_echo_env"})
    try:
        out = ray.get(actor.step.remote([[user("hi")], [user("bye")]], [None, None]), timeout=120)
        assert out == [0.0, 1.0]
        assert ray.get(actor.pid.remote(), timeout=60) != os.getpid()  # really another process
        # actor_options reach Ray: the actor can be looked up by the name given there.
        same = ray.get_actor("nl_test_echo_env")
        assert ray.get(same.step.remote([[user("bye")]], [None]), timeout=60) == [1.0]
    finally:
        ray.kill(actor, no_restart=True)
