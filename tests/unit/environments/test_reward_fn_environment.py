"""Reward functions as plain callables: weighting, column passing, and every failure mode scoring 0."""

from __future__ import annotations

import math
import time

import pytest
import torch

from nemo_like.data.datasets import DatasetConfig
from nemo_like.environments.reward_fn_environment import (
    RewardFnEnvironment,
    get_reward_fn,
    math_accuracy,
    register_reward_fn,
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


@pytest.mark.parametrize("bad, kind", [
    (lambda completions, **_: 1 / 0, "errors"),
    (lambda completions, **_: [1.0], "wrong_length"),
    (lambda completions, **_: 3.0, "wrong_length"),
    (lambda completions, **_: [float("nan"), "1", 1.0], "invalid_values"),
])
def test_a_failing_function_scores_zero_is_counted_and_reported_once(bad, kind, capsys):
    good = lambda completions, **_: [1.0] * len(completions)  # noqa: E731
    env = RewardFnEnvironment({"reward_fns": [{"fn": good, "name": "good"}, {"fn": bad, "name": "bad"}]})
    logs, meta = _logs(["a", "b", "c"])
    for _ in range(2):
        ret = env.step(logs, meta)
        expected = [1.0, 1.0, 2.0] if kind == "invalid_values" else [1.0, 1.0, 1.0]
        assert ret.rewards.tolist() == expected
        assert ret.metrics[f"bad/num_{kind}"] == 1.0
    assert capsys.readouterr().out.count("reward function 'bad' failed") == 1


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


def test_dataset_config_routes_reward_fns_to_the_reward_fn_environment():
    gen = {"split": "train", "num_samples": 4, "seed": 1}
    cfg = DatasetConfig(generator=gen, reward_fns=[{"fn": "math_accuracy"}])
    assert (cfg.env_name, cfg.processor) == ("reward_fn", "math")
    with pytest.raises(ValueError, match="graded by env_name 'reward_fn'"):
        DatasetConfig(generator=gen, env_name="math", reward_fns=[{"fn": "math_accuracy"}])
    with pytest.raises(ValueError, match="at least one"):
        DatasetConfig(generator=gen, reward_fns=[])
