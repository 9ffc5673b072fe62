"""The package's own tests: the grading rules, the typed config, and that nemo_like finds the
environment by its entry-point name once the package is installed."""

from __future__ import annotations

import pytest
from nemo_like_reverse import ReverseTextConfig, ReverseTextEnvironment

from nemo_like.environments import get_env_class
from nemo_like.environments.registry import entry_point_package, env_config_model


def _log(answer):
    return [{"role": "user", "content": "Spell 'hello' backwards."}, {"role": "assistant", "content": answer}]


def test_grades_exact_case_and_anagram_answers():
    env = ReverseTextEnvironment({"ignore_case": True, "partial_reward": 0.25})
    out = env.step([_log("olleh"), _log(" OLLEH "), _log("hello"), _log("world")], [{"ground_truth": "olleh"}] * 4)
    assert out.rewards.tolist() == [1.0, 1.0, 0.25, 0.0]
    assert out.terminateds.tolist() == [True] * 4 and out.metrics["num_unscorable"] == 0.0

    strict = ReverseTextEnvironment({})
    assert strict.step([_log("OLLEH"), _log("hello")], [{"ground_truth": "olleh"}] * 2).rewards.tolist() == [0.0, 0.0]


def test_bad_samples_score_zero_and_are_counted():
    env = ReverseTextEnvironment()
    out = env.step([_log("olleh"), "not a log", [{"role": "user", "content": "no answer"}], _log("olleh")],
                   [{"ground_truth": "olleh"}, {"ground_truth": "x"}, {"ground_truth": "x"}, None])
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and out.metrics["num_unscorable"] == 3.0


def test_config_is_checked_with_the_key_named():
    assert ReverseTextConfig().partial_reward == 0.0
    with pytest.raises(ValueError, match="env.reverse_text.partial_reward"):
        ReverseTextEnvironment({"partial_reward": 2.0})
    with pytest.raises(ValueError, match="env.reverse_text.ignore_cas"):
        ReverseTextEnvironment({"ignore_cas": True})


def test_nemo_like_finds_it_by_its_entry_point_name():
    assert get_env_class("reverse_text") is ReverseTextEnvironment
    assert env_config_model("reverse_text") is ReverseTextConfig
    assert entry_point_package("reverse_text") == "nemo-like-reverse 0.1.0"
