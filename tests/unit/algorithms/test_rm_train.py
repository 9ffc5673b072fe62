"""run_rm.py's loop on real workers: a run stopped after a checkpoint and started again resumes there
and ends with exactly the reward model of the run that was never stopped (which ran on a resource
pool, placed as a GRPO run's roles are); metrics.jsonl holds each step once."""

from __future__ import annotations

import json

import pytest

from nemo_like.algorithms.rm import RMConfig, train_reward_model
from nemo_like.utils.checkpoint import CheckpointError


def _cfg(model_dir, tmp_path, name: str, gbs: int = 16, cluster: dict | None = None, **trainer) -> RMConfig:
    return RMConfig.model_validate({
        "reward_model": {"model_name": model_dir, "train_global_batch_size": gbs, "train_micro_batch_size": gbs,
                         "optimizer": {"lr": 3e-3}},
        "data": {"math_pairs": {"num_train": 64, "num_validation": 32}, "max_length": 40},
        "trainer": {"num_epochs": 2, "val_period": 3} | trainer,
        "cluster": {"num_workers": 1, "cpus_per_worker": 1} | (cluster or {}),
        "logger": {"log_dir": str(tmp_path / name / "logs"), "tensorboard_enabled": False},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(tmp_path / name / "ckpt"), "save_period": 2},
        "output_dir": str(tmp_path / name / "out")})


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_model(ray_session, model_dir, tmp_path, capsys):
    # The reward model trained is the policy role: on a pool it trains as it does on a group of its own.
    pool = {"resource_pools": {"rm": {"nodes": 1, "cpus_per_node": 1}}, "roles": {"policy": "rm"}}
    whole = train_reward_model(_cfg(model_dir, tmp_path, "whole", cluster=pool))
    assert whole["steps"] == 8 and whole["resumed_at"] == 0
    plan = capsys.readouterr().out
    assert ("[nemo_like] placement (role -> pool -> nodes):\n  policy (the reward model trained) -> pool 'rm' "
            "(1 node(s) x 1 CPU) -> node ") in plan and plan.count(" ranks 0\n") == 1, plan
    cut = train_reward_model(_cfg(model_dir, tmp_path, "cut", max_steps=5))  # saves at 2, 4 and 5 (its last)
    assert cut["steps"] == 5
    assert "  policy (the reward model trained) -> own group (1 x 1 CPU) -> node " in capsys.readouterr().out
    resumed = train_reward_model(_cfg(model_dir, tmp_path, "cut"))
    assert resumed["resumed_at"] == 5 and resumed["first"] == whole["first"]
    assert resumed["last"]["val/margin"] != whole["first"]["val/margin"]  # it trained ...
    for k in ("val/pair_accuracy", "val/margin", "val/score_mean"):  # ... to the uninterrupted run's model
        assert resumed["last"][k] == pytest.approx(whole["last"][k], rel=1e-5, abs=1e-6), k
    rows = [json.loads(line) for line in (tmp_path / "cut" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "train/loss" in r]
    assert train_steps == list(range(1, 9))
    again = train_reward_model(_cfg(model_dir, tmp_path, "cut"))  # a finished run resumes at its end
    assert again["resumed_at"] == 8 and again["last"] == resumed["last"]
    # Other batches than the checkpoint's run drew: refused, naming what differs, not silently mixed.
    with pytest.raises(CheckpointError, match=r"'train_global_batch_size': 16.*'train_global_batch_size': 8"):
        train_reward_model(_cfg(model_dir, tmp_path, "cut", gbs=8))
