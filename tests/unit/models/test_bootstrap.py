"""The bootstrapped base model's supervised run: stopping at a held-out loss (bootstrap.sft.stop_at_val_loss)
on rows kept out of training, and the cache key of configs that do not use it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_like.config import load_config
from nemo_like.data.errors import DataError
from nemo_like.models.bootstrap import _split_holdout, bootstrap_cache_path, ensure_base_model

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_tiny.yaml"


def _cfg(cache, *over):
    return load_config(str(CONFIG), [f"bootstrap.cache_dir={cache}", "bootstrap.model.hidden_size=32",
                                     "bootstrap.model.num_layers=1", "bootstrap.sft.batch_size=16",
                                     "bootstrap.sft.micro_batch_size=16", "bootstrap.sft.warmup_steps=0", *over])


def _datum(i: int) -> dict:
    return {"message_log": [{"role": "user", "token_ids": torch.tensor([i, 1])},
                            {"role": "assistant", "token_ids": torch.tensor([2, i, 3])}],
            "loss_multiplier": 1.0, "length": 5}


def test_the_holdout_is_drawn_by_seed_and_kept_out_of_training():
    data = [_datum(i) for i in range(50)]
    s = SimpleNamespace(stop_at_val_loss=0.5, holdout_rows=8)
    train, held = _split_holdout(data, s, seed=0, pad_id=0)
    trained = {int(train[i]["message_log"][0]["token_ids"][0]) for i in range(len(train))}
    kept = set(held["input_ids"][:, 0].tolist())
    assert len(train) == 42 and len(kept) == 8 and trained | kept == set(range(50)) and not trained & kept
    assert held["token_mask"][0].tolist() == [0, 0, 1, 1, 1]  # the loss is the assistant's tokens'
    assert set(_split_holdout(data, s, seed=0, pad_id=0)[1]["input_ids"][:, 0].tolist()) == kept
    assert set(_split_holdout(data, s, seed=1, pad_id=0)[1]["input_ids"][:, 0].tolist()) != kept
    # Without a mark to stop at, every row trains (and the base model is the one built before).
    assert _split_holdout(data, SimpleNamespace(stop_at_val_loss=None, holdout_rows=8), 0, 0) == (data, None)
    with pytest.raises(DataError, match="bootstrap.sft.holdout_rows=50 leaves nothing to train on"):
        _split_holdout(data, SimpleNamespace(stop_at_val_loss=0.5, holdout_rows=50), 0, 0)


def test_the_cache_key_of_a_config_without_the_stop_is_unchanged(tmp_path):
    # Caches built before the keys existed stay valid: the keys join the key only when set.
    plain = bootstrap_cache_path(_cfg(tmp_path))
    assert bootstrap_cache_path(_cfg(tmp_path, "bootstrap.sft.holdout_rows=256", "bootstrap.sft.val_every=25")) == plain
    assert bootstrap_cache_path(_cfg(tmp_path, "bootstrap.sft.stop_at_val_loss=0.1")) != plain


def test_the_supervised_run_stops_at_the_held_out_loss(ray_session, tmp_path, capsys):
    # A mark the first check reaches: the run stops there, says so, and keeps the record with the model.
    out = Path(ensure_base_model(_cfg(tmp_path, "bootstrap.sft.num_steps=40", "bootstrap.sft.val_every=3",
                                      "bootstrap.sft.stop_at_val_loss=50", "bootstrap.sft.holdout_rows=32")))
    info = json.loads((out / "bootstrap.json").read_text())
    assert info["steps"] == 3 and info["reached"] and 0 < info["val_loss"] <= 50
    assert "bootstrap SFT stopped at step 3: held-out loss" in capsys.readouterr().out
    assert (out / "config.json").exists()
    # A mark never reached: num_steps steps, checked every val_every steps and after the last.
    out = Path(ensure_base_model(_cfg(tmp_path, "bootstrap.sft.num_steps=7", "bootstrap.sft.val_every=3",
                                      "bootstrap.sft.stop_at_val_loss=1e-6", "bootstrap.sft.holdout_rows=32")))
    info = json.loads((out / "bootstrap.json").read_text())
    assert info["steps"] == 7 and not info["reached"] and list(info["val_losses"]) == ["3", "6", "7"]
    assert info["val_losses"]["7"] < info["val_losses"]["3"]  # it learns on what it trains, held out
    assert "ran its 7 steps (bootstrap.sft.num_steps) without the held-out loss reaching" in capsys.readouterr().out
