"""Multi-task data: a list of datasets in the config, each through its own processor, served as one."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_like.algorithms.grpo_setup import build_task_dataset
from nemo_like.config import ConfigError, load_config
from nemo_like.data.datasets import load_dataset_from_config
from nemo_like.data.processors import get_processor, register_processor
from nemo_like.models.tiny import build_char_tokenizer

CONFIG = Path(__file__).parents[3] / "examples" / "configs" / "grpo_multi_env_tiny.yaml"


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG)


def test_multi_env_config_routes_each_task(config):
    tok = build_char_tokenizer()
    cfgs = config.data.validation_list
    assert [c.task_name for c in cfgs] == ["math", "code", "tool"]
    ds = build_task_dataset(cfgs, [load_dataset_from_config(c) for c in cfgs], tok, config.data.max_input_seq_length)
    assert len(ds) == 500  # 200 math, 100 code, 200 tool problems
    idx = ds.first_indices(2)
    assert idx == [0, 1, 200, 201, 300, 301]
    by_task = {}
    for i in idx:
        d = ds[i]
        by_task.setdefault(d["task_name"], []).append(d)
    math, code, tool = by_task["math"][0], by_task["code"][0], by_task["tool"][0]
    assert math["extra_env_info"]["ground_truth"] == math["extra_env_info"]["expected_answer"]
    assert math["stop_strings"] is None
    assert all(t.startswith("assert f(") for t in code["extra_env_info"]["tests"])
    assert tool["stop_strings"] == ["</tool_call>"] and "expected_calls" in tool["extra_env_info"]
    # Prompts only: the model sees the problem, never the answer or the tests.
    for d in (math, code, tool):
        assert [m["role"] for m in d["message_log"]][-1] != "assistant"
        assert "assert" not in tok.decode(d["message_log"][-1]["token_ids"])


def test_sft_variants_end_with_the_reference_answer(config):
    tok = build_char_tokenizer()
    cfgs = config.data.train_list
    rows = [load_dataset_from_config(c).select(range(3)) for c in cfgs]
    ds = build_task_dataset(cfgs, rows, tok, 224, sft=True)
    for i in range(len(ds)):
        d, row = ds[i], rows[i // 3][i % 3]
        last = tok.decode(d["message_log"][-1]["token_ids"])
        assert d["message_log"][-1]["role"] == "assistant"
        expected = {"math": f"\\boxed{{{row['expected_answer']}}}", "code": row.get("reference_solution"),
                    "tool": f"\\boxed{{{row['expected_answer']}}}"}[d["task_name"]]
        assert expected in last


def test_processor_registry():
    with pytest.raises(KeyError, match=r"unknown data processor 'nope'; registered: \['code', 'math', 'reasoning_gym', 'tool'"):
        get_processor("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_processor("math", lambda *a: None)
    marker = lambda datum, spec, tok, n, idx: {"idx": idx}  # noqa: E731
    register_processor("user_task", marker)
    assert get_processor("user_task") is marker
    with pytest.raises(KeyError, match="has no SFT variant"):
        get_processor("user_task", sft=True)
    register_processor("user_task", marker)  # the same pair again: a no-op
    with pytest.raises(TypeError, match="must be a callable or an import path"):
        register_processor("bad_task", 3)


def test_bad_generator_kind_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.train"):
        load_config(CONFIG, ["data.train.1.generator.kind=video"])


def test_mixture_sampler_draws_in_proportion_and_resumes_exactly():
    from collections import Counter

    from nemo_like.data.sampler import MixtureSampler

    sizes, weights = [100, 10, 50], [1.0, 1.0, 2.0]
    s = MixtureSampler(sizes, weights, seed=3)
    draws = [s.next_indices(32) for _ in range(50)]
    flat = [i for d in draws for i in d]
    part = Counter(0 if i < 100 else 1 if i < 110 else 2 for i in flat)
    assert 0.20 < part[0] / len(flat) < 0.30 and 0.20 < part[1] / len(flat) < 0.30 and 0.45 < part[2] / len(flat) < 0.55
    # Each dataset is walked in its own epochs: the small one's first 10 draws are its 10 rows.
    small = [i for i in flat if 100 <= i < 110]
    assert sorted(small[:10]) == list(range(100, 110)) and s.epoch >= 1
    # A fresh sampler given the state after 20 calls continues with exactly the same draws.
    t = MixtureSampler(sizes, weights, seed=3)
    for _ in range(20):
        t.next_indices(32)
    u = MixtureSampler(sizes, weights, seed=3)
    u.load_state_dict(t.state_dict())
    assert [u.next_indices(32) for _ in range(30)] == draws[20:]
    assert MixtureSampler(sizes, weights, seed=4).next_indices(32) != draws[0]
    with pytest.raises(ValueError, match="mixture"):
        u.load_state_dict({"epoch": 0, "position": 0, "n": 160})
    with pytest.raises(ValueError, match="one weight per dataset"):
        MixtureSampler(sizes, [1.0], seed=0)


def test_sampling_weight_on_all_train_datasets_or_none(config):
    from nemo_like.algorithms.grpo_setup import make_train_sampler
    from nemo_like.config import ConfigError, load_yaml_with_defaults, validate_config
    from nemo_like.data.sampler import EpochSampler, MixtureSampler

    raw = load_yaml_with_defaults(CONFIG)
    for d in raw["data"]["train"][1:]:
        d.pop("sampling_weight", None)
    raw["data"]["train"][0]["sampling_weight"] = 2
    with pytest.raises(ConfigError, match=r"sampling_weight is set on some datasets but not on those of tasks \['code', 'tool'\]"):
        validate_config(raw)
    tok = build_char_tokenizer()
    cfgs = [c.model_copy(update={"sampling_weight": None}) for c in config.data.train_list]
    rows = [load_dataset_from_config(c).select(range(20)) for c in cfgs]
    ds = build_task_dataset(cfgs, rows, tok, config.data.max_input_seq_length)
    assert isinstance(make_train_sampler(cfgs, ds, 0), EpochSampler)
    weighted = [c.model_copy(update={"sampling_weight": w}) for c, w in zip(cfgs, [1.0, 1.0, 6.0])]
    s = make_train_sampler(weighted, ds, 0)
    assert isinstance(s, MixtureSampler)
    idx = s.next_indices(400)
    assert sum(ds[i]["task_name"] == "tool" for i in idx) > 0.65 * 400
