"""SFT chat data: every assistant turn (and nothing else) carries the loss, rendered as GRPO renders a
prompt; cuts are counted; each kind of bad input is one error naming the file and line (or the key)."""

from __future__ import annotations

import json

import pytest

from nemo_like.algorithms.sft_loop import sft_batch
from nemo_like.data.errors import DataError
from nemo_like.data.processors import render_chat, tokenize_text
from nemo_like.data.sft_data import (
    SFTDataConfig,
    SFTSourceConfig,
    arithmetic_conversations,
    read_conversations,
    tokenize_conversations,
)
from nemo_like.models.tiny import build_char_tokenizer

CHAT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "\\boxed{3}"}, {"role": "user", "content": "+4="},
        {"role": "assistant", "content": "\\boxed{7}"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_every_assistant_turn_and_only_it_carries_the_loss(tok):
    (datum,), counts = tokenize_conversations(tok, [CHAT], 200, "x")
    batch = sft_batch([datum], tok.pad_token_id)
    ids, mask = batch["input_ids"][0], batch["token_mask"][0].bool()
    # The row is the whole conversation as the template renders it ...
    assert tok.decode(ids) == render_chat(tok, CHAT, add_generation_prompt=False)
    # ... and the loss is on both assistant turns, end-of-turn token included, nothing else.
    assert tok.decode(ids[mask]) == "\\boxed{3}<|im_end|>\n\\boxed{7}<|im_end|>\n"
    # The context of turn 2 is token for token the prompt GRPO would render for it.
    second = int(mask.nonzero()[-1]) - len(tok("\\boxed{7}<|im_end|>\n")["input_ids"]) + 1
    assert ids[:second].tolist() == tokenize_text(tok, render_chat(tok, CHAT[:4], add_generation_prompt=True)).tolist()
    assert counts == {"truncated": 0, "no_loss": 0} and batch["sample_mask"].tolist() == [1.0]


def test_a_long_conversation_is_cut_at_the_end_and_counted(tok):
    full = len(tokenize_text(tok, render_chat(tok, CHAT, add_generation_prompt=False)))
    (cut,), counts = tokenize_conversations(tok, [CHAT], full - 5, "x")
    mask = sft_batch([cut], tok.pad_token_id)["token_mask"][0]
    assert cut["length"] == full - 5 and counts == {"truncated": 1, "no_loss": 0}
    assert int(mask.sum()) == 11 + 11 - 5  # turn 1 whole (11 tokens), turn 2 less its last 5
    (none,), counts = tokenize_conversations(tok, [CHAT], 10, "x")  # inside the system prompt
    assert none["loss_multiplier"] == 0.0 and counts == {"truncated": 1, "no_loss": 1}


def test_arithmetic_chats_keep_their_splits_apart():
    train, val = arithmetic_conversations(50, 0, "train"), arithmetic_conversations(20, 0, "validation")
    assert len(train) == 50 and len(val) == 20
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in val}
    last = train[0]["messages"]
    a, b = map(int, last[0]["content"].rstrip("=").split("+"))
    assert last[3]["content"] == f"\\boxed{{{a + b + int(last[2]['content'][1:-1])}}}"


def _read(tmp_path, text: str, key: str = "messages"):
    p = tmp_path / "chat.jsonl"
    p.write_text(text)
    return read_conversations(SFTSourceConfig(path=str(p)), key), p


@pytest.mark.parametrize("lines, error", [
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', "{not json"],
     r":2: invalid JSON \(Expecting property name"),
    (['{"prompt": "a", "completion": "b"}'], r":1: no 'messages' \(data.messages_key\) in this row; its keys: "
                                            r"\['completion', 'prompt'\]"),
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}'],
     r":1: message 1 has role 'bot'; expected one of system, user, assistant, tool"),
    (['', '{"messages": [{"role": "user", "content": "a"}]}'], r":2: no assistant message: nothing to train on"),
    (['{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}'],
     r":1: message 0 \(user\) has a int 'content'"),
    ([], r"chat.jsonl: no conversations \(the file is empty\) \(data.train.path\)"),
])
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, lines, error):
    with pytest.raises(DataError, match=error) as e:
        _read(tmp_path, "\n".join(lines) + ("\n" if lines else ""))
    assert str(e.value).startswith(str(tmp_path / "chat.jsonl")) and "\n" not in str(e.value)


def test_the_messages_key_and_sources(tmp_path):
    rows, _ = _read(tmp_path, json.dumps({"chat": CHAT}) + "\n", key="chat")
    assert rows == [CHAT]
    with pytest.raises(DataError, match=r"nope.jsonl: no such file \(data.validation.path\)"):
        read_conversations(SFTSourceConfig(path=str(tmp_path / "nope.jsonl")), "messages", "data.validation")
    # A plain string is the path; subset is for hf: datasets only.
    assert SFTDataConfig(train="a.jsonl").train.path == "a.jsonl"
    with pytest.raises(ValueError, match="subset='main' selects a subset of an hf: dataset"):
        SFTSourceConfig(path="a.jsonl", subset="main")


def test_an_hf_dataset_folder_is_read_and_checked_by_row(tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    rows = arithmetic_conversations(3, 0) + [{"messages": [{"role": "user", "content": "hi"}]}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = SFTSourceConfig(path=f"hf:{folder}", split="train", num_samples=3)
    assert read_conversations(src, "messages") == [r["messages"] for r in rows[:3]]
    with pytest.raises(DataError, match=r"\(split train\): row 3: no assistant message"):
        read_conversations(src.model_copy(update={"num_samples": None}), "messages")
