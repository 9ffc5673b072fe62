"""Reward functions as plain callables: weighting, column passing, the typed config, and every failure
mode scoring 0 without raising out of step."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from nemo_like.data.datasets import DatasetConfig
from nemo_like.environments.reward_fn_environment import (
    REWARD_FN_REGISTRY,
    RewardFnEnvConfig,
    RewardFnEnvironment,
    boxed_format,
    get_reward_fn,
    math_accuracy,
    register_reward_fn,
    registered_reward_fns,
)


def _logs(completions, problems=None):
    problems = problems or ["p"] * len(completions)
    return ([[{"role": "user", "content": f"<u>{p}</u>"}, {"role": "assistant", "content": c}]
             for c, p in zip(completions, problems)],
            [{"ground_truth": str(i), "problem": p, "unit": "cm"} for i, p in enumerate(problems)])


def test_weighted_functions_sum_and_get_only_the_columns_they_name():
    seen = {}

    def exact(completions, ground_truth):  # no **kwargs: gets only what it names
        seen["exact"] = ground_truth
        return [1.0 if c == g else 0.0 for c, g in zip(completions, ground_truth)]

    def length(completions, **cols):
        seen["cols"] = sorted(cols)
        return [len(c) for c in completions]

    env = RewardFnEnvironment({"reward_fns": [{"fn": exact, "weight": 2.0}, {"fn": length, "weight": 0.5}]})
    logs, meta = _logs(["0", "xx", "2"])
    ret = env.step(logs, meta)
    assert ret.rewards.tolist() == pytest.approx([2.0 + 0.5, 0.0 + 1.0, 2.0 + 0.5])
    assert seen["exact"] == ["0", "1", "2"]
    assert seen["cols"] == ["ground_truth", "problem", "prompts", "unit"]
    assert ret.terminateds.all() and ret.metrics["num_unscorable"] == 0.0
    assert ret.metrics["exact/mean"] == pytest.approx(2 / 3)


def _raises_half_way(completions, **_):
    yield 1.0
    raise RuntimeError("generator broke")


@pytest.mark.parametrize("bad, kind, count", [
    (lambda completions, **_: 1 / 0, "errors", 1.0),
    (lambda completions, **_: sys.exit(3), "errors", 1.0),  # SystemExit inside a function is its error
    (_raises_half_way, "errors", 1.0),
    (lambda completions, **_: [1.0], "wrong_length", 1.0),
    (lambda completions, **_: [1.0] * 4, "wrong_length", 1.0),
    (lambda completions, **_: 3.0, "wrong_length", 1.0),
    (lambda completions, **_: None, "wrong_length", 1.0),  # None where the list was expected
    (lambda completions, **_: "abc", "wrong_length", 1.0),  # 3 characters are not 3 values
    (lambda completions, **_: {"a": 1, "b": 1, "c": 1}, "wrong_length", 1.0),
    (lambda completions, **_: [float("nan"), "1", 1.0], "invalid_values", 2.0),  # counted per sample
])
def test_a_failing_function_scores_zero_is_counted_and_reported_once(bad, kind, count, capsys):
    good = lambda completions, **_: [1.0] * len(completions)  # noqa: E731
    env = RewardFnEnvironment({"reward_fns": [{"fn": good, "name": "good"}, {"fn": bad, "name": "bad"}]})
    logs, meta = _logs(["a", "b", "c"])
    for _ in range(2):
        ret = env.step(logs, meta)
        expected = [1.0, 1.0, 2.0] if kind == "invalid_values" else [1.0, 1.0, 1.0]
        assert ret.rewards.tolist() == expected
        assert ret.metrics[f"bad/num_{kind}"] == count
        assert "good/num_errors" not in ret.metrics and ret.metrics["num_unscorable"] == 0.0
    assert capsys.readouterr().out.count("reward function 'bad' failed") == 1


@pytest.mark.parametrize("value", [
    float("inf"), float("-inf"), float("nan"), 10**400, 1e39, -(10**39), "1", b"1", True, [1.0], (1.0,),
    {"r": 1.0}, 1j, object(), np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), np.float64("nan"),
    torch.tensor(float("inf")),
])
def test_a_value_that_is_not_a_finite_float_is_an_error_for_that_sample_only(value):
    """Item 12: one bad value scores 0 for its sample and counts once; the function's other values,
    the other function and the other samples still count, and step does not raise."""
    odd = lambda completions, **_: [0.5, value, None]  # noqa: E731
    good = lambda completions, **_: [1.0, 1.0, 1.0]  # noqa: E731
    env = RewardFnEnvironment({"reward_fns": [{"fn": odd, "name": "odd", "weight": 2.0}, {"fn": good, "name": "good"}]})
    ret = env.step(*_logs(["a", "b", "c"]))
    assert ret.rewards.tolist() == [2.0, 1.0, 1.0]  # 2 * 0.5 + 1 | 2 * 0 (invalid) + 1 | None + 1
    assert ret.metrics["odd/num_invalid_values"] == 1.0
    assert ret.metrics["odd/num_unscorable"] == 1.0 and ret.metrics["num_unscorable"] == 0.0
    assert not any(k.startswith("good/num_") and k != "good/num_unscorable" for k in ret.metrics)


@pytest.mark.parametrize("values", [
    np.array([0.5, 1.0], dtype=np.float32), torch.tensor([0.5, 1.0]), (0.5, 1), [np.float64(0.5), np.int64(1)],
    iter([0.5, 1.0]),
])
def test_numpy_torch_and_any_sequence_of_numbers_are_accepted(values):
    env = RewardFnEnvironment({"reward_fns": [lambda completions, **_: values]})
    ret = env.step(*_logs(["a", "b"]))
    assert ret.rewards.tolist() == [0.5, 1.0] and not any("num_invalid" in k or "wrong" in k for k in ret.metrics)


def test_a_weighted_sum_past_float32_is_unscorable_not_inf():
    big = lambda completions, **_: [3e38] * len(completions)  # noqa: E731 - each value fits float32
    env = RewardFnEnvironment({"reward_fns": [{"fn": big, "weight": 2.0}]})
    ret = env.step(*_logs(["a"]))
    assert math.isnan(ret.rewards[0]) and ret.metrics["num_unscorable"] == 1.0


@pytest.mark.parametrize("logs, meta", [
    ([None, "text", [{"role": "assistant", "content": "a"}], [42]], None),
    (None, None),
    ([[{"role": "assistant", "content": "a"}]], "not a list of dicts"),
    (iter([[{"role": "assistant", "content": "a"}]]), [7]),
])
def test_malformed_batches_never_raise(logs, meta):
    env = RewardFnEnvironment({"reward_fns": ["boxed_format"]})
    ret = env.step(logs, meta)
    n = len(ret.rewards)
    assert len(ret.observations) == len(ret.metadata) == n and ret.terminateds.all()
    assert ret.metrics["num_failures"] == (3.0 if n == 4 else 0.0)


def test_slow_function_times_out_and_the_step_goes_on():
    def slow(completions, **_):
        time.sleep(5)
        return [1.0] * len(completions)

    env = RewardFnEnvironment({"reward_fns": [slow], "timeout_s": 0.3})
    t0 = time.perf_counter()
    ret = env.step(*_logs(["a", "b"]))
    assert time.perf_counter() - t0 < 2.0
    assert ret.rewards.tolist() == [0.0, 0.0] and ret.metrics["slow/num_timeouts"] == 1.0


def test_a_hung_function_is_not_called_again_until_its_call_returns():
    import threading

    release = threading.Event()
    calls = []

    def stuck(completions, **_):
        calls.append(len(completions))
        release.wait(10)
        return [1.0] * len(completions)

    env = RewardFnEnvironment({"reward_fns": [stuck], "timeout_s": 0.2})
    threads_before = threading.active_count()
    for _ in range(4):
        ret = env.step(*_logs(["a", "b"]))
        assert ret.rewards.tolist() == [0.0, 0.0] and ret.metrics["stuck/num_timeouts"] == 1.0
    assert calls == [2] and threading.active_count() == threads_before + 1  # one stuck thread, not four
    release.set()
    env.entries[0].hung.join(5)
    ret = env.step(*_logs(["a", "b"]))  # it returned: called again, and now it answers in time
    assert ret.rewards.tolist() == [1.0, 1.0] and calls == [2, 2]


def test_none_means_unscorable_nan_reward_unless_another_function_scores_it():
    maybe = lambda completions, **_: [None if c == "?" else 1.0 for c in completions]  # noqa: E731
    env = RewardFnEnvironment({"reward_fns": [maybe]})
    r = env.step(*_logs(["?", "ok"])).rewards
    assert math.isnan(r[0]) and r[1] == 1.0
    env.add_reward_fn(lambda completions, **_: [0.25] * len(completions), weight=2.0)
    assert env.reward_fn_names() == ["<lambda>", "<lambda>_2"]
    assert env.step(*_logs(["?", "ok"])).rewards.tolist() == [0.5, 1.5]
    env.clear_reward_fns()
    assert torch.isnan(env.step(*_logs(["x"])).rewards).all()


def test_builtin_and_import_path_lookup():
    assert get_reward_fn("math_accuracy") is math_accuracy
    assert get_reward_fn("nemo_like.environments.reward_fn_environment:boxed_format")(["\\boxed{1}", "1"]) == [1.0, 0.0]
    assert math_accuracy(["\\boxed{0.5}", "\\boxed{3}"], ground_truth=["1/2", "4"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="unknown reward function 'nope'"):
        get_reward_fn("nope")
    with pytest.raises(ImportError, match="no_such_module"):
        get_reward_fn("no_such_module:fn")
    register_reward_fn("twice_test", lambda c, **_: [2.0] * len(c))
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("twice_test", lambda c, **_: [3.0] * len(c))
    with REWARD_FN_REGISTRY.isolated():
        register_reward_fn("fmt_by_path", "nemo_like.environments.reward_fn_environment:boxed_format")
        assert get_reward_fn("fmt_by_path") is boxed_format  # imported on first use
        with pytest.raises(TypeError, match="must be callable"):
            register_reward_fn("not_a_fn", 3)
    assert "fmt_by_path" not in registered_reward_fns()


def test_dataset_config_routes_reward_fns_to_the_reward_fn_environment():
    gen = {"split": "train", "num_samples": 4, "seed": 1}
    cfg = DatasetConfig(generator=gen, reward_fns=[{"fn": "math_accuracy"}])
    assert (cfg.env_name, cfg.processor) == ("reward_fn", "math")
    # env_name: math written out (a recipe's): the functions grade in its place.
    assert DatasetConfig(generator=gen, env_name="math", reward_fns=[{"fn": "math_accuracy"}]).env_name == "reward_fn"
    with pytest.raises(ValueError, match="graded by env_name 'reward_fn' .* but env_name is 'code'"):
        DatasetConfig(generator=gen, env_name="code", reward_fns=[{"fn": "math_accuracy"}])
    with pytest.raises(ValueError, match="at least one"):
        DatasetConfig(generator=gen, reward_fns=[])


# ------------------------------------------------------------------------------ typed config
def test_typed_config_defaults_and_bare_entries():
    cfg = RewardFnEnvConfig.model_validate({})
    assert cfg.timeout_s == 30.0 and cfg.reward_fns == [] and cfg.step_timeout_s is None
    f = lambda completions, **_: [1.0] * len(completions)  # noqa: E731 - callables are allowed
    cfg = RewardFnEnvConfig.model_validate({"reward_fns": ["math_accuracy", f, {"fn": f, "weight": 2, "name": "c"}],
                                            "timeout_s": 5, "step_timeout_s": 60})
    assert [(s.fn, s.weight, s.name) for s in cfg.reward_fns] == [("math_accuracy", 1.0, None), (f, 1.0, None),
                                                                   (f, 2.0, "c")]
    env = RewardFnEnvironment({"reward_fns": ["math_accuracy", f, {"fn": f, "weight": 2, "name": "c"}],
                               "timeout_s": 5, "step_timeout_s": 60})
    assert env.reward_fn_names() == ["math_accuracy", "<lambda>", "c"] and env.timeout_s == 5.0


@pytest.mark.parametrize("config, match", [
    ({"timeout": 3}, r"env\.reward_fn\.timeout: unknown config key \(did you mean env\.reward_fn\.timeout_s\?\)"),
    ({"timeout_s": 0}, r"env\.reward_fn\.timeout_s: Input should be greater than 0"),
    ({"timeout_s": "abc"}, r"env\.reward_fn\.timeout_s: Input should be a valid number"),
    ({"timeout_s": True}, r"env\.reward_fn\.timeout_s"),
    ({"reward_fns": "math_accuracy"}, r"env\.reward_fn\.reward_fns: must be a list of reward functions"),
    ({"reward_fns": [{"fn": "nope"}]}, r"env\.reward_fn\.reward_fns\.0\.fn: unknown reward function 'nope'"),
    ({"reward_fns": ["no_such_module_xyz:fn"]}, r"reward_fns\.0\.fn: cannot import .*no_such_module_xyz"),
    ({"reward_fns": [42]}, r"reward_fns\.0\.fn: must be a callable, a registered name or an import path"),
    ({"reward_fns": [{"fn": "math_accuracy", "weight": float("inf")}]}, r"reward_fns\.0\.weight: .*finite"),
    ({"reward_fns": [{"fn": "math_accuracy", "weight": True}]}, r"reward_fns\.0\.weight"),
    ({"reward_fns": [{"fn": "math_accuracy", "wieght": 2}]}, r"reward_fns\.0\.wieght: unknown config key"),
])
def test_bad_config_names_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        RewardFnEnvironment(config)
    with pytest.raises(TypeError, match="dict"):
        RewardFnEnvironment(["math_accuracy"])


def test_config_models_import_without_ray_or_torch():
    """nemo_like.config validates env.<name> with these models before Ray starts."""
    code = ("import sys; from nemo_like.environments.reward_fn_environment import RewardFnEnvConfig; "
            "from nemo_like.environments.tool_environment import ToolEnvConfig; "
            "bad = [m for m in ('ray', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
