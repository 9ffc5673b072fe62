"""Multi-task data: a list of datasets in the config, each through its own processor, served as one."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_like.algorithms.grpo import build_task_dataset
from nemo_like.config import ConfigError, load_config
from nemo_like.data.datasets import load_dataset_from_config
from nemo_like.data.processors import get_processor, register_processor
from nemo_like.models.tiny import build_char_tokenizer

CONFIG = Path(__file__).parents[1] / "examples" / "configs" / "grpo_multi_env_tiny.yaml"


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG)


def test_multi_env_config_routes_each_task(config):
    tok = build_char_tokenizer()
    cfgs = config.data.validation_list
    assert [c.task_name for c in cfgs] == ["math", "code", "tool"]
    ds = build_task_dataset(cfgs, [load_dataset_from_config(c) for c in cfgs], tok, config.data.max_input_seq_length)
    assert len(ds) == 300
    idx = ds.first_indices(2)
    assert idx == [0, 1, 100, 101, 200, 201]
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
    with pytest.raises(KeyError, match=r"no data processor named 'nope'; registered: \['code', 'math', 'tool'"):
        get_processor("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_processor("math", lambda *a: None)
    marker = lambda datum, spec, tok, n, idx: {"idx": idx}  # noqa: E731
    register_processor("user_task", marker)
    assert get_processor("user_task") is marker
    with pytest.raises(KeyError, match="has no SFT variant"):
        get_processor("user_task", sft=True)


def test_bad_generator_kind_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.train"):
        load_config(CONFIG, ["data.train.1.generator.kind=video"])
