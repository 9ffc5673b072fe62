"""reasoning-gym as a task source: rows, disjoint splits, exact regeneration, config errors, mixing."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from nemo_like.algorithms.grpo_setup import build_task_dataset, make_train_sampler
from nemo_like.config import ConfigError, validate_config
from nemo_like.data.datasets import DataError, load_dataset_from_config
from nemo_like.data.reasoning_gym_tasks import (
    ReasoningGymConfig,
    generate_reasoning_gym_dataset,
    import_reasoning_gym,
    reasoning_gym_entry,
    score_reasoning_gym_answer,
    split_of_question,
)
from nemo_like.models.tiny import build_char_tokenizer

ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
         "allow_negation": False, "allow_parentheses": False}


def gen(split="train", n=50, seed=1, dataset="basic_arithmetic", options=None):
    return ReasoningGymConfig(kind="reasoning_gym", dataset=dataset, split=split, num_samples=n, seed=seed,
                              options=ARITH if options is None and dataset == "basic_arithmetic" else options or {})


def test_rows_regenerate_their_entry_and_score_with_the_generators_scorer():
    ds = generate_reasoning_gym_dataset(gen(n=40))
    assert len(ds) == 40 and len(set(ds["problem"])) == 40
    assert {"problem", "expected_answer", "rg_dataset", "rg_options", "rg_index"} <= set(ds.column_names)
    rg = import_reasoning_gym()
    for row in ds.select(range(5)):
        entry = reasoning_gym_entry(row["rg_dataset"], row["rg_options"], row["rg_index"])
        assert entry["question"] == row["problem"] and entry["answer"] == row["expected_answer"]
        # the very numbers: the expression evaluates to the answer
        a, op, b = entry["metadata"]["expression"].split()
        assert int(row["expected_answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert score_reasoning_gym_answer(row["rg_dataset"], row["rg_options"], row["rg_index"],
                                          row["expected_answer"]) == 1.0
        assert score_reasoning_gym_answer(row["rg_dataset"], row["rg_options"], row["rg_index"], None) == 0.0
    assert json.loads(ds[0]["rg_options"])["seed"] == 1
    # The same config gives the same rows; another seed other rows.
    assert generate_reasoning_gym_dataset(gen(n=40))["problem"] == ds["problem"]
    assert generate_reasoning_gym_dataset(gen(n=40, seed=7))["problem"] != ds["problem"]
    assert rg.__name__ == "reasoning_gym"


def test_train_and_validation_never_share_a_question_whatever_the_seeds():
    train = set(generate_reasoning_gym_dataset(gen("train", 1500, seed=1))["problem"])
    val = set(generate_reasoning_gym_dataset(gen("validation", 150, seed=1))["problem"])
    val_other_seed = set(generate_reasoning_gym_dataset(gen("validation", 150, seed=9))["problem"])
    assert not train & val and not train & val_other_seed
    assert all(split_of_question(q) == "validation" for q in val)


def test_other_generators_work_through_the_same_path():
    ds = generate_reasoning_gym_dataset(gen(n=10, dataset="chain_sum", options={"min_terms": 2, "max_terms": 3}))
    assert len(ds) == 10 and all(r == "chain_sum" for r in ds["rg_dataset"])
    row = ds[3]
    assert score_reasoning_gym_answer("chain_sum", row["rg_options"], row["rg_index"], row["expected_answer"]) == 1.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dataset": "basic_arithmetik"}, "no dataset 'basic_arithmetik' (did you mean 'basic_arithmetic'"),
    ({"options": {"min_digit": 1}}, "options.min_digit: not an option of reasoning-gym's 'basic_arithmetic' "
                                    "(did you mean options.min_digits?)"),
    ({"options": {"min_digits": 0}}, "refuses {'min_digits': 0}: min_digits must be positive"),
    ({"options": {"size": 10}}, "options.size: set by the row source (num_samples"),
])
def test_bad_dataset_or_option_is_an_error_naming_it(kwargs, message):
    with pytest.raises(ValidationError, match="reasoning") as e:
        ReasoningGymConfig(**({"kind": "reasoning_gym", "dataset": "basic_arithmetic", "split": "train",
                               "num_samples": 5} | kwargs))
    assert message in str(e.value)


def test_too_few_distinct_questions_is_a_data_error():
    tiny = {**ARITH, "max_digits": 1, "operators": ["+"]}  # 100 questions, ~10 held out
    with pytest.raises(DataError, match=r"only \d+ distinct 'validation' questions .* 50 asked"):
        generate_reasoning_gym_dataset(gen("validation", 50, options=tiny))


@pytest.mark.parametrize(("dataset", "package"), [("zebra_puzzles", "pycosat"), ("game_of_life", "cellpylib")])
def test_a_generator_whose_package_is_left_out_names_it(dataset, package):
    import sys

    import_reasoning_gym()
    if not getattr(sys.modules[package], "__nemo_like_stand_in__", False):
        pytest.skip(f"{package} is installed here")
    with pytest.raises(DataError, match=f"needs the `{package}` package .* `uv pip install {package}`"):
        generate_reasoning_gym_dataset(gen(n=2, dataset=dataset, options={}))


def _config(train: list[dict], **extra) -> dict:
    return {"policy": {"model_name": "unused-folder", "max_total_sequence_length": 256}, "env": {"reasoning_gym": {}},
            "data": {"max_input_seq_length": 200, "train": train, **extra},
            "checkpointing": {"enabled": False}}


def _rg(task, dataset, weight, options, n=300):
    return {"generator": {"kind": "reasoning_gym", "dataset": dataset, "split": "train", "num_samples": n,
                          "seed": 1, "options": options},
            "env_name": "reasoning_gym", "task_name": task, "sampling_weight": weight,
            "prompt": "{} Put the answer in \\boxed{{}}."}


def test_several_generators_mixed_by_weight_in_one_run(monkeypatch):
    monkeypatch.setattr("nemo_like.config.check_model_source", lambda *a, **k: None)
    cfg = validate_config(_config([
        _rg("arith", "basic_arithmetic", 3.0, ARITH),
        _rg("chain", "chain_sum", 1.0, {"min_terms": 2, "max_terms": 3}, n=100),
    ]))
    rows = [load_dataset_from_config(c) for c in cfg.data.train_list]
    ds = build_task_dataset(cfg.data.train_list, rows, build_char_tokenizer(), 200)
    sampler = make_train_sampler(cfg.data.train_list, ds, seed=0)
    drawn = Counter(ds[i]["task_name"] for _ in range(50) for i in sampler.next_indices(16))
    assert 0.7 < drawn["arith"] / 800 < 0.8  # 3:1 whatever the sizes (300 and 100 rows)
    datum = ds[len(rows[0]) + 2]  # a chain_sum row: its own columns reach its environment
    assert datum["task_name"] == "chain" and datum["extra_env_info"]["rg_dataset"] == "chain_sum"


def test_a_prompt_without_the_answer_format_is_refused_before_ray(monkeypatch):
    monkeypatch.setattr("nemo_like.config.check_model_source", lambda *a, **k: None)
    bare = _rg("arith", "basic_arithmetic", None, ARITH) | {"prompt": "{}"}
    with pytest.raises(ConfigError, match=r"data.train \(task 'arith'\): prompt: neither prompt nor system_prompt "
                                          r"states the answer format .*\\\\boxed"):
        validate_config(_config([bare]))
    tag = _config([_rg("arith", "basic_arithmetic", None, ARITH)])
    tag["env"]["reasoning_gym"] = {"answer_format": "tag"}
    with pytest.raises(ConfigError, match="answer_format=tag reads \\('<answer>'\\)"):
        validate_config(tag)
    tag["data"]["train"][0]["system_prompt"] = "Answer inside <answer></answer>."
    assert validate_config(tag).data.train_list[0].task_name == "arith"
    math_rows = {"generator": {"split": "train", "num_samples": 5, "seed": 1}, "env_name": "reasoning_gym",
                 "prompt": "{} \\boxed{{}}"}
    with pytest.raises(ConfigError, match="needs rows from generator: {kind: reasoning_gym"):
        validate_config(_config([math_rows]))
