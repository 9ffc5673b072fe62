"""Preference pairs: both file formats, every bad line named by file and line, the math recipe, and
the chosen/rejected rows the reward model trains on."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from nemo_like.data.errors import DataError
from nemo_like.data.preferences import load_preference_pairs, math_preference_pairs, tokenize_pairs
from nemo_like.data.processors import render_chat


def _write(tmp_path, rows) -> str:
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_plain_and_chat_pairs_load_as_the_same_messages(tmp_path):
    chat = {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}],
            "chosen": [{"role": "assistant", "content": "3"}], "rejected": [{"role": "assistant", "content": "4"}]}
    plain, msgs = load_preference_pairs(_write(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, "", chat]))
    assert plain.messages("chosen") == [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert msgs.messages("rejected") == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="},
                                         {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2=", "chosen": "3"}, r"pairs.jsonl:2: no 'rejected'"),
    ({"prompt": "1+2=", "chosen": "  ", "rejected": "4"}, r"pairs.jsonl:2: 'chosen' is empty"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": []}, r"pairs.jsonl:2: 'rejected' is missing or empty"),
    ({"prompt": "1+2=", "chosen": [{"role": "assistant"}], "rejected": "4"}, r"'chosen'\[0\] is not a message"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, r"pairs.jsonl:2: 'chosen' and 'rejected' are the same"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, r"pairs.jsonl:2: the same pair as line 1"),
    ("[1, 2]", r"pairs.jsonl:2: expected a JSON object"),
    ('{"prompt": ', r"pairs.jsonl:2: invalid JSON"),
])
def test_each_bad_line_is_named_by_file_and_line(tmp_path, row, message):
    with pytest.raises(DataError, match=message):
        load_preference_pairs(_write(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, row]))


def test_an_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no preference pairs"):
        load_preference_pairs(_write(tmp_path, ["", " "]))
    with pytest.raises(DataError, match="no such preference file"):
        load_preference_pairs(tmp_path / "nope.jsonl")


def test_math_pairs_put_the_right_sum_against_a_near_or_a_far_miss():
    rows = [{"problem": f"{a}+{b}=", "expected_answer": str(a + b)} for a, b in [(12, 34), (0, 0), (99, 99), (45, 9)]]
    far = math_preference_pairs(rows * 50, seed=3)
    wrongs = {int(p.rejected[0][1][len("\\boxed{"):-1]) for p in far}
    assert all(0 <= w <= 397 for w in wrongs) and len(wrongs) > 50  # any number, never the right one
    assert all(p.rejected != p.chosen for p in far)
    with pytest.raises(ValueError, match="'far' or 'near'"):
        math_preference_pairs(rows, wrong="close")
    pairs = math_preference_pairs(rows, seed=3, wrong="near")
    for row, pair in zip(rows, pairs, strict=True):
        answer = int(row["expected_answer"])
        assert pair.prompt == (("user", row["problem"]),) and pair.chosen == (("assistant", f"\\boxed{{{answer}}}"),)
        wrong = int(pair.rejected[0][1][len("\\boxed{"):-1])
        assert wrong != answer and wrong >= 0
        assert abs(wrong - answer) in (1, 10) or sorted(str(wrong)) == sorted(str(answer))


def test_malformed_share_rejects_unreadable_right_answers_the_verifier_scores_0():
    from nemo_like.environments.math_environment import verify_math_answer

    rows = [{"problem": f"{a}+{b}=", "expected_answer": str(a + b)} for a in range(0, 100, 3) for b in range(0, 100, 11)]
    pairs = math_preference_pairs(rows, seed=0, malformed=0.5)
    assert math_preference_pairs(rows, seed=0, malformed=0.5) == pairs  # seeded
    bad = [p for p in pairs if not re.fullmatch(r"\\boxed\{\d+\}", p.rejected[0][1])]
    assert 0.4 < len(bad) / len(pairs) < 0.6
    kinds = {"empty": 0, "unboxed": 0, "non-digit": 0}
    for row, p in zip(rows, pairs, strict=True):
        rejected = p.rejected[0][1]
        assert p.chosen == (("assistant", f"\\boxed{{{row['expected_answer']}}}"),)
        assert verify_math_answer(rejected, row["expected_answer"]) == 0.0  # never right by another spelling
        if p in bad:
            kinds["empty" if rejected == "\\boxed{}" else "unboxed" if rejected.isdigit() else "non-digit"] += 1
    assert all(n > 10 for n in kinds.values()), kinds
    assert math_preference_pairs(rows, seed=0) == math_preference_pairs(rows, seed=0, malformed=0.0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        math_preference_pairs(rows, malformed=1.5)


def test_tokenized_pairs_interleave_chosen_and_rejected_and_count_cuts(model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = load_preference_pairs(_write(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "45"},
                                                    {"prompt": "9+9=", "chosen": "18" * 30, "rejected": "17"}]))
    out = tokenize_pairs(pairs, tok, max_length=40)
    ids, lengths = out["input_ids"], out["input_lengths"]
    assert ids.shape[0] == 4 and out["truncated"].tolist() == [False, True]
    assert ids[0, :lengths[0]].tolist() == tok(render_chat(tok, pairs[0].messages("chosen"), False),
                                               add_special_tokens=False)["input_ids"]
    assert lengths[1] == lengths[0] + 1  # "45" against "3": one character more (a char-level tokenizer)
    assert lengths[2] == 40 and int(lengths[3]) < 40
