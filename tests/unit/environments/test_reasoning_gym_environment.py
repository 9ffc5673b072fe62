"""The reasoning_gym environment: the generator's own scorer on the extracted answer, never a crash."""

from __future__ import annotations

import pytest
import ray

from nemo_like.data.reasoning_gym_tasks import ReasoningGymConfig, generate_reasoning_gym_dataset
from nemo_like.environments.env_config import validate_env_config
from nemo_like.environments.reasoning_gym_environment import (
    ReasoningGymEnvConfig,
    ReasoningGymEnvironment,
    extract_answer,
)
from nemo_like.environments.registry import create_env_actor

KEYS = ("rg_dataset", "rg_options", "rg_index")


@pytest.fixture(scope="module")
def rows():
    ds = generate_reasoning_gym_dataset(ReasoningGymConfig(
        kind="reasoning_gym", dataset="basic_arithmetic", split="train", num_samples=40, seed=4,
        options={"min_digits": 2, "max_digits": 2, "min_terms": 2, "max_terms": 2, "operators": ["+"],
                 "allow_negation": False, "allow_parentheses": False}))
    return [dict(r) for r in ds]


def log(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def meta(row):
    return {k: row[k] for k in KEYS} | {"ground_truth": row["expected_answer"]}


def test_extraction_takes_the_last_box_or_tag_only():
    assert extract_answer("3 + 4 = \\boxed{7}. No, \\boxed{ 8 }", "boxed") == "8"
    assert extract_answer("\\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{7} then \\boxed{8", "boxed") is None  # an unclosed last box decides
    assert extract_answer("<answer>5</answer> <answer>6</answer>", "tag") == "6"
    assert extract_answer("<answer>5</answer> <answer>6", "tag") is None  # so does an unclosed last tag
    assert extract_answer("<sol>5</sol>", "tag", "sol") == "5"
    assert extract_answer("<answer>5", "tag") is None and extract_answer("the answer is 5", "boxed") is None
    assert extract_answer("<answer> </answer>", "tag") is None


def test_scores_with_the_generators_scorer_and_counts_what_it_could_not_read(rows):
    env = ReasoningGymEnvironment({})
    try:
        r0, r1, r2 = rows[:3]
        wrong = str(int(r1["expected_answer"]) + 1)
        out = env.step([log(f"so \\boxed{{{r0['expected_answer']}}}."), log(f"\\boxed{{{wrong}}}"),
                        log(f"the answer is {r2['expected_answer']}")], [meta(r0), meta(r1), meta(r2)])
        assert out.rewards.tolist() == [1.0, 0.0, 0.0]
        assert out.terminateds.all() and out.metrics["no_answer_rate"] == pytest.approx(1 / 3)
        assert out.metrics["num_failures"] == 0 and out.metrics["accuracy"] == pytest.approx(1 / 3)
        # basic_arithmetic's own scorer gives partial credit to an answer containing the right one...
        padded = f"\\boxed{{{r0['expected_answer']}0}}"
        credit = env.step([log(padded)], [meta(r0)]).rewards.item()
        assert credit == pytest.approx(len(r0["expected_answer"]) / (len(r0["expected_answer"]) + 1))
    finally:
        env.shutdown()
    strict = ReasoningGymEnvironment({"partial_credit": False})  # ...which partial_credit: false turns off
    try:
        assert strict.step([log(padded)], [meta(r0)]).rewards.item() == 0.0
    finally:
        strict.shutdown()


def test_garbage_scores_zero_and_never_raises(rows):
    env = ReasoningGymEnvironment({"answer_format": "tag"})
    try:
        r = rows[0]
        batch = [log(f"<answer>{r['expected_answer']}</answer>"), [{"role": "assistant", "content": None}], 7,
                 log("<answer>1</answer>"), log("<answer>2</answer>"), log("x" * 100_000)]
        metas = [meta(r), meta(r), meta(r), None, {"rg_dataset": "no_such_dataset", "rg_options": "{}", "rg_index": 0},
                 meta(r)]
        out = env.step(batch, metas)
        assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        assert out.metrics["num_failures"] == 4.0  # bad content, not a log, no metadata, a scorer that raised
        assert env.step(None, None).rewards.numel() == 0
    finally:
        env.shutdown()


def test_config_is_typed():
    with pytest.raises(ValueError, match="env.reasoning_gym.answer_formt: unknown config key"):
        validate_env_config("reasoning_gym", ReasoningGymEnvConfig, {"answer_formt": "tag"})
    with pytest.raises(ValueError, match="env.reasoning_gym.answer_format"):
        validate_env_config("reasoning_gym", ReasoningGymEnvConfig, {"answer_format": "xml"})


def test_runs_as_a_registered_ray_actor(ray_session, rows):
    actor = create_env_actor("reasoning_gym", {"partial_credit": False})
    try:
        r = rows[5]
        out = ray.get(actor.step.remote([log(f"\\boxed{{{r['expected_answer']}}}")], [meta(r)]), timeout=120)
        assert out.rewards.tolist() == [1.0]
    finally:
        ray.kill(actor, no_restart=True)
