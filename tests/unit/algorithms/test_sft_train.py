"""run_sft.py's trainer on real workers: a run stopped after a checkpoint and started again ends with the
uninterrupted run's weights and held-out loss; packing trains the same update; LoRA trains and saves a
plain HF folder; bad input stops before Ray starts, naming the file and line."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_like.algorithms.sft import SFTConfig, train_sft
from nemo_like.data.errors import DataError
from nemo_like.data.sft_data import arithmetic_conversations
from nemo_like.models.policy.weight_export import read_safetensors_folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    d = tmp_path_factory.mktemp("chats")
    for name, n, split in (("train", 32, "train"), ("val", 8, "validation")):
        # One- and two-turn chats (38 and 73 tokens, the longer cut to 64): rows of two lengths to pack.
        rows = [r for pair in zip(arithmetic_conversations(n, 0, split, turns=1), arithmetic_conversations(n, 1, split))
                for r in pair]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def whole(ray_session, model_dir, chats, tmp_path_factory):
    """The uninterrupted run: 2 epochs of 4 steps, checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("whole")
    return tmp, train_sft(_cfg(model_dir, chats, tmp, "whole"))


def _cfg(model_dir, chats, tmp_path, name: str, policy: dict | None = None, **trainer) -> SFTConfig:
    return SFTConfig.model_validate({
        "policy": {"model_name": model_dir, "train_global_batch_size": 16, "train_micro_batch_size": 16,
                   "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3}} | (policy or {}),
        "data": {"train": str(chats / "train.jsonl"), "validation": str(chats / "val.jsonl")},
        "trainer": {"num_epochs": 2, "val_period": 3} | trainer,
        "cluster": {"num_workers": 1, "cpus_per_worker": 1},
        "logger": {"log_dir": str(tmp_path / name / "logs"), "tensorboard_enabled": False, "stdout_enabled": False},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(tmp_path / name / "ckpt"), "save_period": 2},
        "output_dir": str(tmp_path / name / "out")})


def test_a_stopped_run_resumes_to_the_uninterrupted_runs_model(whole, model_dir, chats, tmp_path):
    whole_dir, whole = whole
    assert whole["steps"] == 8 and whole["resumed_at"] == 0 and whole["truncated"] == 40  # 73 tokens > 64
    assert whole["last"]["val/loss"] < whole["first"]["val/loss"] - 0.5  # it learnt
    assert all(h["num_tokens"] > 0 and h["grad_norm"] > 0 for h in whole["history"])
    cut = train_sft(_cfg(model_dir, chats, tmp_path, "cut", max_steps=5))  # saves at 2, 4 and 5 (its last)
    assert cut["steps"] == 5
    resumed = train_sft(_cfg(model_dir, chats, tmp_path, "cut"))
    assert resumed["resumed_at"] == 5 and [h["step"] for h in resumed["history"]] == [6, 7, 8]
    assert resumed["first"]["val/loss"] == whole["first"]["val/loss"]
    assert resumed["last"]["val/loss"] == pytest.approx(whole["last"]["val/loss"], rel=1e-6)
    a, b = (read_safetensors_folder(d / n / "out") for d, n in ((whole_dir, "whole"), (tmp_path, "cut")))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))  # each step once
    assert {"train/loss", "train/num_tokens", "train/lr", "train/grad_norm", "timing/train"} <= rows[-1].keys()
    assert "val/loss" in rows[-1]


def test_packing_and_lora_train_and_save_a_merged_model(whole, model_dir, chats, tmp_path):
    both = {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 512},
            "lora": {"enabled": True, "rank": 4}, "optimizer": {"lr": 1e-2}}
    plain = whole[1]
    lora = train_sft(_cfg(model_dir, chats, tmp_path, "lora", both, max_steps=3, val_period=0))
    # Step 1 is the base model either way (the adapter starts at zero): packed rows, the same loss.
    assert lora["history"][0]["loss"] == pytest.approx(plain["history"][0]["loss"], rel=1e-5)
    assert lora["history"][0]["padding_efficiency"] > plain["history"][0]["padding_efficiency"]
    assert lora["first"]["val/loss"] == pytest.approx(plain["first"]["val/loss"], rel=1e-5)
    assert lora["last"]["val/loss"] < lora["first"]["val/loss"] - 0.1  # only the adapter trains, and it learns
    merged = read_safetensors_folder(tmp_path / "lora" / "out")  # a plain HF folder: the adapter merged
    assert not any("lora" in k for k in merged) and "model.embed_tokens.weight" in merged


def test_bad_input_stops_before_ray_starts(model_dir, chats, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text((chats / "train.jsonl").read_text().splitlines()[0] + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "1+1="}]}) + "\n")
    cfg = _cfg(model_dir, chats, tmp_path, "bad").model_copy(deep=True)
    cfg.data.train.path = str(bad)
    with pytest.raises(DataError, match=rf"^{bad}:2: no assistant message"):
        train_sft(cfg)
    with pytest.raises(ValueError, match=r"data.max_length \(80\) is longer than policy.max_total_sequence_length"):
        SFTConfig.model_validate(_cfg(model_dir, chats, tmp_path, "x").model_dump() | {
            "data": {"train": "a.jsonl", "max_length": 80}})
