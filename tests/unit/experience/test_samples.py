"""sample_rows: the rows a person reads (notebook table, samples.jsonl) from a rolled-out batch."""

from __future__ import annotations

import math

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.experience.samples import sample_rows


def _batch() -> BatchedDataDict:
    logs = [[{"role": "system", "content": "Add. "}, {"role": "user", "content": "1+2="},
             {"role": "assistant", "content": "3"}],
            [{"role": "user", "content": "call a tool"}, {"role": "assistant", "content": "<call>"},
             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]]
    return BatchedDataDict(message_log=logs, task_name=["math", "tool"],
                           extra_env_info=[{"problem": "1+2=", "ground_truth": "3"}, None],
                           total_reward=torch.tensor([1.0, math.nan]), num_turns=torch.tensor([1, 2]),
                           truncated=torch.tensor([False, True]), grading_error=[None, "grader timed out"])


def test_rows_split_prompt_and_completion_and_mark_other_roles():
    rows = sample_rows(_batch())
    assert rows[0] == {"task": "math", "problem": "1+2=", "prompt": "Add. 1+2=", "completion": "3", "reward": 1.0,
                       "ground_truth": "3", "turns": 1, "truncated": False}
    assert rows[1]["prompt"] == "call a tool" and rows[1]["completion"] == "<call>\n[tool] 42\n42"
    assert rows[1]["reward"] is None and rows[1]["problem"] is None and rows[1]["truncated"] is True
    assert rows[1]["error"] == "grader timed out"  # why it has no reward
    assert len(sample_rows(_batch(), limit=1)) == 1 and len(sample_rows(_batch(), limit=5)) == 2


def test_advantages_per_sample_or_per_token():
    b = _batch()
    b["advantages"] = torch.tensor([0.5, -1.0])
    assert [r["advantage"] for r in sample_rows(b)] == [0.5, -1.0]
    # GAE: [N, T], zero where no token carries one (prompt, environment tokens, padding).
    b["advantages"] = torch.tensor([[0.0, 1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert [r["advantage"] for r in sample_rows(b)] == [2.0, 0.0]
