"""Conversational prompts (TRL's format: a column holding a list of {"role", "content"} messages):
read from JSONL files and from hf: datasets, checked row by row, rendered through the chat template as
written. Real files, the real `datasets.load_dataset`, the tiny model's char tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from nemo_like.data import DataError, DatasetConfig, TaskDataSpec, load_dataset_from_config, math_data_processor
from nemo_like.data.processors import sft_data_processor
from nemo_like.models.tiny import build_char_tokenizer

BRIEF = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
FOLLOW_UP = [{"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "6"},
             {"role": "user", "content": "And 4+4?"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    # Only where datasets caches what it prepared moves; the load_dataset call is the one a user's run makes.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _jsonl(path: Path, rows: list[dict | str]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _rendered(datum) -> tuple[str, list[int]]:
    log = datum["message_log"]
    return "".join(m["content"] for m in log), torch.cat([m["token_ids"] for m in log]).tolist()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_message_list_column_is_the_prompt_rendered_by_the_chat_template(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": BRIEF, "answer": 4}, {"prompt": FOLLOW_UP, "answer": "8"}])
    cfg = DatasetConfig(path=path, problem_key="prompt", answer_key="answer")
    ds = load_dataset_from_config(cfg)
    assert ds["problem"] == [BRIEF, FOLLOW_UP]  # kept as messages, not cast to their str()
    assert ds["expected_answer"] == ["4", "8"]

    first = math_data_processor(ds[0], TaskDataSpec("math"), tok, 256, 0)
    text, ids = _rendered(first)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert text == tok.apply_chat_template(BRIEF, tokenize=False, add_generation_prompt=True)
    assert ids == _ids(tok, text) and first["length"] == len(ids)
    assert [m["role"] for m in first["message_log"]] == ["system", "user"]
    assert first["extra_env_info"]["ground_truth"] == "4"
    assert first["extra_env_info"]["problem"] == BRIEF  # the environment sees the conversation

    second = math_data_processor(ds[1], TaskDataSpec("math"), tok, 256, 1)
    text, ids = _rendered(second)
    assert text == ("<|im_start|>user\nWhat is 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
                    "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == _ids(tok, text)
    # An earlier assistant turn is prompt, not a completion: no message of the log is an assistant's.
    assert [m["role"] for m in second["message_log"]] == ["user"]

    # SFT appends the target turn after the same prompt.
    sft = sft_data_processor(ds[1], TaskDataSpec("math"), tok, 256, 1, response_fn=lambda d: "8")
    assert sft["message_log"][-1]["content"] == "8<|im_end|>\n"
    assert _rendered(sft)[0] == text + "8<|im_end|>\n"


def test_the_config_system_prompt_goes_only_where_a_conversation_has_none(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"problem": BRIEF, "expected_answer": "4"},
                                            {"problem": FOLLOW_UP, "expected_answer": "8"}])
    cfg = DatasetConfig(path=path, system_prompt="Answer with a number.")
    with pytest.warns(UserWarning, match=r"chat.jsonl: 1 of 2 conversations have a system message of their own and "
                                         r"keep it; system_prompt \('Answer with a number.'\) is put first in the others"):
        ds = load_dataset_from_config(cfg)
    spec = TaskDataSpec("math", system_prompt=cfg.system_prompt)
    own, added = (math_data_processor(ds[i], spec, tok, 256, i) for i in (0, 1))
    assert _rendered(own)[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?")
    assert "Answer with a number." not in _rendered(own)[0]
    assert _rendered(added)[0].startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                                          "<|im_start|>user\nWhat is 3+3?<|im_end|>")
    assert [m["content"] for m in added["message_log"]][0] == "<|im_start|>system\nAnswer with a number.<|im_end|>\n"


@pytest.mark.parametrize("bad, message", [
    ([{"role": "bot", "content": "hi"}], r"message 0 has role 'bot'; expected one of system, user, assistant"),
    ([{"role": "user"}], r"message 0 \(user\) has no 'content'"),
    ([{"content": "hi"}], r"message 0 has no 'role'"),
    (["hi"], r"message 0 is a str, not a \{\"role\": ..., \"content\": ...\} object"),
    ([], r"the message list is empty"),
    ([{"role": "user", "content": ["a", "b"]}], r"message 0 \(user\): 'content' must be a string, got list"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
     r"message 1 is a system message; a system message may only come first"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     r"the last message is the assistant's; a prompt ends with the user's message"),
])
def test_a_malformed_conversation_is_named_by_file_and_line(tmp_path, bad, message):
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": BRIEF, "answer": "4"}, "", {"prompt": bad, "answer": "1"}])
    with pytest.raises(DataError, match=rf"^{path}:3: column 'prompt' is not a valid conversation: {message}"):
        load_dataset_from_config(DatasetConfig(path=path, problem_key="prompt", answer_key="answer"))
    # The same rows as one JSON array: named by the array item.
    array = tmp_path / "chat.json"
    array.write_text(json.dumps([{"prompt": BRIEF, "answer": "4"}, {"prompt": bad, "answer": "1"}]))
    with pytest.raises(DataError, match=rf"^{array}: item 1: column 'prompt' is not a valid conversation: {message}"):
        load_dataset_from_config(DatasetConfig(path=str(array), problem_key="prompt", answer_key="answer"))


def test_text_and_conversations_in_one_file_are_refused_with_both_lines(tmp_path):
    path = _jsonl(tmp_path / "mixed.jsonl", [{"problem": BRIEF, "expected_answer": "4"},
                                             {"problem": "1+1=", "expected_answer": "2"}])
    with pytest.raises(DataError, match=rf"^{path}:2: column 'problem' is text here but a list of messages at "
                                        rf"{path}:1; use one form for every row$"):
        load_dataset_from_config(DatasetConfig(path=path))


@pytest.mark.parametrize("key, value", [("prompt", "Solve: {}"),
                                        ("few_shot", [{"problem": "1+1=", "response": "2"}])])
def test_a_prompt_format_or_few_shot_beside_conversations_is_refused(tmp_path, key, value):
    path = _jsonl(tmp_path / "chat.jsonl", [{"problem": BRIEF, "expected_answer": "4"}])
    with pytest.raises(DataError, match=rf"^{path}: column 'problem' holds conversations \(lists of messages\), "
                                        rf"rendered as written, so this dataset cannot also have a {key} .*; set its "
                                        rf"{key} to null \(a parent config may have set it\)$"):
        load_dataset_from_config(DatasetConfig(path=path, **{key: value}))


def test_the_processor_checks_conversations_it_is_given_directly(tok):
    with pytest.raises(ValueError, match=r"^row 3: the prompt conversation is malformed: message 0 has role 'robot'"):
        math_data_processor({"problem": [{"role": "robot", "content": "x"}], "expected_answer": "1"},
                            TaskDataSpec("math"), tok, 64, 3)
    with pytest.raises(ValueError, match=r"^row 0: a conversational prompt is rendered as written, so task 'math' "
                                         r"cannot also have a prompt \('Q: \{\}'\); set prompt to null"):
        math_data_processor({"problem": BRIEF, "expected_answer": "4"}, TaskDataSpec("math", prompt="Q: {}"), tok, 64, 0)


@pytest.fixture
def hub_folder(tmp_path) -> Path:
    """A dataset laid out as a hub repository: README.md's YAML lists two subsets with their splits."""
    root = tmp_path / "chat_math"
    (root / "plain").mkdir(parents=True)
    (root / "chat").mkdir()
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: plain\n  data_files:\n  - split: train\n    path: plain/train.jsonl\n"
        "- config_name: chat\n  data_files:\n  - split: train\n    path: chat/train.jsonl\n"
        "  - split: test\n    path: chat/test.jsonl\n"
        "---\n# Toy math in two subsets\n")
    _jsonl(root / "plain" / "train.jsonl", [{"question": "1+1=", "answer": "2"}])
    _jsonl(root / "chat" / "train.jsonl", [{"messages": FOLLOW_UP, "answer": "8"},
                                           {"messages": [{"role": "assistant", "content": "hi"}], "answer": "0"}])
    _jsonl(root / "chat" / "test.jsonl", [{"messages": BRIEF, "answer": "4"}])
    return root


def test_hf_dataset_conversations_through_the_same_load_call(hub_folder, tok):
    cfg = DatasetConfig(path=f"hf:{hub_folder}", subset="chat", split="test", problem_key="messages", answer_key="answer")
    ds = load_dataset_from_config(cfg)
    assert ds.to_list() == [{"problem": BRIEF, "expected_answer": "4", "task_name": "math"}]
    text, ids = _rendered(math_data_processor(ds[0], TaskDataSpec("math"), tok, 256, 0))
    assert text == tok.apply_chat_template(BRIEF, tokenize=False, add_generation_prompt=True)
    assert ids == _ids(tok, text)
    # Rows of an hf: dataset have no file lines: the row is named, with the subset and split.
    with pytest.raises(DataError, match=rf"^hf:{hub_folder} \(subset chat, split train\): row 1: column 'messages' is "
                                        r"not a valid conversation: the last message is the assistant's"):
        load_dataset_from_config(cfg.model_copy(update={"split": "train"}))
