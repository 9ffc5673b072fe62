"""Data pipeline: arithmetic generation, file loading and its errors, processors, collation."""

from __future__ import annotations

import functools
import hashlib
import json

import datasets
import pydantic
import pytest
import torch
from torch.utils.data import DataLoader

from nemo_like.data import (
    AllTaskProcessedDataset,
    ArithmeticConfig,
    DataError,
    DatasetConfig,
    TaskDataSpec,
    arithmetic_split_of,
    batched_message_log_to_flat_message,
    generate_arithmetic_dataset,
    load_dataset_from_config,
    math_data_processor,
    rl_collate_fn,
    sft_data_processor,
    write_jsonl,
)
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.tiny import build_char_tokenizer

PROMPT = "Solve: {} Put the answer in \\boxed{{}}."
SYSTEM = "You are a calculator."


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- arithmetic generator
def test_arithmetic_deterministic_by_seed():
    cfg = ArithmeticConfig(split="train", num_samples=300, seed=3, ops=["+", "-", "*"])
    a, b = generate_arithmetic_dataset(cfg), generate_arithmetic_dataset(cfg)
    assert a.to_list() == b.to_list()
    c = generate_arithmetic_dataset(cfg.model_copy(update={"seed": 4}))
    assert a["problem"] != c["problem"]
    assert a.column_names == ["problem", "expected_answer"]


@pytest.mark.parametrize("max_value", [99, 999])  # enumerated space and sampled space
def test_arithmetic_answers_correct_distinct_in_range(max_value):
    cfg = ArithmeticConfig(split="train", num_samples=500, seed=0, min_value=10, max_value=max_value, ops=["+", "-", "*"])
    ds = generate_arithmetic_dataset(cfg)
    assert len(ds) == 500 and len(set(ds["problem"])) == 500
    ops_seen = set()
    for row in ds:
        problem = row["problem"]
        assert problem.endswith("=")
        op = next(o for o in "+-*" if o in problem)
        ops_seen.add(op)
        a, b = (int(x) for x in problem[:-1].split(op))
        assert 10 <= a <= max_value and 10 <= b <= max_value
        assert row["expected_answer"] == str(eval(problem[:-1]))  # noqa: S307 - digits and one operator
    assert ops_seen == {"+", "-", "*"}


def test_default_problem_format():
    row = generate_arithmetic_dataset(ArithmeticConfig(split="train", num_samples=1, seed=0))[0]
    a, b = row["problem"][:-1].split("+")
    assert 0 <= int(a) <= 999 and 0 <= int(b) <= 999
    assert int(row["expected_answer"]) == int(a) + int(b)


@pytest.mark.parametrize("max_value", [49, 999])
def test_train_validation_disjoint_and_split_rule_stable(max_value):
    train = generate_arithmetic_dataset(ArithmeticConfig(split="train", num_samples=1500, seed=1, max_value=max_value))
    val = generate_arithmetic_dataset(ArithmeticConfig(split="validation", num_samples=200, seed=1, max_value=max_value))
    assert not set(train["problem"]) & set(val["problem"])
    assert all(arithmetic_split_of(p) == "train" for p in train["problem"])
    assert all(arithmetic_split_of(p) == "validation" for p in val["problem"])
    # The rule is a fixed sha256 bucket: independent of process, seed and Python hash salting.
    for p in val["problem"][:20]:
        assert int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "big") % 100 < 10


def test_validation_share_is_about_ten_percent():
    problems = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    share = sum(arithmetic_split_of(p) == "validation" for p in problems) / len(problems)
    assert 0.08 < share < 0.12


def test_arithmetic_impossible_request():
    with pytest.raises(DataError, match=r"cannot make 50 distinct 'validation' problems.*only \d+ distinct"):
        generate_arithmetic_dataset(ArithmeticConfig(split="validation", num_samples=50, seed=0, max_value=9))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ops": ["/"]}, "unsupported ops"),
        ({"ops": []}, "must not be empty"),
        ({"min_value": 5, "max_value": 2}, "min_value"),
        ({"num_samples": 0}, "num_samples"),
        ({"split": "test"}, "split"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_arithmetic_config_errors(kwargs, match):
    base = {"split": "train", "num_samples": 10, "seed": 0}
    with pytest.raises(pydantic.ValidationError, match=match):
        ArithmeticConfig(**(base | kwargs))


# --------------------------------------------------------------------------- dataset configs and files
def test_dataset_config_validation(tmp_path):
    gen = ArithmeticConfig(split="train", num_samples=5, seed=0)
    with pytest.raises(pydantic.ValidationError, match="exactly one of 'path' and 'generator'"):
        DatasetConfig()
    with pytest.raises(pydantic.ValidationError, match="exactly one of 'path' and 'generator'"):
        DatasetConfig(path="x.jsonl", generator=gen)
    with pytest.raises(pydantic.ValidationError, match="exactly one '{}'"):
        DatasetConfig(path="x.jsonl", prompt="no placeholder")
    with pytest.raises(pydantic.ValidationError, match="exactly one '{}'"):
        DatasetConfig(path="x.jsonl", prompt="{} and {}")
    with pytest.raises(pydantic.ValidationError, match="exactly one '{}'"):
        DatasetConfig(path="x.jsonl", prompt="{name}")
    with pytest.raises(pydantic.ValidationError, match="unknown_key"):
        DatasetConfig(path="x.jsonl", unknown_key=1)
    assert DatasetConfig(path="x.jsonl", prompt=PROMPT).prompt == PROMPT


def test_load_generator_config():
    gen = ArithmeticConfig(split="validation", num_samples=20, seed=5)
    ds = load_dataset_from_config(DatasetConfig(generator=gen, num_samples=7, task_name="arith"))
    assert len(ds) == 7
    assert ds.column_names == ["problem", "expected_answer", "task_name"]
    assert ds["task_name"] == ["arith"] * 7
    assert ds["problem"] == generate_arithmetic_dataset(gen)["problem"][:7]


def test_load_jsonl_renames_casts_and_keeps_extra_columns(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"question": f"{i}+1=", "answer": i + 1, "response": f"\\boxed{{{i + 1}}}"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    ds = load_dataset_from_config(
        DatasetConfig(path=str(path), problem_key="question", answer_key="answer", num_samples=4)
    )
    assert len(ds) == 4
    assert set(ds.column_names) == {"problem", "expected_answer", "response", "task_name"}
    assert ds["problem"] == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert ds["expected_answer"] == ["1", "2", "3", "4"]  # ints in the file become strings
    assert ds["task_name"] == ["math"] * 4


def test_write_jsonl_and_other_formats_round_trip(tmp_path):
    ds = load_dataset_from_config(DatasetConfig(generator=ArithmeticConfig(split="train", num_samples=6, seed=2)))
    written = write_jsonl(ds, tmp_path / "sub" / "data.jsonl")
    assert [json.loads(line) for line in written.read_text().splitlines()] == ds.to_list()
    ds.to_parquet(str(tmp_path / "data.parquet"))
    ds.to_csv(str(tmp_path / "data.csv"), index=False)
    (tmp_path / "data.json").write_text(json.dumps(ds.to_list()))
    for name in ("data.jsonl", "data.parquet", "data.csv", "data.json"):
        loaded = load_dataset_from_config(DatasetConfig(path=str(tmp_path / ("sub" if name.endswith("l") else "") / name)))
        assert loaded["problem"] == ds["problem"], name
        assert loaded["expected_answer"] == ds["expected_answer"], name


def test_bad_jsonl_line_number_exact(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "1+1=", "expected_answer": "2"}\n\n{"problem": "2+2=", "expected_answer": "4"\n{}\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON \(Expecting ',' delimiter"):
        load_dataset_from_config(DatasetConfig(path=str(path)))


def test_jsonl_line_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"problem": "1+1=", "expected_answer": "2"}\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"^{path}:2: expected a JSON object, got list"):
        load_dataset_from_config(DatasetConfig(path=str(path)))


def test_bad_json_file_line_number(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"problem": "1+1=", "expected_answer": "2"},\n  {"problem": oops}\n]\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON"):
        load_dataset_from_config(DatasetConfig(path=str(path)))


def test_missing_column_names_key_file_and_columns(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "1+1=", "expected_answer": "2"}\n')
    with pytest.raises(DataError) as info:
        load_dataset_from_config(DatasetConfig(path=str(path)))
    msg = str(info.value)
    assert msg == f"{path}: missing column 'problem' (problem_key); columns present: ['question', 'expected_answer']"
    with pytest.raises(DataError, match=r"missing column 'solution' \(answer_key\)"):
        load_dataset_from_config(DatasetConfig(path=str(path), problem_key="question", answer_key="solution"))


def test_missing_file_and_bad_suffix_and_empty(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=rf"^{missing}: file not found$"):
        load_dataset_from_config(DatasetConfig(path=str(missing)))
    txt = tmp_path / "data.txt"
    txt.write_text("1+1=\n")
    with pytest.raises(DataError, match=r"data.txt: unsupported file type '.txt'"):
        load_dataset_from_config(DatasetConfig(path=str(txt)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=rf"^{empty}: no rows$"):
        load_dataset_from_config(DatasetConfig(path=str(empty)))


def test_hub_paths(monkeypatch):
    with pytest.raises(DataError, match="missing dataset name"):
        load_dataset_from_config(DatasetConfig(path="hf:"))

    calls = []

    def fake_load(path, name, split):  # injected: no hub access here (test_prompts_and_sources loads for real)
        calls.append((path, name, split))
        if path == "org/broken":
            raise ConnectionError("offline")
        return datasets.Dataset.from_dict({"question": ["1+2="], "answer": ["3"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    with pytest.raises(DataError, match=r"^hf:org/broken: could not load split 'test' \(ConnectionError: offline\)"):
        load_dataset_from_config(DatasetConfig(path="hf:org/broken", split="test"))
    ds = load_dataset_from_config(DatasetConfig(path="hf:org/math", split="train", problem_key="question", answer_key="answer"))
    assert ds.to_list() == [{"problem": "1+2=", "expected_answer": "3", "task_name": "math"}]
    ds = load_dataset_from_config(DatasetConfig(path="hf:org/math", subset="main", problem_key="question",
                                                answer_key="answer"))
    assert ds["problem"] == ["1+2="]
    assert calls == [("org/broken", None, "test"), ("org/math", None, "train"), ("org/math", "main", "train")]


# --------------------------------------------------------------------------- processors
def test_math_processor_matches_chat_template(tok):
    spec = TaskDataSpec(task_name="math", prompt=PROMPT, system_prompt=SYSTEM)
    datum = math_data_processor({"problem": "12+30=", "expected_answer": "42"}, spec, tok, 256, 5)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT.format("12+30=")}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a calculator.<|im_end|>\n"
        "<|im_start|>user\nSolve: 12+30= Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    log = datum["message_log"]
    assert [m["role"] for m in log] == ["system", "user"]
    assert "".join(m["content"] for m in log) == rendered
    assert log[0]["content"] == "<|im_start|>system\nYou are a calculator.<|im_end|>\n"
    flat = torch.cat([m["token_ids"] for m in log])
    assert flat.dtype == torch.long
    assert flat.tolist() == ids_of(tok, rendered)
    assert datum["length"] == len(flat)
    assert datum["extra_env_info"]["ground_truth"] == "42"
    assert (datum["loss_multiplier"], datum["idx"], datum["task_name"]) == (1.0, 5, "math")


def test_math_processor_raw_problem_no_system(tok):
    spec = TaskDataSpec(task_name="math")
    datum = math_data_processor({"problem": "7*8=", "expected_answer": 56}, spec, tok, 256, 0)
    assert len(datum["message_log"]) == 1
    assert datum["message_log"][0]["content"] == "<|im_start|>user\n7*8=<|im_end|>\n<|im_start|>assistant\n"
    assert datum["extra_env_info"] == {"problem": "7*8=", "expected_answer": 56, "ground_truth": "56"}


def test_list_and_mapping_columns_reach_the_environment(tok):
    # A list of accepted answers or a dict of test cases used to be dropped silently on the way.
    row = {"problem": "7*8=", "expected_answer": "56", "accepted": ["56", "56.0"], "meta": {"source": "x"}}
    info = math_data_processor(row, TaskDataSpec(task_name="math"), tok, 256, 0)["extra_env_info"]
    assert info["accepted"] == ["56", "56.0"] and info["meta"] == {"source": "x"}


def test_math_processor_truncation(tok):
    spec = TaskDataSpec(task_name="math", prompt=PROMPT, system_prompt=SYSTEM)
    row = {"problem": "12+30=", "expected_answer": "42"}
    full = torch.cat([m["token_ids"] for m in math_data_processor(row, spec, tok, 256, 0)["message_log"]])
    cut = math_data_processor(row, spec, tok, 40, 0)  # the system turn alone is 31 tokens
    flat = torch.cat([m["token_ids"] for m in cut["message_log"]])
    assert flat.tolist() == full[:40].tolist()
    assert [len(m["token_ids"]) for m in cut["message_log"]] == [31, 9]
    assert (cut["length"], cut["loss_multiplier"]) == (40, 0.0)
    exact = math_data_processor(row, spec, tok, len(full), 0)
    assert (exact["length"], exact["loss_multiplier"]) == (len(full), 1.0)


def test_processor_missing_column(tok):
    with pytest.raises(KeyError, match="row 3 has no 'problem' column"):
        math_data_processor({"question": "1+1="}, TaskDataSpec("math"), tok, 64, 3)


def test_processor_with_default_system_prompt_template(tok):
    """A Qwen-style template that injects a system prompt still gives exactly the rendered input."""
    local = build_char_tokenizer()  # a fresh one: the module fixture must keep the plain template
    local.chat_template = (
        "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nDefault.<|im_end|>\\n' -}}{%- endif -%}"
        + local.chat_template
    )
    for spec in (TaskDataSpec("math"), TaskDataSpec("math", system_prompt=SYSTEM)):
        datum = math_data_processor({"problem": "1+1=", "expected_answer": "2"}, spec, local, 256, 0)
        chat = ([{"role": "system", "content": SYSTEM}] if spec.system_prompt else []) + [
            {"role": "user", "content": "1+1="}
        ]
        rendered = local.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist() == ids_of(local, rendered)


def test_sft_processor_assistant_tail(tok):
    spec = TaskDataSpec(task_name="math", prompt=PROMPT, system_prompt=SYSTEM)
    row = {"problem": "2+2=", "expected_answer": "4", "response": "\\boxed{4}"}
    datum = sft_data_processor(row, spec, tok, 256, 1)
    log = datum["message_log"]
    assert [m["role"] for m in log] == ["system", "user", "assistant"]
    assert log[-1]["content"] == "\\boxed{4}<|im_end|>\n"
    assert log[-1]["token_ids"].tolist() == ids_of(tok, "\\boxed{4}<|im_end|>\n")
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT.format("2+2=")},
        {"role": "assistant", "content": "\\boxed{4}"},
    ]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert torch.cat([m["token_ids"] for m in log]).tolist() == ids_of(tok, rendered)
    assert datum["extra_env_info"] == {"ground_truth": "4"}
    # response_fn instead of a column
    fn_datum = sft_data_processor(
        {"problem": "2+2=", "expected_answer": "4"}, spec, tok, 256, 1,
        response_fn=lambda r: f"\\boxed{{{r['expected_answer']}}}",
    )
    assert fn_datum["message_log"][-1]["content"] == log[-1]["content"]
    with pytest.raises(KeyError, match="no 'response' column"):
        sft_data_processor({"problem": "2+2=", "expected_answer": "4"}, spec, tok, 256, 1)


def test_all_task_dataset_routing(tok):
    ds = datasets.Dataset.from_dict(
        {"problem": ["1+1=", "2+2=", "3+3="], "expected_answer": ["2", "4", "6"], "task_name": ["math", "sft", "math"]}
    )
    math_spec = TaskDataSpec("math", prompt=PROMPT)
    sft_spec = TaskDataSpec("sft")
    sft = functools.partial(sft_data_processor, response_fn=lambda r: r["expected_answer"])
    data = AllTaskProcessedDataset(ds, tok, math_spec, {"math": (math_spec, math_data_processor), "sft": (sft_spec, sft)}, 128)
    assert len(data) == 3
    assert [m["role"] for m in data[0]["message_log"]] == ["user"]
    assert data[1]["task_name"] == "sft" and data[1]["message_log"][-1]["role"] == "assistant"
    assert data[-1]["idx"] == 2 and data[-1]["extra_env_info"]["ground_truth"] == "6"
    with pytest.raises(IndexError, match="index 3 out of range"):
        data[3]
    only_math = AllTaskProcessedDataset(ds, tok, math_spec, {"math": (math_spec, math_data_processor)}, 128)
    with pytest.raises(KeyError, match=r"no data processor for task 'sft'; known tasks: \['math'\]"):
        only_math[1]
    single = AllTaskProcessedDataset(ds, tok, math_spec, math_data_processor, 128)
    assert single[1]["task_name"] == "math"
    with pytest.raises(TypeError, match=r"task_data_processors\['math'\]"):
        AllTaskProcessedDataset(ds, tok, math_spec, {"math": math_data_processor}, 128)
    with pytest.raises(ValueError, match="max_seq_length"):
        AllTaskProcessedDataset(ds, tok, math_spec, math_data_processor, 0)


# --------------------------------------------------------------------------- collation
def test_rl_collate_fn(tok):
    spec = TaskDataSpec("math", prompt=PROMPT)
    rows = [{"problem": "1+1=", "expected_answer": "2"}, {"problem": "10+10=", "expected_answer": "20"}]
    batch = rl_collate_fn([math_data_processor(r, spec, tok, 50, i) for i, r in enumerate(rows)])
    assert isinstance(batch, BatchedDataDict) and batch.size == 2
    assert set(batch) == {"message_log", "length", "loss_multiplier", "extra_env_info", "task_name", "idx", "stop_strings"}
    full_len = len(ids_of(tok, tok.apply_chat_template([{"role": "user", "content": PROMPT.format("1+1=")}], tokenize=False, add_generation_prompt=True)))
    assert batch["length"].dtype == torch.long and batch["length"].tolist() == [min(full_len, 50), 50]
    assert batch["loss_multiplier"].dtype == torch.float32
    assert batch["loss_multiplier"].tolist() == [1.0 if full_len <= 50 else 0.0, 0.0]
    assert [e["ground_truth"] for e in batch["extra_env_info"]] == ["2", "20"]
    assert batch["idx"] == [0, 1] and batch["task_name"] == ["math", "math"] and batch["stop_strings"] == [None, None]
    with pytest.raises(ValueError, match="empty batch"):
        rl_collate_fn([])


def test_flat_message_masks_and_padding():
    t = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    logs = [
        [
            {"role": "system", "content": "s", "token_ids": t(1, 2)},
            {"role": "user", "content": "u", "token_ids": t(3)},
            {"role": "assistant", "content": "a", "token_ids": t(4, 5), "generation_logprobs": torch.tensor([-0.5, -0.25])},
            {"role": "environment", "content": "e", "token_ids": t(6)},
            {"role": "assistant", "content": "b", "token_ids": t(7), "loss": False},
        ],
        [
            {"role": "user", "content": "u", "token_ids": t(8)},
            {"role": "assistant", "content": "a", "token_ids": t(9, 10, 11)},
        ],
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": 99})
    assert lengths.tolist() == [7, 4] and lengths.dtype == torch.long
    assert flat["token_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 99, 99, 99]]
    assert flat["token_loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]]
    assert flat["generation_logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25, 0, 0], [0] * 7]
    assert flat["generation_logprobs"].dtype == torch.float32
    with pytest.raises(ValueError, match="empty batch"):
        batched_message_log_to_flat_message([], {})
    with pytest.raises(ValueError, match=r"sample 0, message 0 \(role 'user'\): 'token_ids' must be a 1-D tensor, got list"):
        batched_message_log_to_flat_message([[{"role": "user", "content": "x", "token_ids": [1]}]])
    with pytest.raises(ValueError, match="'generation_logprobs' has shape"):
        batched_message_log_to_flat_message(
            [[{"role": "assistant", "content": "x", "token_ids": t(1, 2), "generation_logprobs": torch.zeros(3)}]]
        )


def test_pipeline_dataset_to_flat_tokens(tok):
    """Generated data → processed dataset → DataLoader → flat tokens reproduce the chat-template input."""
    gen = ArithmeticConfig(split="train", num_samples=8, seed=0)
    cfg = DatasetConfig(generator=gen, prompt=PROMPT, system_prompt=SYSTEM)
    ds = load_dataset_from_config(cfg)
    spec = TaskDataSpec(cfg.task_name, prompt=cfg.prompt, system_prompt=cfg.system_prompt)
    data = AllTaskProcessedDataset(ds, tok, spec, {"math": (spec, math_data_processor)}, 256)
    batch = next(iter(DataLoader(data, batch_size=4, shuffle=False, collate_fn=rl_collate_fn)))
    flat, lengths = batched_message_log_to_flat_message(batch["message_log"], {"token_ids": tok.pad_token_id})
    for i in range(4):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT.format(ds[i]["problem"])}]
        expected = ids_of(tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        assert flat["token_ids"][i, : lengths[i]].tolist() == expected
        assert (flat["token_ids"][i, lengths[i] :] == tok.pad_token_id).all()
        assert batch["extra_env_info"][i]["ground_truth"] == ds[i]["expected_answer"]
    assert flat["token_loss_mask"].sum() == 0  # prompts carry no loss


def test_few_shot_examples_are_earlier_chat_turns(tok):
    shots = [{"problem": "1+1=", "response": "\\boxed{2}"}]
    spec = TaskDataSpec(task_name="math", prompt=PROMPT, system_prompt=SYSTEM, few_shot=shots)
    datum = math_data_processor({"problem": "12+30=", "expected_answer": "42"}, spec, tok, 256, 0)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT.format("1+1=")},
            {"role": "assistant", "content": "\\boxed{2}"}, {"role": "user", "content": PROMPT.format("12+30=")}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "".join(m["content"] for m in datum["message_log"]) == rendered
    assert torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist() == ids_of(tok, rendered)
    # From the dataset config: typed, and unknown keys refused.
    cfg = DatasetConfig(generator={"split": "train", "num_samples": 2, "seed": 0}, few_shot=shots)
    assert cfg.few_shot_turns() == shots
    with pytest.raises(pydantic.ValidationError, match="answer"):
        DatasetConfig(generator={"split": "train", "num_samples": 2, "seed": 0}, few_shot=[{"problem": "1", "answer": "2"}])
