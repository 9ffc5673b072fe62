"""run_dpo.py's loop on real workers (packed rows, each pair's prompt computed once): a run stopped
after a checkpoint and started again ends with exactly the uninterrupted run's policy and metrics;
the greedy held-out check and its McNemar line; bad preference files refused before Ray, naming
file and line."""

from __future__ import annotations

import json

import pytest

from nemo_like.algorithms.dpo import DPOConfig, accuracy_line, train_dpo
from nemo_like.data.errors import DataError


def _cfg(model_dir, tmp_path, name: str, data: dict | None = None, dpo: dict | None = None, **trainer) -> DPOConfig:
    return DPOConfig.model_validate({
        "policy": {"model_name": model_dir, "train_global_batch_size": 16, "train_micro_batch_size": 16,
                   "logprob_batch_size": 64, "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3},
                   "sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 1024},
                   "generation": {"max_new_tokens": 6}},
        "data": data or {"math_pairs": {"num_train": 32, "num_validation": 16}, "max_length": 40},
        "dpo": {"beta": 0.5} | (dpo or {}),
        "trainer": {"num_epochs": 2, "val_period": 3} | trainer,
        "validation": {"math_problems": 12},
        "cluster": {"num_workers": 1, "cpus_per_worker": 1},
        "logger": {"log_dir": str(tmp_path / name / "logs"), "tensorboard_enabled": False, "stdout_enabled": False},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(tmp_path / name / "ckpt"), "save_period": 2},
        "output_dir": str(tmp_path / name / "out")})


def _rows(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_a_stopped_run_resumes_to_the_same_policy(ray_session, model_dir, tmp_path):
    whole = train_dpo(_cfg(model_dir, tmp_path, "whole"))
    assert whole["steps"] == 8 and whole["resumed_at"] == 0
    rows = _rows(tmp_path, "whole")
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    # At the reference the margin is 0 and the loss log 2; DPO then separates the sides.
    assert train[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3) and train[0]["train/reward_margin"] == 0
    assert whole["last"]["val/reward_margin"] > whole["first"]["val/reward_margin"] == pytest.approx(0, abs=1e-5)
    assert train[-1]["train/reward_accuracy"] > 0.5
    # Both sides of a pair share the prompt: packing computes it once.
    assert all(r["train/computed_tokens_ratio"] < 1 for r in train)
    assert len(whole["math_before"]) == len(whole["math_after"]) == 12
    line = accuracy_line(whole)
    assert line.startswith("held-out greedy accuracy: ") and "at step 8" in line and "McNemar p" in line, line

    # Each step's pairs are one packed micro-batch: trained in one pass; two passes train the same.
    assert all(r["train/one_pass"] == 1.0 for r in train)
    two = train_dpo(_cfg(model_dir, tmp_path, "two", dpo={"one_pass": False}, max_steps=3))
    two_rows = [r for r in _rows(tmp_path, "two") if "train/loss" in r]
    assert [r["train/one_pass"] for r in two_rows] == [0.0] * 3
    for a, b in zip(two_rows, train[:3]):
        for k in ("train/loss", "train/reward_margin", "train/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    assert two["steps"] == 3

    cut = train_dpo(_cfg(model_dir, tmp_path, "cut", max_steps=5))  # saves at 2, 4 and 5 (its last)
    assert cut["steps"] == 5
    resumed = train_dpo(_cfg(model_dir, tmp_path, "cut"))
    assert resumed["resumed_at"] == 5 and resumed["first"] == whole["first"]
    assert resumed["math_before"] == whole["math_before"] and resumed["math_after"] == whole["math_after"]
    for k, v in whole["last"].items():
        assert resumed["last"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    steps = [r["step"] for r in _rows(tmp_path, "cut") if "train/loss" in r]
    assert steps == list(range(1, 9))  # each step once: the rows after the checkpoint were dropped
    last_whole = next(r for r in reversed(_rows(tmp_path, "whole")) if "train/loss" in r)
    last_cut = next(r for r in reversed(_rows(tmp_path, "cut")) if "train/loss" in r)
    assert last_cut["train/loss"] == pytest.approx(last_whole["train/loss"], rel=1e-5)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "1+1=", "chosen": "\\\\boxed{2}"}', r"bad\.jsonl:2: no 'rejected'"),
    ('{"prompt": "1+1=", "chosen": "\\\\boxed{2}", "rejected": ""}', r"bad\.jsonl:2: 'rejected' is empty"),
    ('{"prompt": "1+1=", "chosen": "\\\\boxed{2}", "rejected": "\\\\boxed{2}"}',
     r"bad\.jsonl:2: 'chosen' and 'rejected' are the same"),
    ('{"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "assistant", "content": "2"}], '
     '"rejected": [{"role": "assistant", "content": "2"}]}', r"bad\.jsonl:2: 'chosen' and 'rejected' are the same"),
])
def test_a_bad_preference_file_is_refused_before_ray_naming_the_line(model_dir, tmp_path, line, message):
    good = '{"prompt": "2+2=", "chosen": "\\\\boxed{4}", "rejected": "\\\\boxed{5}"}'
    (tmp_path / "bad.jsonl").write_text(good + "\n" + line + "\n")
    (tmp_path / "val.jsonl").write_text(good + "\n")
    data = {"train": str(tmp_path / "bad.jsonl"), "validation": str(tmp_path / "val.jsonl"), "max_length": 40}
    with pytest.raises(DataError, match=message):
        train_dpo(_cfg(model_dir, tmp_path, "bad", data=data))
